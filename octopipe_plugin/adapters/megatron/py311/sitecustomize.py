"""Python 3.11: `typing.override` (3.12) for every process a Megatron run starts (its checkpoint writer's child too).

The launcher puts this folder first on PYTHONPATH when it runs on 3.11, so each new interpreter
(torchrun workers, multiprocessing spawn children, subprocesses) gets the decorator megatron.training
imports before any import of Megatron. A sitecustomize of the user's own further down sys.path still
runs: this one runs it after its own line.
"""

import os
import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec, spec_from_file_location

_HERE = os.path.dirname(os.path.abspath(__file__))
try:  # the one copy of the shim: octopipe_plugin/compat.py (imports nothing but typing)
    from octopipe_plugin.compat import allow_megatron_training_import
except ImportError:  # octopipe_plugin not importable here: its compat.py, three folders up
    _spec = spec_from_file_location("_octopipe_py311_compat", os.path.join(_HERE, "..", "..", "..", "compat.py"))
    _compat = module_from_spec(_spec)
    _spec.loader.exec_module(_compat)
    allow_megatron_training_import = _compat.allow_megatron_training_import
allow_megatron_training_import()

_next = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
if _next is not None and _next.loader is not None:  # the user's own sitecustomize, further down the path
    _next.loader.exec_module(module_from_spec(_next))
