"""Megatron's own argument parser in-process, for the launch tests (no hook installed globally)."""

from __future__ import annotations

import contextlib
import os
import sys

from octopipe_plugin.adapters.megatron.compat import allow_megatron_training_import

TINY_GPT = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear"]


@contextlib.contextmanager
def megatron_env(argv: list[str], world: int, rank: int = 0):
    """sys.argv and the torchrun environment Megatron's parse_args reads, restored afterwards."""
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    try:
        yield
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse(argv: list[str], world: int = 1, *, rank: int = 0, octopipe: bool = True, validate: bool = True):
    """Megatron's parse_args (with OctoPipe's arguments and plan resolution) and optionally validate_args."""
    allow_megatron_training_import()
    from megatron.training import arguments

    from octopipe_plugin.adapters.megatron.launch import parse_args_with_octopipe

    parse_fn = parse_args_with_octopipe(arguments.parse_args) if octopipe else arguments.parse_args
    with megatron_env(argv, world, rank), contextlib.redirect_stdout(sys.stderr):
        args = parse_fn()
        if validate:
            arguments.validate_args(args)
    return args
