"""Memory choices (docs/formats.md, "Memory choices"): the memory model and step against hand-computed timelines,
and the refusals in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.costs.analytic import build_model
from octopipe_plugin.costs.blocks import llm_dims
from octopipe_plugin.costs.recompute import arch_of, module_shares
from octopipe_plugin.costs.zoo import load_arch
from octopipe_plugin.errors import FormatError, PlanError
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage
from octopipe_plugin.formats.cluster import cluster_from_dict, cluster_to_dict
from octopipe_plugin.formats.memory import parse_choice
from octopipe_plugin.formats.plan import plan_from_dict, plan_to_dict
from octopipe_plugin.gpus import get_gpu
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate

LINK = Link(bandwidth_gb_per_s=1.0, latency_us=0.0)


def cluster(n: int = 1, host_gbps: float = 1e-4, host_bytes: int | None = None) -> Cluster:
    """Free transfers; a host link on which 100 bytes take 1 ms."""
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=LINK, inter_node=LINK,
                   host_link_gb_per_s=host_gbps, host_memory_bytes=host_bytes)


def one_layer(**kw) -> Model:
    """The worked example's layer: F = I = W = 1 ms, 100 activation bytes, 10 when recomputed."""
    layer = dict(name="l0", kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1, state_bytes=0, activation_bytes=100,
                 output_bytes=0, recompute_activation_bytes=10)
    return Model(name="m", layers=(Layer(**{**layer, **kw}),))


def plan(rows, m: int, memory=(), stages=None, num_devices: int = 1) -> Plan:
    return Plan(model="m", num_devices=num_devices, num_microbatches=m,
                stages=stages or (Stage(start=0, end=1, device=0),), schedule=parse_schedule(rows),
                memory=tuple((layer, parse_choice(c)) for layer, c in memory))


LIFO = [["0F0", "0F1", "0F2", "0B2", "0B1", "0B0"]]


def spans(res, d: int = 0):
    return [(str(a), s, e) for a, s, e in res.timeline[d]]


def test_worked_example_keep():
    res = simulate(one_layer(), cluster(), plan(LIFO, 3))
    assert res.step_time_ms == 9.0 and res.peak_activation_bytes == [300] and res.host_peak_bytes is None


def test_worked_example_recompute():
    """B = I + W + the recomputed F = 3 ms; F keeps 10 bytes; B brings back 90 while it runs: peak 30 + 90."""
    res = simulate(one_layer(), cluster(), plan(LIFO, 3, [(0, "recompute")]))
    assert res.step_time_ms == 12.0
    assert spans(res)[3:] == [("0B2", 3.0, 6.0), ("0B1", 6.0, 9.0), ("0B0", 9.0, 12.0)]
    assert res.peak_activation_bytes == [120]


def test_worked_example_offload():
    """Copies of 1 ms each on one host link: out0 1-2, out1 2-3, out2 3-4, in2 4-5 (after out2: B2 is next), B2
    waits for it (5-7), in1 5-6 (issued as B2 starts), B1 7-9, in0 7-8, B0 9-11. Device: 200 at most (two
    micro-batches' bytes meet at 1-3 and again from 5); host: 300 at 3."""
    res = simulate(one_layer(), cluster(), plan(LIFO, 3, [(0, "offload")]))
    assert spans(res) == [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0F2", 2.0, 3.0), ("0B2", 5.0, 7.0),
                          ("0B1", 7.0, 9.0), ("0B0", 9.0, 11.0)]
    assert [(w, str(a), s, e) for _, w, a, s, e in res.host_copies] == [
        ("out", "0F0", 1.0, 2.0), ("out", "0F1", 2.0, 3.0), ("out", "0F2", 3.0, 4.0), ("in", "0B2", 4.0, 5.0),
        ("in", "0B1", 5.0, 6.0), ("in", "0B0", 7.0, 8.0)]
    assert res.step_time_ms == 11.0
    assert res.peak_activation_bytes == [200] and res.host_peak_bytes == [300]


def test_offload_on_a_fast_link_costs_nothing():
    res = simulate(one_layer(), cluster(host_gbps=1e6), plan(LIFO, 3, [(0, "offload")]))
    assert res.step_time_ms == pytest.approx(9.0)
    assert res.peak_activation_bytes == [200]  # B2's bytes are back while B1's copy-in has already begun


