"""Single-process checks of the executor's lowering, validation, split backward and plan sampler."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from octopipe_plugin.errors import DeadlockError, PlanError
from octopipe_plugin.executor import PipelineExecutor, TorchStages, build_program, check_runnable
from octopipe_plugin.testing.plans import make_plan, placement, random_plan, sample_schedule
from octopipe_plugin.testing.toy import (
    ToySpec, boundary_metas, build_layers, loss_fn, microbatch, reference_step, stage_modules,
)
from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.schedules.messages import MsgKind


def ring_plan():
    """Two ranks, four looped stages: rank 0 sends to and receives from rank 1 in both directions."""
    rows = [["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
            ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]]
    return make_plan(stage_devices=[0, 1, 0, 1], bounds=[(0, 2), (2, 3), (3, 5), (5, 7)], num_devices=2,
                     num_microbatches=2, schedule=parse_schedule(rows))


def test_ring_program_keeps_per_peer_sender_order_across_both_directions():
    plan = ring_plan()
    p0, p1 = build_program(plan, 0), build_program(plan, 1)
    # What rank 0 receives from rank 1 is, message for message, what rank 1 sends to rank 0.
    assert p0.recv_order[1] == p1.send_order[0]
    kinds = [(m.kind, m.microbatch, m.src_stage) for m in p0.recv_order[1]]
    # rank 1 produces 1F0, 1F1 (acts to stage 2), then 3B0, 3B1 (grads to stage 2), then 1B0, 1B1
    assert kinds == [(MsgKind.ACT, 0, 1), (MsgKind.ACT, 1, 1), (MsgKind.GRAD, 0, 3), (MsgKind.GRAD, 1, 3),
                     (MsgKind.GRAD, 0, 1), (MsgKind.GRAD, 1, 1)]


def test_same_device_neighbours_exchange_no_message():
    plan = make_plan(stage_devices=[0, 0, 1], bounds=[(0, 1), (1, 2), (2, 3)], num_devices=2, num_microbatches=1,
                     schedule=parse_schedule([["0F0", "1F0", "1B0", "0B0"], ["2F0", "2B0"]]))
    prog = build_program(plan, 0)
    steps = {str(s.action): s for s in prog.steps}
    assert steps["1F0"].recv is None and steps["0F0"].send is None  # handed over in memory
    assert steps["1F0"].send is not None and steps["1B0"].recv is not None


def test_receives_are_posted_before_their_consumer_as_a_per_peer_prefix():
    rng = random.Random(3)
    plan = random_plan(rng, num_devices=3, num_layers=9, num_stages=6, num_microbatches=4, placement_kind="arbitrary")
    for rank in range(3):
        prog = build_program(plan, rank, prefetch=2)
        posted: dict[int, int] = {}
        for step in prog.steps:
            for peer, count in step.post_upto:
                posted[peer] = max(posted.get(peer, 0), count)
            if step.recv is not None:
                order = prog.recv_order[step.recv.src]
                assert order.index(step.recv) < posted[step.recv.src]


def test_deadlocking_plan_is_refused_before_any_communication():
    # Both devices wait for each other's activation first: a cycle.
    plan = make_plan(stage_devices=[0, 1, 1, 0], bounds=[(0, 1), (1, 2), (2, 3), (3, 4)], num_devices=2,
                     num_microbatches=1,
                     schedule=parse_schedule([["3F0", "0F0", "3B0", "0B0"], ["2F0", "1F0", "2B0", "1B0"]]))
    assert not torch.distributed.is_initialized()
    with pytest.raises(DeadlockError, match="deadlock"):
        PipelineExecutor(plan, runner=None, rank=0)  # raises before touching torch.distributed


def test_incomplete_plan_is_refused():
    plan = make_plan(stage_devices=[0, 1], bounds=[(0, 1), (1, 2)], num_devices=2, num_microbatches=1,
                     schedule=parse_schedule([["0F0"], ["1F0", "1B0"]]))
    with pytest.raises(PlanError, match="0B0"):
        check_runnable(plan)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.integers(2, 4), v=st.integers(1, 3), m=st.integers(1, 6),
       kind=st.sampled_from(["looped", "v", "arbitrary"]))
def test_sampled_plans_are_valid_and_deadlock_free(seed, p, v, m, kind):
    rng = random.Random(seed)
    devs = placement(kind, p * v, p, rng)
    plan = make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(p * v)], num_devices=p,
                     num_microbatches=m, schedule=sample_schedule(devs, p, m, rng))
    check_runnable(plan)


def _runner(spec, layers, bounds, m):
    ns = len(bounds)
    return TorchStages(modules=stage_modules(layers, bounds, range(ns)), num_stages=ns, num_microbatches=m,
                       metas=boundary_metas(spec, ns), load_input=lambda mb: microbatch(spec, mb)[0],
                       loss_fn=loss_fn(spec))


def test_backward_input_defers_all_weight_work_and_w_completes_it():
    spec, m = ToySpec(), 2
    bounds = [(0, 3), (3, 7)]
    layers = build_layers(spec)
    run = _runner(spec, layers, bounds, m)
    for mb in range(m):
        h = run.forward(0, mb, None)
        run.forward(1, mb, h)
        g = run.backward_input(1, mb, None)
        assert g is not None and g.shape == h.shape
        run.backward_input(0, mb, g)
    assert all(p.grad is None for p in layers.parameters())  # I touched no weight gradient
    for mb in range(m):
        run.backward_weight(1, mb)
        run.backward_weight(0, mb)
    assert run.pending() == 0
    ref = build_layers(spec)
    reference_step(spec, ref, m)
    for (name, p), q in zip(layers.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_split_backward_runs_each_autograd_node_once():
    # Count calls of a custom function's backward: I + W together must call it exactly once.
    calls = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g

    lin1, lin2 = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()
    mod = torch.nn.Sequential(lin1, type("P", (torch.nn.Module,), {"forward": lambda self, x: Probe.apply(x)})(),
                              lin2)
    from octopipe_plugin.executor.split_backward import backward_input, backward_weight

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = mod(x)
    (dx,), work = backward_input([out], [torch.ones_like(out)], [x], list(mod.parameters()))
    assert len(calls) == 1 and lin1.weight.grad is None
    backward_weight(work)
    assert len(calls) == 1 and lin1.weight.grad is not None and lin2.weight.grad is not None
    assert dx is not None
