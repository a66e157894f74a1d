"""On instances small enough to enumerate, the tuner reaches the brute-force optimum.

Optimum, precisely: the smallest simulated step time over every plan in the family below
that does not deadlock and fits memory.
- Two layers on two devices (the only partition with a stage per device): every per-device
  order of F and, per micro-batch, either a fused B or a split I then W. The tuner's search
  space here is exactly this family, so it must match the optimum.
- Six layers on three devices: every contiguous partition into three non-empty stages, stage
  d on device d, every per-device order with fused backwards. The tuner searches a superset
  (split backwards, more stages per device), so it must be at least as fast.
"""

from __future__ import annotations

import itertools

import pytest

from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.formats import Model, Plan, Stage
from octopipe_plugin.actions import Action, Kind
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune

from tuner_helpers import cluster, layer


def _orders(stage: int, m: int, allow_split: bool):
    """Every order of one stage's actions: F before its backward, I before W; each mb fused or split."""
    for choice in itertools.product((False, True) if allow_split else (False,), repeat=m):
        chains = []
        for mb, split in enumerate(choice):
            kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
            chains.append([Action(stage, k, mb) for k in kinds])
        yield from _interleavings(chains)


def _interleavings(chains):
    if all(not c for c in chains):
        yield ()
        return
    for i, c in enumerate(chains):
        if c:
            rest = chains[:i] + [c[1:]] + chains[i + 1:]
            for tail in _interleavings(rest):
                yield (c[0],) + tail


def _best(model, cl, m, bounds, allow_split):
    stages = tuple(Stage(start=a, end=b, device=d) for d, (a, b) in enumerate(bounds))
    per_device = [list(_orders(d, m, allow_split)) for d in range(len(bounds))]
    best = float("inf")
    for rows in itertools.product(*per_device):
        plan = Plan(model=model.name, num_devices=len(bounds), num_microbatches=m, stages=stages,
                    schedule=tuple(rows))
        try:
            res = simulate(model, cl, plan, detail=False)
        except DeadlockError:
            continue
        if max(res.peak_memory_bytes) <= cl.memory_bytes:
            best = min(best, res.step_time_ms)
    return best


@pytest.mark.parametrize("costs", [((1.0, 2.0, 1.0), (2.0, 1.0, 3.0)), ((1.5, 1.0, 0.5), (1.0, 2.5, 1.0))])
def test_two_layers_two_devices_exact_optimum(costs):
    model = Model(name="tiny", layers=tuple(layer(i, f, b, w, state=0, act=1) for i, (f, b, w) in enumerate(costs)))
    cl = cluster(2)
    optimum = _best(model, cl, 2, [(0, 1), (1, 2)], allow_split=True)
    r = tune(model, cl, 2, iterations=400, seed=0)
    assert r.step_ms == pytest.approx(optimum, abs=1e-9)


def test_six_layers_three_devices_at_least_the_fused_optimum():
    costs = (0.5, 2.0, 1.0, 1.0, 3.0, 1.5)
    model = Model(name="six", layers=tuple(layer(i, f, state=0, act=1) for i, f in enumerate(costs)))
    cl = cluster(3)
    optimum = float("inf")
    for c1, c2 in itertools.combinations(range(1, 6), 2):
        optimum = min(optimum, _best(model, cl, 2, [(0, c1), (c1, c2), (c2, 6)], allow_split=False))
    r = tune(model, cl, 2, iterations=400, seed=0)
    assert r.step_ms <= optimum + 1e-9
