"""Giving the core up after posting sends (executor/comm.py): gloo only, NCCL unchanged, switchable per executor."""

from __future__ import annotations

from octopipe_plugin.executor import ExecutorOptions
from octopipe_plugin.executor.comm import YIELD_AFTER_SEND, yields_after_send


def test_only_gloo_gives_way_by_default():
    assert yields_after_send("gloo") is True
    assert yields_after_send("nccl") is False and "nccl" not in YIELD_AFTER_SEND
    assert yields_after_send("mpi") is False


def test_the_option_defaults_to_the_backends_choice():
    assert ExecutorOptions().yield_after_send is None
    assert ExecutorOptions(yield_after_send=False).yield_after_send is False
