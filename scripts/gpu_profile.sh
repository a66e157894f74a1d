#!/usr/bin/env bash
# Profile real-size layers of the zoo with Megatron's layers on one GPU, print measured against analytic
# per kind, and write the calibration data the analytic model reads (octopipe_plugin/costs/calibration.json).
#
#   bash scripts/gpu_profile.sh            # PYTHON=... to pick an interpreter with a CUDA torch + megatron-core
#
# Needs a Python with a CUDA build of torch and megatron-core (scripts/install.sh installs the CPU build:
# on a GPU machine install torch's CUDA wheel first). Transformer Engine is used when it imports
# (--megatron-spec auto); Mamba layers are measured only where mamba-ssm's kernels are installed
# (WITH_MAMBA=1 tries `pip install mamba-ssm causal-conv1d`, which may compile for many minutes),
# otherwise they keep the analytic figures and are marked "source": "analytic". Each model profiles
# one layer per distinct kind (bf16, tp 1, the zoo's sequence length): a few minutes in all on an H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_profile_out}
MODELS=${MODELS:-"llama3-8b deepseek-v3-mini nemotron-h gemma3"}
REPEATS=${REPEATS:-20}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_profile.sh: torch {torch.__version__} sees no CUDA device; run it on a GPU machine "
             "with a CUDA build of torch (PYTHON=/path/to/python)")
import megatron.core
print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PYEOF

if [ "${WITH_MAMBA:-0}" = 1 ] && ! "$PY" -c "import mamba_ssm" 2>/dev/null; then
  timeout "${MAMBA_INSTALL_S:-300}" "$PY" -m pip install -q --no-build-isolation mamba-ssm causal-conv1d \
    || echo "mamba-ssm did not install within the limit: Mamba layers keep the analytic model's figures"
fi

mkdir -p "$OUT"
for model in $MODELS; do
  echo "== $model"
  # tp 1: one rank's layer; the zoo's tp > 1 models are profiled whole on one GPU (analytic per-rank costs
  # at their tp come from the calibrated model afterwards)
  "$PY" -m octopipe_plugin profile "$model" --impl megatron --tp 1 --dtype bf16 --repeats "$REPEATS" --warmup 3 \
    --progress -o "$OUT/$model.json"
done

echo "== measured against analytic per kind; calibration written"
"$PY" -m octopipe_plugin calibrate "$OUT"/*.json --write
echo "gpu_profile.sh: $(( $(date +%s) - start )) s; profiles in $OUT/, calibration in octopipe_plugin/costs/calibration.json"
