"""The transport's device rule, buffer reuse, batched exchange and dead-peer error, on gloo.

- A tensor to send on another device than the executor's is refused by name (an executor
  declared on `meta` handed CPU tensors: the DeepSpeed `device=` bug class).
- `reuse_buffers` keeps receive buffers across steps; False gives each step its own.
- The batched exchange (batch_isend_irecv per peer) gives the same losses and gradients as
  per-message posting, against the single-process reference (looped and V plans, 4 ranks,
  declared metas and metas learned by handshake).
- A peer killed mid-step (os._exit before a chosen action) ends the survivors with the named
  error (rank, action, message, peer) within the executor's timeout, well before the process
  group's own timeout.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octopipe_plugin.actions import Kind
from octopipe_plugin.executor import ExecutorError, ExecutorOptions, PipelineExecutor
from octopipe_plugin.testing.checks import toy_runner
from octopipe_plugin.executor.launch import free_port, init_gloo, spawn
from octopipe_plugin.testing.plans import make_plan, random_bounds
from octopipe_plugin.testing.toy import ToySpec, build_layers, reference_step
from octopipe_plugin.formats import plan_from_dict, plan_to_dict
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for

SPEC = ToySpec(layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "head"))


def _plan(name: str, p: int, v: int, m: int, seed: int = 0):
    devs = stage_devices_for(name, p, v)
    return make_plan(stage_devices=devs, bounds=random_bounds(len(SPEC.layers), len(devs), random.Random(seed)),
                     num_devices=p, num_microbatches=m, schedule=SCHEDULES[name].generate(devs, p, m))


def _run_procs(target, world: int, *args, join_s: float = 90) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=join_s)
        if p.is_alive():
            p.kill()


# ----- device rule


def _device_worker(rank: int, world: int, port: int, out: str) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    plan = _plan("1f1b", 2, 1, 2)
    runner = toy_runner(SPEC, build_layers(SPEC), plan, rank)  # CPU tensors
    device = "meta" if rank == 0 else "cpu"
    try:
        PipelineExecutor(plan, runner, device=device, options=ExecutorOptions(timeout_s=5)).run_step()
        text = {"ok": True}
    except ExecutorError as exc:
        text = {"error": str(exc), "rank": exc.rank, "action": exc.action, "awaited": exc.awaited}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(text, fh)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_cpu_tensor_handed_to_an_executor_on_another_device_is_refused_by_name(tmp_path):
    _run_procs(_device_worker, 2, str(tmp_path))
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert "error" in got, got
    assert got["rank"] == 0 and got["action"] == "0F0" and got["awaited"].startswith("act["), got
    assert "is on cpu, the executor runs on meta" in got["error"] and "device=" in got["error"], got


# ----- buffer reuse


class _KeepsInputs:
    """Wraps a runner; keeps every received activation (so freed buffers cannot be handed out again)."""

    def __init__(self, inner):
        self.inner = inner
        self.kept: list[list[torch.Tensor]] = [[]]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):
        if inputs is not None:
            self.kept[-1].append(inputs)
        return self.inner.forward(stage, mb, inputs, batch=batch, forward_only=forward_only)


def _reuse_worker(rank: int, world: int, port: int, reuse: bool, out: str) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    plan = _plan("1f1b", 2, 1, 3)
    runner = _KeepsInputs(toy_runner(SPEC, build_layers(SPEC), plan, rank))
    ex = PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=30, reuse_buffers=reuse))
    ex.run_step()
    runner.kept.append([])
    ex.run_step()
    ptrs = [sorted(t.untyped_storage().data_ptr() for t in step) for step in runner.kept]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(ptrs, fh)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse", [True, False])
def test_reuse_buffers_keeps_receive_buffers_across_steps_only_when_asked(tmp_path, reuse):
    spawn(_reuse_worker, 2, reuse, str(tmp_path))
    first, second = json.loads((tmp_path / "rank1.json").read_text())
    assert len(first) == len(second) == 3
    if reuse:
        assert first == second  # the same buffers received both steps
    else:
        assert not set(first) & set(second)  # every step received into buffers of its own


# ----- batched exchange


def _batched_worker(rank: int, world: int, port: int, docs: list[dict]) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    ref = build_layers(SPEC)
    for doc in docs:
        plan = plan_from_dict(doc["plan"])
        ref.zero_grad(set_to_none=True)
        ref_loss = reference_step(SPEC, ref, plan.num_microbatches)
        grads = {}
        for exchange in ("message", "batched"):
            layers = build_layers(SPEC)
            runner = toy_runner(SPEC, layers, plan, rank)
            if not doc["declared"]:
                runner.metas = None  # learned by one handshake per step
            ex = PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=30, exchange=exchange,
                                                                        tags=doc["tags"]))
            assert ex.transport.exchange == exchange
            result = ex.run_step()
            label = f"rank {rank} {doc['label']} {exchange}"
            if plan.num_stages - 1 in plan.stages_of(rank):
                torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=1e-14, msg=f"{label}: loss")
            mine = [i for s in plan.stages_of(rank) for i in range(plan.stages[s].start, plan.stages[s].end)]
            grads[exchange] = [p.grad for i in mine for p in layers[i].parameters()]
            want = [q.grad for i in mine for q in ref[i].parameters()]
            for g, q in zip(grads[exchange], want, strict=True):
                torch.testing.assert_close(g, q, rtol=1e-10, atol=1e-12, msg=label)
        for a, b in zip(grads["message"], grads["batched"], strict=True):
            assert torch.equal(a, b), f"rank {rank} {doc['label']}: batched and per-message gradients differ"
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_batched_exchange_gives_the_per_message_losses_and_gradients():
    p = 4
    docs = [
        {"label": "looped interleaved-1f1b", "plan": plan_to_dict(_plan("interleaved-1f1b", p, 2, 2 * p, 1)),
         "declared": True, "tags": True},
        {"label": "V zb-v", "plan": plan_to_dict(_plan("zb-v", p, 2, p + 1, 2)), "declared": False, "tags": False},
        {"label": "1f1b", "plan": plan_to_dict(_plan("1f1b", p, 1, 2 * p + 1, 3)), "declared": True, "tags": False},
    ]
    spawn(_batched_worker, p, docs)


# ----- dead peer


class _DiesBefore:
    """Wraps a runner; the process exits abruptly (like a crash) right before running `kind` of (stage, mb)."""

    def __init__(self, inner, kind: Kind, stage: int, mb: int):
        self.inner, self.at = inner, (kind, stage, mb)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _maybe_die(self, kind: Kind, stage: int, mb: int) -> None:
        if (kind, stage, mb) == self.at:
            os._exit(3)

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):
        self._maybe_die(Kind.F, stage, mb)
        return self.inner.forward(stage, mb, inputs, batch=batch, forward_only=forward_only)

    def backward(self, stage, mb, grad_output):
        self._maybe_die(Kind.B, stage, mb)
        return self.inner.backward(stage, mb, grad_output)


def _dead_peer_worker(rank: int, world: int, port: int, timeout_s: float, out: str) -> None:
    init_gloo(rank, world, port, timeout_s=300)  # the process group's own bound: far beyond the executor's
    plan = _plan("1f1b", world, 1, 2 * world)
    runner = toy_runner(SPEC, build_layers(SPEC), plan, rank)
    if rank == 1:
        runner = _DiesBefore(runner, Kind.B, 1, 1)  # mid-step: after its first backward, before its second
    start = time.monotonic()
    try:
        PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=timeout_s)).run_step()
        got = {"ok": True}
    except ExecutorError as exc:
        got = {"error": str(exc), "rank": exc.rank, "action": exc.action, "awaited": exc.awaited, "peer": exc.peer}
    got["elapsed"] = time.monotonic() - start
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_peer_killed_mid_step_ends_the_survivors_with_the_named_error(tmp_path):
    timeout_s = 40.0
    _run_procs(_dead_peer_worker, 3, timeout_s, str(tmp_path), join_s=120)
    for rank in (0, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" in got, got
        assert got["rank"] == rank and got["peer"] == 1 and got["action"] and got["awaited"], got
        assert f"rank {rank}: {got['action']}:" in got["error"] and got["awaited"] in got["error"], got
        assert ("from rank 1" in got["error"] or "to rank 1" in got["error"]), got
        assert "peer died or left" in got["error"], got  # the closed socket, not the executor's bound
        assert got["elapsed"] < timeout_s, got


# ----- what goes in one batch


class _RecordingLane:
    """A lane that records each batch it is asked to issue; `coalesces` as NCCL does (one work per batch)."""

    def __init__(self, coalesces: bool):
        self.coalesces = coalesces
        self.batches: list[list] = []

    def issue_batch(self, requests):
        self.batches.append(list(requests))
        return ("one-work",) if self.coalesces else tuple(f"work{len(self.batches)}.{i}" for i in range(len(requests)))


@pytest.mark.parametrize("coalesces", [True, False])
def test_a_batch_keeps_each_communicators_order_and_a_coalesced_one_holds_one_received_message(coalesces):
    from octopipe_plugin.executor.comm import Transport
    from octopipe_plugin.executor.lanes import Request, Transfer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tp = Transport(rank=0, num_stages=2, recv_order={}, send_order={}, device="cpu", timeout_s=5,
                       exchange="batched")
        tp.lane = _RecordingLane(coalesces)
        g_in, g_out = object(), object()  # the two direction communicators with peer 1

        def transfer(name, send, group, n=1):
            reqs = tuple(Request(send=send, wire=torch.zeros(1), group=group, peer=1, tag=0) for _ in range(n))
            return Transfer(name, (), reqs)

        r1, s1, r2, s2 = transfer("r1", False, g_in, 2), transfer("s1", True, g_out), transfer("r2", False, g_in), \
            transfer("s2", True, g_out, 2)
        tp.queued = [r1, s1, r2, s2]
        tp.flush()
        names = [[next(t.msg for t in (r1, s1, r2, s2) if any(r is q for q in t.requests)) for r in batch]
                 for batch in tp.lane.batches]
        if coalesces:  # one completion per batch: a consumer of r1 must not wait for r2
            assert names == [["r1", "r1"], ["s1", "s2", "s2"], ["r2"]]
            assert r1.works == ("one-work",) and s1.works == s2.works == ("one-work",)
        else:  # gloo: one work per request, one batch per (communicator, peer), order kept in each
            assert names == [["r1", "r1", "r2"], ["s1", "s2", "s2"]]
            assert r1.works == ("work1.0", "work1.1") and r2.works == ("work1.2",) and s2.works == ("work2.1",
                                                                                                     "work2.2")
        assert not tp.queued
    finally:
        dist.destroy_process_group()