def test_recompute_with_split_backward_keeps_every_layer_until_w():
    """I re-materialises the recomputed layers (W reads them): the 90 bytes come back at I's start, W frees all."""
    rows = [["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]]
    res = simulate(one_layer(), cluster(), plan(rows, 2, [(0, "recompute")]))
    assert res.step_time_ms == 8.0  # I = 2 (its own 1 + the recomputed F)
    assert res.peak_activation_bytes == [200]
    rows = [["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]]
    assert simulate(one_layer(), cluster(), plan(rows, 2, [(0, "recompute")])).peak_activation_bytes == [100]


def test_offload_w_moves_what_w_reads_between_i_and_w():
    """`offload_w`, order 0F0 0I0 0F1 0I1 0F2 0I2 0W0 0W1 0W2 (keep: 9 ms, peak 300: every micro-batch's bytes wait
    for its W). Copy-outs after each I: out0 2-3, out1 4-5; W0's copy-in is issued as I2 (the action before W0)
    starts at 5, after out0, and runs 5-6, ahead of out2 (issued at I2's end) 6-7; W0 6-7; in1 issued as W0 starts,
    7-8 (the link is busy), W1 8-9; in2 8-9, W2 9-10. Device: 200 at most (F1's bytes beside I0's until out0 ends);
    host: 200 (out0's and out1's from 4 until in0 ends at 6, then out1's and out2's)."""
    rows = [["0F0", "0I0", "0F1", "0I1", "0F2", "0I2", "0W0", "0W1", "0W2"]]
    keep = simulate(one_layer(), cluster(), plan(rows, 3))
    assert keep.step_time_ms == 9.0 and keep.peak_activation_bytes == [300]
    res = simulate(one_layer(), cluster(), plan(rows, 3, [(0, "offload_w")]))
    assert [(w, str(a), s, e) for _, w, a, s, e in res.host_copies] == [
        ("out", "0I0", 2.0, 3.0), ("out", "0I1", 4.0, 5.0), ("out", "0I2", 6.0, 7.0), ("in", "0W0", 5.0, 6.0),
        ("in", "0W1", 7.0, 8.0), ("in", "0W2", 8.0, 9.0)]
    assert spans(res)[6:] == [("0W0", 6.0, 7.0), ("0W1", 8.0, 9.0), ("0W2", 9.0, 10.0)]
    assert res.step_time_ms == 10.0
    assert res.peak_activation_bytes == [200] and res.host_peak_bytes == [200]
    # a fused backward leaves nothing between its halves: the choice changes nothing there
    fused = simulate(one_layer(), cluster(), plan(LIFO, 3, [(0, "offload_w")]))
    assert fused.step_time_ms == 9.0 and fused.peak_activation_bytes == [300] and fused.host_copies == []


def test_offload_w_bounded_by_host_memory():
    rows = [["0F0", "0I0", "0F1", "0I1", "0F2", "0I2", "0W0", "0W1", "0W2"]]
    with pytest.raises(PlanError, match=r"device 0 holds up to .* offloaded \(layers 0\), over its host memory"):
        simulate(one_layer(), cluster(host_bytes=250), plan(rows, 3, [(0, "offload_w")]))


def test_recompute_b_brings_back_the_largest_layer_only():
    """A stage of two recomputed layers: F keeps 10 + 10, B re-runs one layer at a time: + max(90, 40)."""
    lays = (one_layer().layers[0], replace(one_layer().layers[0], name="l1", activation_bytes=50))
    model = Model(name="m", layers=lays)
    p = plan([["0F0", "0B0"]], 1, [(0, "recompute"), (1, "recompute")], stages=(Stage(start=0, end=2, device=0),))
    res = simulate(model, cluster(), p)
    assert res.peak_activation_bytes == [20 + 90]
    assert res.step_time_ms == 2 + 4 + 2  # F of both, B of both, both recomputed forwards


def test_recompute_without_the_field_keeps_the_input():
    lays = (Layer(name="a", kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1, state_bytes=0, activation_bytes=100,
                  output_bytes=7), replace(one_layer().layers[0], name="b", recompute_activation_bytes=None))
    p = plan([["0F0", "1F0", "1B0", "0B0"]], 1, [(1, "recompute")],
             stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=0)))
    res = simulate(Model(name="m", layers=lays), cluster(), p)
    assert res.peak_activation_bytes == [100 + 7 + 93]  # layer 0, layer 1's input (7), then 93 back in its B


def test_plans_without_choices_simulate_as_before():
    model = Model(name="m", layers=tuple(replace(one_layer().layers[0], name=f"l{i}") for i in range(4)))
    p = build_plan(model, "1f1b", 4, 8)
    a, b = simulate(model, cluster(4), p), simulate(model, cluster(4), replace(p, memory=()))
    assert a == b


def test_pairs_compose_with_offload():
    """A pair's backward half waits for its copy-in like a backward alone: the pair starts after it."""
    model = Model(name="m", layers=tuple(replace(one_layer().layers[0], name=f"l{i}") for i in range(2)))
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=0))
    rows = [["0F0", "1F0", "0F1", "1B0", "1F1", "0B0", "1B1", "0B1"]]
    base = plan(rows, 2, stages=stages)
    base = replace(base, pairs=((base.schedule[0][2], base.schedule[0][3]),))
    res = simulate(model, cluster(), replace(base, memory=((1, parse_choice("offload")),)))
    t = dict((a, (s, e)) for a, s, e in spans(res))
    copy_in = next((s, e) for _, w, a, s, e in res.host_copies if w == "in" and str(a) == "1B0")
    assert t["0F1"][0] == t["1B0"][0] >= copy_in[1]
    assert t["0F1"] == t["1B0"]


