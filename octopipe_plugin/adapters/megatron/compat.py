"""What megatron.training 0.19.2 needs from Python 3.11 before it can be imported."""

from __future__ import annotations

import typing


def allow_megatron_training_import() -> None:
    """Give Python 3.11 the `typing.override` decorator (3.12) that megatron.training imports; a no-op on 3.12+."""
    if not hasattr(typing, "override"):
        typing.override = lambda fn: fn
