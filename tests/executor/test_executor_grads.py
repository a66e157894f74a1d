"""Multi-process (gloo) runs of many plans: loss and every gradient equal the single-process reference.

Spawning is the slow part, so one group of ranks per world size runs every plan of that
size: the built-in schedules (non-uniform random stage boundaries, m < p and m not a
multiple of p included), tuner-produced plans, and random valid irregular plans on looped,
V and arbitrary placements. Every other plan runs untagged (order rule alone) and some run
through the Megatron-style forward_step runner. Every rank checks the layers it owns (octopipe_plugin.testing.checks).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from octopipe_plugin.testing.checks import check_plans_worker
from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.testing.plans import make_plan, placement, random_bounds, sample_schedule
from octopipe_plugin.testing.toy import ToySpec
from octopipe_plugin.formats import plan_to_dict
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for

SPEC = ToySpec(layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))


def _doc(plan, label: str) -> dict:
    doc = plan_to_dict(plan)
    doc["meta"] = {"label": label}
    return doc


def builtin_docs(p: int, rng: random.Random) -> list[dict]:
    """Every built-in schedule on p devices, with random non-uniform stages, including m < p and m % p != 0."""
    cases = [("gpipe", 1, p + 1), ("1f1b", 1, 2 * p + 1), ("1f1b", 1, max(1, p - 1)), ("interleaved-1f1b", 2, p),
             ("interleaved-1f1b", 3, 2 * p), ("zb-h1", 1, p + 1), ("zb-v", 2, max(1, p - 1)), ("zb-v", 2, 2 * p + 1),
             ("dualpipev", 2, 2 * p)]
    docs = []
    for name, v, m in cases:
        spec = SCHEDULES[name]
        spec.check(p, m, v)
        devs = stage_devices_for(name, p, v)
        if len(devs) > len(SPEC.layers):
            continue
        plan = make_plan(stage_devices=devs, bounds=random_bounds(len(SPEC.layers), len(devs), rng),
                         num_devices=p, num_microbatches=m, schedule=spec.generate(devs, p, m))
        doc = _doc(plan, f"{name} p={p} v={v} m={m}")
        if name == "interleaved-1f1b":
            doc["meta"]["runner"] = "forward_step"
        docs.append(doc)
    return docs


def tuned_docs(p: int) -> list[dict]:
    """Plans from the tuner for a heterogeneous 10-layer cost model (non-uniform stages, its own lists)."""
    from dataclasses import replace

    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.formats import Layer, Model
    from octopipe_plugin.tuner import tune

    kinds = ("embedding", "dense", "attention", "dense", "mlp", "dense", "attention", "dense", "mlp", "lm_head")
    assert len(kinds) == len(SPEC.layers)
    layers = tuple(Layer(name=f"l{i}", kind=k, fwd_ms=1.0 + (i % 4) * 0.7, bwd_ms=1.2 + (i % 3) * 0.5, wgrad_ms=0.9,
                         state_bytes=1 << 20, activation_bytes=1 << 20, output_bytes=1 << 20)
                   for i, k in enumerate(kinds))
    cluster = replace(zero_cost_cluster(p), memory_bytes=1 << 40)
    docs = []
    for m in (p + 1, 2 * p):
        plan = tune(Model(name="toy10", layers=layers), cluster, m, time_budget_s=10, iterations=30, seed=p).plan
        docs.append(_doc(plan, f"tuned p={p} m={m} stages={[(st.start, st.end, st.device) for st in plan.stages]}"))
    return docs


def random_docs(seed: int, p: int) -> list[dict]:
    """Random valid irregular plans (sampled topological orders) on looped, V and arbitrary placements."""
    rng = random.Random(seed)
    docs = []
    for kind, ns in (("looped", 2 * p), ("v", 2 * p), ("arbitrary", rng.randint(p, len(SPEC.layers)))):
        m = rng.randint(1, 2 * p + 1)
        devs = placement(kind, ns, p, rng)
        plan = make_plan(stage_devices=devs, bounds=random_bounds(len(SPEC.layers), ns, rng), num_devices=p,
                         num_microbatches=m, schedule=sample_schedule(devs, p, m, rng))
        doc = _doc(plan, f"random {kind} seed={seed} stages={ns} m={m} devices={devs}")
        if kind == "arbitrary":  # also drive these Megatron-style (forward_step_func, set_input_tensor)
            doc["meta"]["runner"] = "forward_step"
        docs.append(doc)
    return docs


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3, 4])
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seeds=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=2))
def test_plans_match_single_process_reference(world, seeds):
    docs = builtin_docs(world, random.Random(world)) + tuned_docs(world)
    for seed in seeds:
        docs += random_docs(seed, world)
    spawn(check_plans_worker, world, docs, SPEC)
