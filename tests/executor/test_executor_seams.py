"""Multi-tensor boundaries, gradient sink, step data/outputs and forward_only on gloo (3 ranks).

Two models: (hidden, integer mask) boundaries, and the zoo's branched `vlm` graph with real
tiny layers (a vision encoder and a text embedding both feeding the first decoder layer).
Each runs a looped, a V-shape and a tuned irregular plan, two steps with different sequence
lengths, metas declared or learned by handshake, with the plain and the autograd gradient
sink; every rank checks loss and gradients against a single-process reference
(octopipe_plugin.testing.seam_checks lists everything asserted).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.testing.plans import make_plan, random_bounds
from octopipe_plugin.testing.seam_checks import check_cases_worker
from octopipe_plugin.formats import Layer, Model, plan_to_dict
from octopipe_plugin.graph import live_outputs
from octopipe_plugin.actions import Kind
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for

P = 3


def _builtin(name: str, v: int, m: int, bounds) -> object:
    devs = stage_devices_for(name, P, v)
    return make_plan(stage_devices=devs, bounds=bounds, num_devices=P, num_microbatches=m,
                     schedule=SCHEDULES[name].generate(devs, P, m))


def _tuned(model, m: int):
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.tuner import tune

    cluster = replace(zero_cost_cluster(P), memory_bytes=1 << 40)
    return tune(model, cluster, m, time_budget_s=10, iterations=20, seed=0).plan


def _masked_cost_model() -> Model:
    kinds = ("embedding", "attention", "mlp", "attention", "mlp", "attention", "mlp", "lm_head")
    return Model(name="masked8", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=1.0 + (i % 3) * 0.6, bwd_ms=1.1 + (i % 2) * 0.5, wgrad_ms=0.8,
              state_bytes=1 << 20, activation_bytes=1 << 20, output_bytes=1 << 20) for i, k in enumerate(kinds)))


def _heavy_vision_vlm() -> Model:
    """The zoo vlm with a costlier vision encoder (more tiles), so the tuner splits the vision branch."""
    from octopipe_plugin.costs import resolve_model

    m = resolve_model("vlm")
    heavy = tuple(replace(x, fwd_ms=x.fwd_ms * 8, bwd_ms=x.bwd_ms * 8, wgrad_ms=x.wgrad_ms * 8)
                  if x.kind in ("vision", "projector") else x for x in m.layers)
    return replace(m, layers=heavy)


def _case(model: str, plan, label: str, *, sink: str, declared: bool, tags: bool, seqs) -> dict:
    return {"model": model, "plan": plan_to_dict(plan), "label": f"{model} {label}", "sink": sink,
            "declared": declared, "tags": tags, "seqs": list(seqs)}


def masked_cases() -> list[dict]:
    rng = random.Random(5)
    looped = _builtin("interleaved-1f1b", 2, P, random_bounds(8, 2 * P, rng))
    vshape = _builtin("zb-v", 2, P + 1, random_bounds(8, 2 * P, rng))
    tuned = _tuned(_masked_cost_model(), P + 1)
    return [
        _case("masked", looped, "looped interleaved-1f1b", sink="direct", declared=True, tags=True, seqs=(5, 7)),
        _case("masked", vshape, "V zb-v", sink="autograd", declared=False, tags=False, seqs=(6, 4)),
        _case("masked", tuned, "tuned", sink="autograd", declared=False, tags=True, seqs=(5, 3)),
    ]


def vlm_cases() -> list[dict]:
    # cuts at 25 (the projector's output crosses; the next stage's embedding reads the tokens) and
    # at 26 (projector and embedding outputs both cross), and inside the vision encoder
    looped = _builtin("interleaved-1f1b", 2, P, [(0, 12), (12, 25), (25, 26), (26, 40), (40, 50), (50, 59)])
    vshape = _builtin("zb-v", 2, P + 1, [(0, 13), (13, 26), (26, 35), (35, 45), (45, 52), (52, 59)])
    tuned = _tuned(_heavy_vision_vlm(), P + 1)
    return [
        _case("vlm", looped, "looped interleaved-1f1b", sink="autograd", declared=False, tags=True, seqs=(4, 6)),
        _case("vlm", vshape, "V zb-v", sink="direct", declared=True, tags=True, seqs=(5, 3)),
        _case("vlm", tuned, "tuned", sink="autograd", declared=True, tags=False, seqs=(4, 2)),
    ]


def test_the_cases_cover_what_they_claim():
    from octopipe_plugin.costs import resolve_model

    vlm = resolve_model("vlm")
    cases = vlm_cases()
    cuts = {st["layers"][1] for st in cases[0]["plan"]["stages"][:-1]}
    assert len(live_outputs(vlm, 26)) == 2 and {25, 26} <= cuts
    tuned = cases[2]["plan"]
    ends = [st["layers"][1] for st in tuned["stages"][:-1]]
    assert any(e < 25 for e in ends), f"the tuned plan keeps the vision branch on one stage: {ends}"
    devices = [st["device"] for st in tuned["stages"]]
    assert devices != sorted(devices) and len(devices) > P  # irregular: several stages per device, not in order
    for group in (masked_cases(), cases):  # per model, the hook count sees split I/W somewhere
        assert any(c["sink"] == "autograd" and any(Kind.I.value in a for row in c["plan"]["schedule"] for a in row)
                   for c in group)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_multi_tensor_boundaries_match_the_reference_on_every_plan():
    spawn(check_cases_worker, P, masked_cases() + vlm_cases())


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_direction_groups_are_made_once_for_every_pipeline_of_the_world():
    from octopipe_plugin.testing.seam_checks import check_pair_groups_worker
    from octopipe_plugin.testing.toy import ToySpec

    devs = stage_devices_for("zb-v", 2, 2)
    plan = make_plan(stage_devices=devs, bounds=[(0, 2), (2, 4), (4, 5), (5, 7)], num_devices=2, num_microbatches=3,
                     schedule=SCHEDULES["zb-v"].generate(devs, 2, 3))
    # 4 ranks = 2 pipelines of 2 (as with data parallelism 2): pairs of both pipelines made by every rank
    spawn(check_pair_groups_worker, 4, plan_to_dict(plan), ToySpec())
