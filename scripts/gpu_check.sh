#!/usr/bin/env bash
# The executor's device path in one command (under 10 minutes on one GPU):
#   bash scripts/gpu_check.sh [--ranks 4] [--steps 5] [--device auto|cuda|cpu] [--plans 1f1b,...]
# One line per check, then "gpu check: N passed, M failed" (exit status 1 when one failed):
# the CUDA lane's self path on NCCL (world of one: side stream, events, record_stream, kept
# buffers, watchdog), three stages on one device, then 1F1B, interleaved 1F1B, ZB-V and a plan
# tuned on costs measured here (two or more GPUs: NCCL, one rank per GPU; one GPU: ranks share
# it over gloo, staged through host; no GPU: gloo on CPU), gradients against a single-process
# reference with both exchanges, step time against the simulator's prediction; the Megatron,
# DeepSpeed and Transformer Engine hooks where those packages import ("skipped" otherwise).
# See octopipe_plugin/testing/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 600 "$PY" -m octopipe_plugin.testing.gpu_check "$@"
