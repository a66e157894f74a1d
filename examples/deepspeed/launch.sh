#!/usr/bin/env bash
# Train the GPT-style example under an OctoPipe plan on 4 local CPU processes (gloo).
# On GPUs: deepspeed --num_gpus <n> examples/deepspeed/train_gpt.py --ds-config examples/deepspeed/ds_config.json
# (the tune block's cluster must have as many devices as there are pipeline ranks).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-4}
PY=${PYTHON:-python}
mkdir -p ds_run
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} LOCAL_SIZE=$NPROC
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" examples/deepspeed/train_gpt.py \
    --ds-config examples/deepspeed/ds_config.json "$@"
