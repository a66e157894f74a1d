"""The tests' CPU shims are the examples' (one copy: examples/megatron/cpu_shims.py)."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[3] / "examples" / "megatron" / "cpu_shims.py"
_spec = importlib.util.spec_from_file_location("octopipe_example_cpu_shims", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

install = _module.install
install_for_pretrain = _module.install_for_pretrain
shim_device_arch = _module.shim_device_arch
shim_sequence_parallel_norm = _module.shim_sequence_parallel_norm