def test_selective_shares_are_blocks_terms():
    """mlp frees fc1's output and the activation's output; its F share is fc1, activation and fc2."""
    arch = load_arch("llama3-8b")
    d = llm_dims(arch)
    shares = module_shares(arch, "dense", get_gpu("H100"))
    model = build_model(arch, "H100")
    dense = next(l for l in model.layers if l.kind == "dense")
    up = 2 * d.ffn // d.t
    assert shares["mlp"].freed * dense.activation_bytes == pytest.approx(d.n * up * d.dt + d.n * d.ffn * d.dt)
    assert shares["layernorm"].freed * dense.activation_bytes == pytest.approx(2 * d.n * d.h * d.dt)
    assert set(shares) == {"core_attn", "layernorm", "mlp"}
    assert arch_of(model.meta) == arch


def test_selective_prices_the_layer():
    model = build_model(load_arch("llama3-8b"), "H100")
    i = next(k for k, l in enumerate(model.layers) if l.kind == "dense")
    lay = model.layers[i]
    share = module_shares(load_arch("llama3-8b"), "dense", get_gpu("H100"))["mlp"]
    p = build_plan(model, "gpipe", 2, 2)  # device 0: F0 F1 B0 B1, layer i on it
    assert p.stages[0].start <= i < p.stages[0].end
    got = simulate(model, cluster(2, host_gbps=50), replace(p, memory=((i, parse_choice("selective:mlp")),)))
    base = simulate(model, cluster(2, host_gbps=50), p)
    freed = round(share.freed * lay.activation_bytes)
    # both micro-batches' F kept `freed` less; B0 brings one back while it runs
    assert base.peak_activation_bytes[0] - got.peak_activation_bytes[0] == freed
    assert got.busy_ms[0] == pytest.approx(base.busy_ms[0] + 2 * share.rerun * lay.fwd_ms)


def test_refusals_in_one_line():
    model = build_model(load_arch("llama3-8b"), "H100")
    i = next(k for k, l in enumerate(model.layers) if l.kind == "dense")
    p = build_plan(model, "1f1b", 2, 1)
    with pytest.raises(PlanError, match=r"\$\.memory\.%d: selective:moe_act on layer %d, whose kind 'dense' has no "
                                        r"moe_act.*fix" % (i, i)) as e:
        simulate(model, cluster(2), replace(p, memory=((i, parse_choice("selective:moe_act")),)))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="use recompute or offload"):
        simulate(one_layer(), cluster(), plan(LIFO, 3, [(0, "selective:mlp")]))
    with pytest.raises(PlanError, match=r"device 0 holds up to .* over its host memory .*fix: offload fewer"):
        simulate(one_layer(), cluster(host_bytes=299), plan(LIFO, 3, [(0, "offload")]))
    simulate(one_layer(), cluster(host_bytes=300), plan(LIFO, 3, [(0, "offload")]))
    with pytest.raises(PlanError, match="already costs fully recomputed"):
        rec = build_model(replace(load_arch("llama3-8b"), recompute=True), "H100")
        simulate(rec, cluster(2), replace(p, memory=((i, parse_choice("recompute")),)))


