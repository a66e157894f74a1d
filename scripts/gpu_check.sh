#!/usr/bin/env bash
# The executor's device path in one command (under 10 minutes on one GPU):
#   bash scripts/gpu_check.sh [--ranks 4] [--steps 5] [--device auto|cuda|cpu]
#   bash scripts/gpu_check.sh --te-split   (Transformer Engine's I/W split as the Megatron runner does it;
#                                           writes the record --octopipe-te-split needs: adapters/megatron/te.py)
# Two or more GPUs: NCCL, one rank per GPU. One GPU: several ranks share it over gloo, device
# tensors staged through host memory (NCCL refuses two ranks on one device). For 1F1B,
# interleaved 1F1B, ZB-V, a plan tuned on costs measured on this device, and a (hidden, mask)
# multi-tensor plan: gradients against a single-process reference on the same device, then the
# measured step time against the simulator's prediction. Exits non-zero when a gradient differs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ "${1:-}" = "--te-split" ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 600 "$PY" -m octopipe_plugin.testing.te_split_check
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 600 "$PY" -m octopipe_plugin.executor.gpu_check "$@"
