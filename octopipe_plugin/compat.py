"""Python 3.11's `typing.override` (3.12), the one copy: megatron.training 0.19 imports it.

Kept apart from the adapters so that it imports nothing but `typing`: every place that needs the
decorator calls `allow_megatron_training_import()` from here — the Megatron adapter
(adapters/megatron/compat.py re-exports it), the launcher's `py311/sitecustomize.py` (every process
a launch starts), the `.pth` scripts/install.sh writes into the venv (every interpreter of the venv,
the dist-checkpoint writer's spawn child included), and the CPU examples (examples/megatron).
"""

from __future__ import annotations

import typing


def _override(fn):
    """typing.override of Python 3.12: marks the method, changes nothing."""
    try:
        fn.__override__ = True
    except (AttributeError, TypeError):
        pass
    return fn


def allow_megatron_training_import() -> None:
    """Give Python 3.11 the `typing.override` decorator (3.12) that megatron.training imports; a no-op on 3.12+."""
    if not hasattr(typing, "override"):
        typing.override = _override
