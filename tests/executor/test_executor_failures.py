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


def _token_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two token exchanges of a split embedding over devices (0, 1), stage 0 on rank 0, rank 2 off the shard set:
    one of the step's shape, then one whose micro-batches are [mbs, seq] = (3, 2) where the step's are (2, 3)."""
    import torch

    from octopipe_plugin.executor.token_exchange import exchange_tokens
    from octopipe_plugin.formats.splits import SplitLayer

    init_gloo(rank, world, port, timeout_s=600)  # a rank left waiting in recv would outlive the test's timeout
    split = SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5))
    good = torch.arange(2 * 3 * 2).view(2, 3, 2)  # [m, seq, mbs]
    lines = []
    for tokens in (good, good.transpose(1, 2)):
        try:
            got = exchange_tokens(split, owner=0, rank=rank, group=torch.distributed.group.WORLD,
                                  read=lambda: tokens, shape=(3, 2), num_microbatches=2, device=torch.device("cpu"))
            lines.append("none" if got is None else str(torch.equal(got, good)))
        except Exception as exc:  # noqa: BLE001 - the report is what the test reads
            lines.append(f"{type(exc).__name__}: {exc}")
    with open(os.path.join(out_dir, f"tokens{rank}.txt"), "w") as fh:
        fh.write("\n".join(lines))


@pytest.mark.distributed
@pytest.mark.timeout(60)  # without the shared refusal ranks 1 and 2 wait for the group's 600 s timeout
def test_a_token_shape_stage0_refuses_ends_every_rank_in_one_line(tmp_path):
    """A split embedding's token exchange (executor/token_exchange.py): stage 0's rank refuses the ids of a wrong
    micro-batch shape, and the refusal reaches the shard rank waiting for them and the rank off the shard set, each
    ending with one line naming stage 0's rank and the shapes, after an exchange of the right shape went through."""
    from octopipe_plugin.executor.launch import spawn

    spawn(_token_worker, 3, str(tmp_path))
    reports = [(tmp_path / f"tokens{r}.txt").read_text().split("\n") for r in range(3)]
    assert [r[0] for r in reports] == ["True", "True", "none"], reports
    why = "stage 0's token ids have shape (3, 2) ([mbs, seq]) over 2 micro-batches, the step's boundary (2, 3)"
    assert reports[0][1].startswith("OctoPipeError: plan splits the embedding") and why in reports[0][1], reports
    for r in (1, 2):
        assert reports[r][1].startswith(f"ExecutorError: pipeline rank {r}: stage 0's rank (pipeline rank 0) refused "
                                        "the step: plan splits the embedding"), reports
        assert why in reports[r][1], reports
    assert all(len(r) == 2 for r in reports), reports  # each ends with its one line
