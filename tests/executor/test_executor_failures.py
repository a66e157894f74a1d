"""A dead or silent peer makes the others fail fast with an error naming rank, action and message."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch.multiprocessing as mp

from octopipe_plugin.executor import ExecutorError, ExecutorOptions, PipelineExecutor
from octopipe_plugin.testing.checks import toy_runner
from octopipe_plugin.executor.launch import free_port, init_gloo
from octopipe_plugin.testing.toy import ToySpec, build_layers
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for
from octopipe_plugin.testing.plans import make_plan

SPEC = ToySpec()


def _plan():
    devs = stage_devices_for("1f1b", 2)
    return make_plan(stage_devices=devs, bounds=[(0, 3), (3, 7)], num_devices=2, num_microbatches=4,
                     schedule=SCHEDULES["1f1b"].generate(devs, 2, 4))


class _DiesAfterFirstForward:
    """Wraps a runner; the process exits abruptly (like a crash) right after its first forward."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):  # StageRunner.forward's signature
        out = self.inner.forward(stage, mb, inputs, batch=batch, forward_only=forward_only)
        if mb == 1:
            os._exit(3)
        return out


def _worker(rank: int, port: int, mode: str, timeout_s: float, out_dir: str) -> None:
    init_gloo(rank, 2, port, timeout_s=60)
    plan = _plan()
    runner = toy_runner(SPEC, build_layers(SPEC), plan, rank)
    if rank == 1 and mode == "silent":
        # never runs its actions; stays connected until rank 0 has reported, then leaves
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "rank0.txt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    if rank == 1 and mode == "dies":
        runner = _DiesAfterFirstForward(runner)
    start = time.monotonic()
    try:
        PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=timeout_s)).run_step()
        text = "finished"
    except ExecutorError as exc:
        text = f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
        fh.write(text)


def _run(mode: str, timeout_s: float, tmp_path) -> str:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, mode, timeout_s, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.is_alive():
            p.kill()
    report = tmp_path / "rank0.txt"
    assert report.exists(), f"rank 0 wrote no report (exit codes {[p.exitcode for p in procs]})"
    return report.read_text()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_killed_peer_fails_the_others_with_a_clear_error(tmp_path):
    text = _run("dies", timeout_s=30.0, tmp_path=tmp_path)
    assert text.startswith("ExecutorError"), text
    assert "rank 0:" in text and "from rank 1" in text
    # the action rank 0 was about to run and the message it waited for are both named
    assert "0B" in text and "grad[1" in text, text
    # the dead socket ends the wait (gloo names the closed connection), not the 30 s bound
    assert re.search(r"Connection (reset|closed) by peer", text) and "Timed out" not in text, text


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_silent_peer_times_out_with_the_awaited_message(tmp_path):
    text = _run("silent", timeout_s=2.0, tmp_path=tmp_path)
    assert text.startswith("ExecutorError"), text
    assert "rank 0:" in text and "timeout 2 s" in text and "from rank 1" in text, text
    # the peer was alive: it is the bounded wait that ended it (gloo's timeout, not a closed connection)
    assert "Timed out waiting 2000ms for recv" in text and "by peer" not in text, text
