#!/usr/bin/env bash
# Install OctoPipe with its test and framework dependencies into ./.venv (CPU machine, Python 3.11).
# torch is pinned to 2.13.0 first so pip takes the local CPU build and nothing pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q "torch==2.13.0"
pip install -q -e ".[test,solver,fast]" "packaging>=24.2" numpy
if ! python -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_OPS=0 pip install -q --no-build-isolation "deepspeed==0.19.8"
fi
# DeepSpeed's CPU accelerator compiles its shared-memory comm op at the first init_distributed of a machine
# (deepspeed/comm/torch.py build_shm_op, from TorchBackend.__init__; ~35 s of 2 cores, cached under
# ~/.cache/torch_extensions, rebuilt when the venv's path changes). Built here, beside the installs below, instead
# of inside the first DeepSpeed test; a failure here only leaves that build to the first test.
# torch's build lock (FileBaton: a `lock` file in the op's build folder) outlives a build that was killed, and every
# later load of the op then polls it forever (a session's killed suite hung the next CI run at this `wait`): a lock
# older than 10 minutes is such a leftover (the build takes ~35 s) and goes; the prebuild is bounded all the same.
find "${TORCH_EXTENSIONS_DIR:-$(python -c 'import torch.utils.cpp_extension as c; print(c.get_default_build_root())')}" \
  -path '*deepspeed_shm_comm/lock' -mmin +10 -print -delete 2>/dev/null | sed 's/^/install.sh: removed a stale build lock /' || true
timeout 600 python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()" \
  >.venv/shm-op-build.log 2>&1 &
SHM_BUILD=$!
if ! python -c "import megatron.core" 2>/dev/null; then
  # megatron-core 0.19.2 declares Python>=3.12 but its cp311 wheel works (docs/design.md);
  # --no-deps keeps it from pulling a CUDA torch. triton is imported by its schedules module; 3.8.0 is the wheel
  # on this machine's disk (an unpinned triton downloads the newest, ~250 MB, from PyPI).
  pip install -q --ignore-requires-python --no-deps "megatron-core==0.19.2"
  pip install -q "triton==3.8.0"
fi
# Python 3.11: megatron.training imports typing.override (3.12). A .pth gives it to every interpreter of
# this venv, so the processes Megatron starts itself (the dist-checkpoint writer's spawn child) have it too.
# Its one line calls the one copy of the shim, octopipe_plugin/compat.py (which imports only typing); the
# .pth sorts after the editable install's own, so octopipe_plugin imports there. A no-op if it is gone.
python - <<'PY'
import os, site, sys
if sys.version_info < (3, 12):
    with open(os.path.join(site.getsitepackages()[0], "octopipe-py311-typing-override.pth"), "w") as fh:
        fh.write("import importlib.util; importlib.util.find_spec('octopipe_plugin') and "
                 "__import__('octopipe_plugin.compat').compat.allow_megatron_training_import()\n")
PY
# megatron's distributed checkpointing needs psutil, which --no-deps leaves out
python -c "import psutil" 2>/dev/null || pip install -q psutil
wait "$SHM_BUILD" || echo "install.sh: DeepSpeed's shm comm op was not prebuilt (.venv/shm-op-build.log); \
the first DeepSpeed test builds it"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
