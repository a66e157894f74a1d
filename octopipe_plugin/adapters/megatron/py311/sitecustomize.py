"""Python 3.11: `typing.override` (3.12) for every process a Megatron run starts (its checkpoint writer's child too).

The launcher puts this folder first on PYTHONPATH when it runs on 3.11, so each new interpreter
(torchrun workers, multiprocessing spawn children, subprocesses) gets the decorator megatron.training
imports before any import of Megatron. A sitecustomize of the user's own further down sys.path still
runs: this one runs it after its own line.
"""

import os
import sys
import typing
from importlib.machinery import PathFinder
from importlib.util import module_from_spec

if not hasattr(typing, "override"):
    def _override(fn):
        """typing.override of Python 3.12: marks the method, changes nothing."""
        try:
            fn.__override__ = True
        except (AttributeError, TypeError):
            pass
        return fn

    typing.override = _override

_HERE = os.path.dirname(os.path.abspath(__file__))
_next = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
if _next is not None and _next.loader is not None:  # the user's own sitecustomize, further down the path
    _next.loader.exec_module(module_from_spec(_next))
