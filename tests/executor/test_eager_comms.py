"""On 4 gloo ranks with one group per direction: the warm-up touches every direction group in the world's
sorted order before the first step, the step touches no group the warm-up did not, the runner hears
`last_backward=True` before each stage's last weight-gradient action, and an evaluation runs another
micro-batch count than the plan's; losses and gradients match a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from octopipe_plugin.actions import Kind
from octopipe_plugin.executor import (
    CommCache, ExecutorOptions, PipelineExecutor, TensorMeta, TorchStages, default_cache,
)
from octopipe_plugin.executor.launch import init_gloo, spawn
from octopipe_plugin.testing.plans import make_plan
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for

P, M, M_EVAL, WIDTH = 4, 4, 6, 3


def _plan():
    devs = stage_devices_for("zb-v", P, 2)
    return make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(2 * P)], num_devices=P,
                     num_microbatches=M, schedule=SCHEDULES["zb-v"].generate(devs, P, M))


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(2 * P)]


def _input(mb: int) -> torch.Tensor:
    return torch.randn(2, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + mb))


def _loss(out, batch):
    return out.pow(2).sum()


class _Recording(TorchStages):
    """TorchStages that accepts `last_backward=` and records every backward call with it."""

    def __init__(self, calls, **kw):
        super().__init__(**kw)
        self.calls = calls

    def backward(self, stage, mb, grad_output, *, last_backward=False):
        self.calls.append(("B", stage, mb, last_backward))
        return super().backward(stage, mb, grad_output)

    def backward_input(self, stage, mb, grad_output, *, last_backward=False):
        self.calls.append(("I", stage, mb, last_backward))
        return super().backward_input(stage, mb, grad_output)

    def backward_weight(self, stage, mb, *, last_backward=False):
        self.calls.append(("W", stage, mb, last_backward))
        return super().backward_weight(stage, mb)


def _worker(rank: int, world: int, port: int) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    plan = _plan()
    touched: list[tuple[str, object]] = []  # (phase, process group) of every point-to-point operation
    phase = ["build"]
    isend, irecv, batch = dist.isend, dist.irecv, dist.batch_isend_irecv

    def rec_isend(tensor, *a, group=None, **kw):
        touched.append((phase[0], group))
        return isend(tensor, *a, group=group, **kw)

    def rec_irecv(tensor, *a, group=None, **kw):
        touched.append((phase[0], group))
        return irecv(tensor, *a, group=group, **kw)

    def rec_batch(ops):
        touched.extend((phase[0], op.group) for op in ops)
        return batch(ops)

    p2p_op = dist.P2POp

    def rec_op(op, tensor, *a, **kw):  # P2POp accepts only the original functions
        return p2p_op({rec_isend: isend, rec_irecv: irecv}.get(op, op), tensor, *a, **kw)

    dist.isend, dist.irecv, dist.batch_isend_irecv, dist.P2POp = rec_isend, rec_irecv, rec_batch, rec_op
    layers, calls, events = _layers(), [], []
    runner = _Recording(calls, modules={s: layers[s] for s in plan.stages_of(rank)}, num_stages=plan.num_stages,
                        num_microbatches=M, metas=[TensorMeta(shape=(2, WIDTH), dtype=torch.float64)] * 2 * P,
                        load_input=_input, loss_fn=_loss, scale_loss=lambda loss, n: loss)

    def hook(stage):
        events.append((stage, len(calls)))

    ex = PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=30, pair_groups=True), on_last_backward=hook)
    cache = default_cache()
    name_of = {id(g): pair for pair, g in cache.groups.items()}
    mine = [p for p in ex.lowered.pairs if rank in p]  # world == the pipeline: group ranks are global ranks
    assert cache.warmed == mine, f"rank {rank}: warmed {cache.warmed}, expected the sorted order {mine}"
    first_touch = []
    for when, g in touched:
        assert when == "build"
        if name_of[id(g)] not in first_touch:
            first_touch.append(name_of[id(g)])
    assert first_touch == mine, f"rank {rank}: groups first touched in the order {first_touch}, not {mine}"
    warmed = {id(g) for _, g in touched}

    phase[0] = "step"
    result = ex.run_step()
    stepped = [name_of.get(id(g), g) for when, g in touched if when == "step"]
    assert stepped and all(id(g) in warmed for when, g in touched if when == "step"), \
        f"rank {rank}: the step touched groups the warm-up did not: {stepped}"

    # last_backward=True exactly on each stage's last weight-gradient call, before on_last_backward fires
    flagged = [(k, s, mb) for k, s, mb, last in calls if last]
    for s in plan.stages_of(rank):
        grads = [i for i, (k, st, _, _) in enumerate(calls) if st == s and Kind(k) in (Kind.B, Kind.W)]
        assert calls[grads[-1]][3] and [c for c in flagged if c[1] == s] == [calls[grads[-1]][:3]], calls
        assert (s, grads[-1] + 1) in events, f"rank {rank}: hook of stage {s} at {events}, calls {calls}"

    ref = _layers()
    ref_losses = []
    for mb in range(M_EVAL):
        x = _input(mb)
        for layer in ref:
            x = layer(x)
        loss = _loss(x, mb)
        if mb < M:
            loss.backward()
        ref_losses.append(loss.detach())
    if rank == ex.lowered.loss_rank:
        torch.testing.assert_close(result.loss, sum(ref_losses[:M]), rtol=1e-12, atol=1e-12)
    for s in plan.stages_of(rank):
        for p, q in zip(layers[s].parameters(), ref[s].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)

    evaluation = ex.run_step(forward_only=True, num_microbatches=M_EVAL)  # another count than the plan's
    assert all(id(g) in warmed for when, g in touched if when == "step")
    if rank == ex.lowered.loss_rank:
        assert sorted(evaluation.losses) == list(range(M_EVAL))
        for mb, loss in evaluation.losses.items():
            torch.testing.assert_close(loss, ref_losses[mb], rtol=1e-12, atol=1e-12)

    # the control: without the warm-up, building touches no group and the step is where each is first used
    lazy = CommCache()
    touched.clear()
    phase[0] = "build"
    layers2 = _layers()
    runner2 = TorchStages(modules={s: layers2[s] for s in plan.stages_of(rank)}, num_stages=plan.num_stages,
                          num_microbatches=M, metas=[TensorMeta(shape=(2, WIDTH), dtype=torch.float64)] * 2 * P,
                          load_input=_input, loss_fn=_loss, scale_loss=lambda loss, n: loss)
    ex2 = PipelineExecutor(plan, runner2, cache=lazy,
                           options=ExecutorOptions(timeout_s=30, pair_groups=True, eager_comms=False))
    assert not lazy.warmed and not touched, f"rank {rank}: {touched}"
    phase[0] = "step"
    ex2.run_step()
    used = {id(g) for _, g in touched}
    assert used == {id(g) for pair, g in ex2.pair_groups.items() if rank in pair}, f"rank {rank}: {touched}"
    dist.batch_isend_irecv, dist.irecv, dist.isend, dist.P2POp = batch, irecv, isend, p2p_op
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_warm_up_in_global_order_and_no_group_first_touched_inside_a_step():
    spawn(_worker, P)