@pytest.mark.parametrize("memory, match", [
    ({"5": "recompute"}, r"\$\.memory\.5: expected a layer index of the model, 0\.\.0"),
    ({"0": "swap"}, r"\$\.memory\.0: expected .*unknown choice 'swap'"),
    ({"0": "selective:attn"}, r"unknown module 'attn'"),
    ({"0": "selective:moe,moe_act"}, r"'moe' already recomputes moe_act"),
    ({"x": "offload"}, r"\$\.memory\.x: expected a layer index"),
])
def test_plan_file_refusals(memory, match):
    doc = plan_to_dict(plan(LIFO, 3))
    with pytest.raises(FormatError, match=match):
        plan_from_dict({**doc, "memory": memory}, "p.json", num_layers=1)


def test_plan_and_cluster_round_trip():
    p = plan(LIFO, 3, [(0, "selective:mlp,core_attn")])
    doc = plan_to_dict(p)
    assert doc["memory"] == {"0": "selective:core_attn,mlp"}
    assert plan_from_dict(doc, num_layers=1) == p
    c = cluster(host_bytes=123)
    assert cluster_from_dict(cluster_to_dict(c)) == replace(c, name="cluster")
    plain = Cluster(num_devices=1, devices_per_node=1, memory_bytes=1 << 30, intra_node=LINK, inter_node=LINK,
                    gpu="A100-80G")
    assert "host_link_gb_per_s" not in cluster_to_dict(plain)
    assert plain.host_link == 25.0 and plain.host_memory == 128 << 30


def test_split_plans_refuse_offload_choices():
    from octopipe_plugin.formats.splits import SplitLayer

    p = replace(plan(LIFO, 3, [(0, "offload")]), splits=(SplitLayer(layer=0, devices=(0,), shares=(1.0,)),))
    with pytest.raises(PlanError, match="offload choices on a plan with split layers .* fix: drop the offload"):
        simulate(one_layer(), cluster(), p)


def test_split_plan_prices_recompute_by_the_reference_rule():
    """A split head over both devices, the dense layer of stage 0 recomputed. Device 0's list order: 0F0 0F1 keep 10
    each (20), the head shards' 1H0 and 1H1 add 50 each (120), 0B0 brings 90 back while it runs (210) and frees 100,
    0B1 the same (200, then 100), 1K0 1K1 free the shards'; without the choice 100 + 100 + 50 + 50 = 300. Each B of
    stage 0 re-runs the dense F (1 ms): device 0, last to end, ends 2 ms later."""
    from octopipe_plugin.formats.splits import SplitLayer

    def lay(kind, f, act=0, rec=None):
        return Layer(name=kind, kind=kind, fwd_ms=f, bwd_ms=f, wgrad_ms=f, state_bytes=0, activation_bytes=act,
                     output_bytes=0, recompute_activation_bytes=rec)

    model = Model(name="m", layers=(lay("embedding", 0), lay("dense", 1, 100, 10), lay("lm_head", 2, 100)))
    rows = [["0F0", "0F1", "1H0", "1J0", "1H1", "1J1", "0B0", "0B1", "1K0", "1K1"],
            ["1F0", "1F1", "1H0", "1J0", "1H1", "1J1", "1B0", "1B1", "1K0", "1K1"]]
    keep = Plan(model="m", num_devices=2, num_microbatches=2,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1)),
                schedule=parse_schedule(rows), splits=(SplitLayer(layer=2, devices=(0, 1), shares=(0.5, 0.5)),))
    rec = replace(keep, memory=((1, parse_choice("recompute")),))
    a, b = simulate(model, cluster(2), keep), simulate(model, cluster(2), rec)
    assert a.peak_activation_bytes == [300, 100] and b.peak_activation_bytes == [210, 100]
    assert b.step_time_ms == pytest.approx(a.step_time_ms + 2.0)
    assert [e for _, _, e in b.timeline[0]][-1] == pytest.approx(b.step_time_ms)
