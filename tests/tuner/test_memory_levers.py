"""The tuner's memory choices (tuner/memory_choices.py): bought where memory binds, forbidden or forced by the levers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage
from octopipe_plugin.formats.plan import plan_to_dict
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.evaluate import Evaluator
from octopipe_plugin.tuner.memory_choices import AUTO, MemoryLevers

from tuner_helpers import GIB, cluster, hetero_model

ITER = 40


def heavy_model(n: int = 8) -> Model:
    """Layers whose saved activation (4 GiB) dwarfs their input (64 MiB): recompute frees nearly all of it for one
    forward (1 ms) more in the backward; state 1 GiB a layer."""
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=GIB,
                         activation_bytes=4 * GIB, output_bytes=64 * 2**20, recompute_activation_bytes=64 * 2**20)
                   for i in range(n))
    return Model(name="heavy", layers=layers)


def tight():
    """4 devices of 2 x 1 GiB state + 12 GiB: one micro-batch of a stage's activations (8 GiB) in flight at a time."""
    return cluster(4, memory_gib=14.0)


def test_tuner_buys_a_deeper_schedule_with_recompute():
    model, cl = heavy_model(), tight()
    plain = tune(model, cl, 8, iterations=ITER, seed=0)
    got = tune(model, cl, 8, iterations=ITER, seed=0, memory=MemoryLevers("auto", "none"))
    assert not plain.plan.memory
    kinds = {c.kind for _, c in got.plan.memory}
    assert got.plan.memory and kinds <= {"recompute"}
    # by hand: without choices a device holds one micro-batch (8 GiB of 12) at a time, so the pipeline runs
    # GPipe-like one micro-batch after another per stage; with recompute (F keeps 2 x 64 MiB) 1F1B fits
    assert got.step_ms < 0.8 * plain.step_ms
    res = simulate(model, cl, got.plan)
    assert res.step_time_ms == pytest.approx(got.step_ms)
    assert max(res.peak_memory_bytes) <= cl.usable_memory_bytes


def test_recompute_none_forbids_it_and_offload_alone_is_used_or_not():
    model, cl = heavy_model(), tight()
    off = tune(model, cl, 8, iterations=ITER, seed=0, memory=MemoryLevers("none", "auto"))
    assert {c.kind for _, c in off.plan.memory} <= {"offload"}
    none = tune(model, cl, 8, iterations=ITER, seed=0, memory=MemoryLevers("none", "none"))
    assert not none.plan.memory


def test_recompute_full_recomputes_every_layer():
    model, cl = heavy_model(), tight()
    got = tune(model, cl, 8, iterations=ITER, seed=0, memory=MemoryLevers("full", "none"))
    assert [layer for layer, c in got.plan.memory if c.kind == "recompute"] == list(range(model.num_layers))
    assert max(simulate(model, cl, got.plan).peak_memory_bytes) <= cl.usable_memory_bytes


def test_same_plan_bytes_when_no_choice_pays():
    model, cl = hetero_model(12), cluster(4, memory_gib=1000)
    a = tune(model, cl, 8, iterations=ITER, seed=3)
    b = tune(model, cl, 8, iterations=ITER, seed=3, memory=AUTO)
    assert plan_to_dict(a.plan) == plan_to_dict(b.plan)
    assert a.evaluations == b.evaluations


def test_repair_makes_an_over_memory_builtin_fit_at_least_cost():
    model, cl = heavy_model(), tight()
    plan = build_plan(model, "1f1b", 4, 8)
    ev = Evaluator(model, cl, 8, levers=MemoryLevers("auto", "none"))
    raw = ev.simulated(plan, repair=False)
    assert not raw.fits
    got = ev.simulated(plan)
    assert got.fits and got.plan.memory
    # 1F1B's first device holds 4 micro-batches of 8 GiB; recompute frees 4 GiB - 64 MiB a layer per micro-batch:
    # fitting 12 GiB takes recomputing at least one of its two layers, and it never recomputes a device in memory
    assert simulate(model, cl, got.plan).step_time_ms == pytest.approx(got.step_ms)
    last = {layer for layer, _ in got.plan.memory if layer >= 6}
    assert len(last) <= 2
    assert len(got.plan.memory) < model.num_layers


def test_repair_offloads_what_a_deferred_w_reads():
    """One device, order 0F0 0I0 0F1 0I1 0F2 0I2 0W0 0W1 0W2: every micro-batch's 100 bytes wait for its W (peak
    300 over 250). Offload after F cannot help (each I needs its bytes back, and they then wait for W); offload_w
    (docs/formats.md "Memory choices") frees them between I and W: peak 200, copies of 0.1 ms hidden, step 9 ms."""
    layer = Layer(name="l0", kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1, state_bytes=0, activation_bytes=100,
                  output_bytes=0)
    model = Model(name="m", layers=(layer,))
    link = Link(bandwidth_gb_per_s=1.0, latency_us=0.0)
    cl = Cluster(num_devices=1, devices_per_node=1, memory_bytes=250, intra_node=link, inter_node=link,
                 host_link_gb_per_s=1e-3)
    plan = Plan(model="m", num_devices=1, num_microbatches=3, stages=(Stage(start=0, end=1, device=0),),
                schedule=parse_schedule([["0F0", "0I0", "0F1", "0I1", "0F2", "0I2", "0W0", "0W1", "0W2"]]))
    ev = Evaluator(model, cl, 3, levers=MemoryLevers("none", "auto"))
    assert ev.simulated(plan, repair=False).peak == (300,)
    got = ev.simulated(plan)
    assert got.fits and got.peak == (200,) and got.step_ms == pytest.approx(9.0)
    assert [(layer, c.text) for layer, c in got.plan.memory] == [(0, "offload_w")]
    assert not Evaluator(model, cl, 3, levers=MemoryLevers("auto", "none")).simulated(plan).fits


def test_bad_levers_refused():
    with pytest.raises(OctoPipeError, match="--recompute 'some'"):
        MemoryLevers("some", "none")
    with pytest.raises(OctoPipeError, match="--offload 'full'"):
        MemoryLevers("none", "full")


def test_offload_bounded_by_host_memory():
    model, cl = heavy_model(), tight()
    small_host = replace(cl, host_memory_bytes=GIB)  # no layer's 4 GiB fits the host
    got = tune(model, small_host, 8, iterations=ITER, seed=0, memory=MemoryLevers("none", "auto"))
    assert not got.plan.memory
