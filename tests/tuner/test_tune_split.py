"""The tuner decides on a split LM head: chosen where it pays, refused where its messages cost more."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import Cluster, Layer, Link, Model, validate_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner.split import tune_split


def model(head_ms: float, out: int = 0) -> Model:
    def layer(name, kind, t):
        return Layer(name=name, kind=kind, fwd_ms=t, bwd_ms=t, wgrad_ms=t, state_bytes=1 << 20,
                     activation_bytes=1 << 20, output_bytes=out)
    dense = tuple(layer(f"l{i}", "dense", 1.0) for i in range(6))
    return Model(name="heavy-head", layers=(layer("embedding", "embedding", 0.01),) + dense +
                 (layer("lm_head", "lm_head", head_ms),))


def cluster(gbps: float = 100.0, latency_us: float = 1.0) -> Cluster:
    link = Link(bandwidth_gb_per_s=gbps, latency_us=latency_us)
    return Cluster(num_devices=4, devices_per_node=4, memory_bytes=1 << 34, intra_node=link, inter_node=link)


def test_a_heavy_head_is_split_and_the_plan_is_faster_valid_and_predicted():
    m = model(3.0)
    r = tune_split(m, cluster(), 8, iterations=20, time_budget_s=120, seed=1)
    assert r.plan.splits, r.tried
    assert r.step_ms < r.unsplit_ms
    sp = r.plan.splits[0]
    assert sp.layer == m.num_layers - 1 and sum(sp.shares) == pytest.approx(1.0)
    validate_plan(r.plan, m.num_layers)
    res = simulate(m, cluster(), r.plan)
    assert res.step_time_ms == pytest.approx(r.step_ms)
    assert r.plan.predicted["step_time_ms"] == pytest.approx(r.step_ms, abs=1e-5)
    assert max(res.peak_memory_bytes) <= cluster().memory_bytes


def test_a_split_whose_messages_cost_more_than_it_saves_is_not_chosen():
    # 1 MB per hand-over at 0.01 GB/s: 100 ms a message, far more than the head's 3 ms per micro-batch
    m = model(3.0, out=1_000_000)
    r = tune_split(m, cluster(gbps=0.01), 8, iterations=20, time_budget_s=120, seed=1)
    assert not r.plan.splits
    assert r.step_ms == r.unsplit_ms and r.plan is r.unsplit.plan
    assert r.split_ms is None or r.split_ms >= r.unsplit_ms


def test_a_model_without_a_vocabulary_head_gets_the_unsplit_plan():
    m = model(1.0)
    m = Model(name=m.name, layers=m.layers[:-1])
    r = tune_split(m, cluster(), 8, iterations=10, time_budget_s=120, seed=1)
    assert not r.plan.splits and r.tried == (("no split", r.unsplit_ms, True),)


def test_the_comparison_table_shows_the_best_plan_with_and_without_splits():
    from octopipe_plugin.tuner.compare import format_table
    from octopipe_plugin.tuner.split import comparison_rows_with_splits

    r = tune_split(model(3.0), cluster(), 8, iterations=20, time_budget_s=120, seed=1)
    rows = comparison_rows_with_splits(r)
    assert [rows[0].label, rows[1].label] == ["OctoPipe (split layers)", "OctoPipe (no split)"]
    assert rows[0].step_ms == r.split_ms and rows[1].step_ms == r.unsplit_ms
    assert "head over" in format_table(rows, cluster().memory_bytes)


def test_owner_shard_keeps_a_shard_on_the_heads_owner_device():
    from dataclasses import replace

    from octopipe_plugin.tuner.constraints import Constraints

    m = model(3.0)
    cons = Constraints(owner_shard=True)
    r = tune_split(m, cluster(), 8, iterations=20, time_budget_s=120, seed=1, constraints=cons)
    assert r.plan.splits, r.tried
    sp = next(x for x in r.plan.splits if x.layer == m.num_layers - 1)
    assert r.plan.stages[-1].device in sp.devices and cons.allows_plan(r.plan)
    assert r.step_ms <= r.unsplit_ms
    # a plan whose owner holds no shard is named
    others = tuple(d for d in range(4) if d != r.plan.stages[-1].device)
    bad = replace(r.plan, splits=(replace(sp, devices=others, shares=(0.25, 0.25, 0.5)),))
    assert "no shard on its owner's device" in " ".join(cons.plan_problems(bad))
    assert Constraints().allows_plan(bad) and "owner-shard" in cons.describe() and cons.as_dict()["owner_shard"]


def test_split_embedding_off_keeps_the_embedding_whole_and_names_a_plan_that_splits_it():
    from dataclasses import replace

    from octopipe_plugin.formats.splits import SplitLayer
    from octopipe_plugin.tuner.constraints import Constraints

    m = model(3.0)
    cons = Constraints(owner_shard=True, split_embedding=False)
    r = tune_split(m, cluster(), 8, iterations=20, time_budget_s=120, seed=1, constraints=cons)
    assert r.plan.splits and all(sp.layer == m.num_layers - 1 for sp in r.plan.splits), r.tried
    assert not any("+embedding" in label for label, *_ in r.tried)
    emb = SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5))
    bad = replace(r.plan, splits=r.plan.splits + (emb,))
    assert "splits the input embedding" in " ".join(cons.plan_problems(bad))
    assert Constraints().allows_plan(bad) and "no-split-embedding" in cons.describe()
    assert cons.as_dict()["split_embedding"] is False


def test_framework_splits_say_per_framework_what_its_runner_splits():
    """One place: Megatron's and DeepSpeed's runners split the embedding too, the Megatron stand-in benchmark's not;
    every framework's keeps a shard on the head's owner."""
    from octopipe_plugin.errors import OctoPipeError
    from octopipe_plugin.tuner.constraints import Constraints, framework_splits

    assert framework_splits("megatron") == {"owner_shard": True, "split_embedding": True}
    assert framework_splits("deepspeed") == {"owner_shard": True, "split_embedding": True}
    assert not framework_splits("megatron-stand-in")["split_embedding"]
    assert Constraints(**framework_splits("megatron-stand-in")) == Constraints(owner_shard=True,
                                                                              split_embedding=False)
    with pytest.raises(OctoPipeError, match="framework 'torch': expected one of megatron"):
        framework_splits("torch")
