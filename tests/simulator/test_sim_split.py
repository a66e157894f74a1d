"""Split layers (docs/formats.md, "Split layers"): the worked checks, validation, deadlocks, messages, memory.

Transfers cost nothing unless a test says otherwise (output_bytes = 0, latency 0).
"""

from __future__ import annotations

import random

import pytest

from octopipe_plugin.actions import Action, Kind, parse_schedule
from octopipe_plugin.errors import DeadlockError, FormatError, PlanError
from octopipe_plugin.testing.plans import random_plan
from octopipe_plugin.executor.validate import check_runnable
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage, plan_from_dict, plan_to_dict, validate_plan
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.schedules.split_messages import pair_messages, split_messages, stats_gathers
from octopipe_plugin.simulator import SimOptions, simulate
from octopipe_plugin.simulator.split import simulate_split


def layer(kind, f, i, w, *, state=0, act=0, out=0) -> Layer:
    return Layer(name=kind, kind=kind, fwd_ms=f, bwd_ms=i, wgrad_ms=w, state_bytes=state, activation_bytes=act,
                 output_bytes=out)


def cluster(n: int = 2, gbps: float = 1.0, latency_us: float = 0.0) -> Cluster:
    link = Link(bandwidth_gb_per_s=gbps, latency_us=latency_us)
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=link, inter_node=link)


HEAD_MODEL = Model(name="head", layers=(layer("embedding", 0, 0, 0), layer("dense", 1, 1, 1),
                                        layer("lm_head", 2, 2, 2, state=1000, act=100)))
HEAD_SPLIT = SplitLayer(layer=2, devices=(0, 1), shares=(0.5, 0.5))


def head_plan(rows=None, splits=(HEAD_SPLIT,)) -> Plan:
    rows = rows or [["0F0", "1H0", "1J0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]
    return Plan(model="head", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1)),
                schedule=parse_schedule(rows), splits=tuple(splits))


def test_formats_worked_check_split_head():
    res = simulate(HEAD_MODEL, cluster(), head_plan())
    times = {(d, str(a)): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    assert times[(0, "0F0")] == (0, 1) and times[(1, "1F0")] == (1, 1)
    assert times[(0, "1H0")] == (1, 2) == times[(1, "1H0")]
    assert times[(0, "1J0")] == (2, 3) == times[(1, "1J0")]
    assert times[(1, "1B0")] == (3, 3) and times[(0, "0B0")] == (3, 5)
    assert times[(1, "1K0")] == (3, 4) and times[(0, "1K0")] == (5, 6)
    assert res.step_time_ms == 6.0
    assert res.bubble_ratio == pytest.approx(0.25)
    unsplit = Plan(model="head", num_devices=2, num_microbatches=1, stages=head_plan().stages,
                   schedule=parse_schedule([["0F0", "0B0"], ["1F0", "1B0"]]))
    assert simulate(HEAD_MODEL, cluster(), unsplit).step_time_ms == 9.0
    # the head's state and logits are shared out: half each, nothing left on the owner's own account
    assert res.static_bytes == [500, 500]
    assert res.peak_activation_bytes == [50, 50]


def test_split_embedding_partials_and_gradient():
    model = Model(name="emb", layers=(layer("embedding", 2, 0, 2, state=800, act=40), layer("dense", 1, 1, 1),
                                      layer("lm_head", 1, 1, 1)))
    plan = Plan(model="emb", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1)),
                schedule=parse_schedule([["0E0", "0F0", "0B0", "0G0"], ["0E0", "1F0", "1B0", "0G0"]]),
                splits=(SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5)),))
    res = simulate(model, cluster(), plan)
    # rounded: stage 0's verdict (8 bytes at 1 GB/s) reaches device 1 after 8e-6 ms (the token ids, of no known
    # size without the model's arch, after 0)
    times = {(d, str(a)): (round(s, 4), round(e, 4)) for d, row in enumerate(res.timeline) for a, s, e in row}
    assert times[(0, "0E0")] == (0, 1) == times[(1, "0E0")]
    assert times[(0, "0F0")] == (1, 2)  # it sums both partials
    assert times[(1, "1F0")] == (2, 3) and times[(1, "1B0")] == (3, 5) and times[(0, "0B0")] == (5, 7)
    assert times[(0, "0G0")] == (7, 8) == times[(1, "0G0")]  # both wait for stage 0's input gradient
    assert res.step_time_ms == pytest.approx(8.0, abs=1e-4)
    assert res.static_bytes == [400, 400]
    assert res.peak_activation_bytes == [20, 20]


def test_split_embedding_token_ids_and_stage0_verdict_are_sent_before_the_step():
    # stage 0's rank (device 0) broadcasts whether it refused the step (8 bytes, every device) and sends the step's
    # token ids, int64 x seq 1000 x mbs 2 = 16000 bytes, to shard device 1; 1 GB/s, 10 us: 0.026 ms, the verdict
    # 0.010008 ms. Device 1's E waits for the ids, device 0 starts after its send, device 2 (no shard) after the
    # verdict; stage 0's F sums the partials (0 bytes: the latency) as before
    from octopipe_plugin.simulator.split import SplitGraph, split_costs, without_split_layers
    from octopipe_plugin.simulator.costs import stage_costs

    model = Model(name="emb", layers=(layer("embedding", 2, 0, 2), layer("dense", 1, 1, 1), layer("dense", 1, 1, 1),
                                      layer("lm_head", 1, 1, 1)), meta={"arch": {"seq_len": 1000, "micro_batch_size": 2}})
    plan = Plan(model="emb", num_devices=3, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1), Stage(start=3, end=4, device=2)),
                schedule=parse_schedule([["0E0", "0F0", "0B0", "0G0"], ["0E0", "1F0", "1B0", "0G0"], ["2F0", "2B0"]]),
                splits=(SplitLayer(layer=0, devices=(1, 0), shares=(0.5, 0.5)),))
    res = simulate(model, cluster(3, latency_us=10.0), plan)
    times = {(d, str(a)): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    assert times[(1, "0E0")] == pytest.approx((0.026, 1.026), rel=1e-9)
    assert times[(0, "0E0")] == pytest.approx((0.026, 1.026), rel=1e-9)
    assert times[(0, "0F0")] == pytest.approx((1.036, 2.036), rel=1e-9)
    sc = stage_costs(without_split_layers(model, plan.splits), plan.stages)
    g = SplitGraph(cluster(3, latency_us=10.0), plan, sc, split_costs(model, plan), 0.0)
    assert g.ready == pytest.approx([0.026, 0.010008, 0.010008], rel=1e-9)


def test_statistics_exchange_and_partials_cost_their_transfer():
    # 1 GB/s, 10 us: each partial (1 MB) takes 1.01 ms, the statistics (1 kB) 0.011 ms, the head's input its
    # 1 MB plus its loss terms (12 bytes a token, the statistics' 1000 // 12 tokens: 996 bytes) 1.010996 ms
    model = Model(name="head", layers=(layer("embedding", 0, 0, 0), layer("dense", 1, 1, 1, out=1_000_000),
                                       layer("lm_head", 2, 2, 2)))
    sp = SplitLayer(layer=2, devices=(0, 1), shares=(0.5, 0.5), stats_bytes=1000)
    res = simulate(model, cluster(latency_us=10.0), head_plan(splits=(sp,)))
    times = {(d, str(a)): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    head_input = 1.01 + 996e-6
    assert times[(1, "1F0")] == pytest.approx((2.01, 2.01))  # stage 0's output crosses to stage 1
    # the owner's F output crosses back to shard 0, with its loss terms
    assert times[(0, "1H0")] == pytest.approx((2.01 + head_input, 3.01 + head_input), rel=1e-9)
    assert times[(1, "1H0")] == pytest.approx((2.01, 3.01))
    assert times[(1, "1J0")][0] == pytest.approx(3.01 + head_input + 0.011, rel=1e-9)  # shard 0's statistics cross
    assert times[(1, "1B0")][0] == pytest.approx(times[(0, "1J0")][1] + 1.01)  # shard 0's partial crosses


def test_generic_loop_equals_the_compiled_one_on_unsplit_plans():
    from octopipe_plugin.costs import resolve_cluster, resolve_model

    model = resolve_model("llama2-7b", "H100")
    rng = random.Random(5)
    for _ in range(8):
        nd = rng.choice([2, 4, 8])
        plan = random_plan(rng, num_devices=nd, num_layers=model.num_layers, num_stages=rng.choice([nd, 2 * nd]),
                           num_microbatches=rng.choice([1, 3, 6]), placement_kind=rng.choice(["looped", "v"]))
        opts = SimOptions(launch_ms=rng.choice([0.0, 0.02]))
        a = simulate(model, resolve_cluster(f"h100x{nd}"), plan, opts)
        b = simulate_split(model, resolve_cluster(f"h100x{nd}"), plan, opts)
        assert b.step_time_ms == pytest.approx(a.step_time_ms, abs=1e-9)
        assert b.peak_memory_bytes == a.peak_memory_bytes
        assert [[(x, pytest.approx(s), pytest.approx(e)) for x, s, e in r] for r in b.timeline] == a.timeline


def test_plan_document_round_trip_and_unsplit_documents_unchanged():
    plan = head_plan()
    doc = plan_to_dict(plan)
    assert doc["splits"] == [{"layer": 2, "devices": [0, 1], "shares": [0.5, 0.5], "stats_bytes": 0}]
    back = plan_from_dict(doc, num_layers=3)
    assert back.splits == plan.splits and back.schedule == plan.schedule
    assert "splits" not in plan_to_dict(head_plan(rows=[["0F0", "0B0"], ["1F0", "1B0"]], splits=()))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["splits"][0].update(shares=[0.5, 0.4]), "summing to 1"),
    (lambda d: d["splits"][0].update(devices=[0, 0]), "distinct devices"),
    (lambda d: d["splits"][0].update(devices=[0, 5]), "device 5"),
    (lambda d: d["splits"][0].update(layer=1), "must be layer 0"),
    (lambda d: d["splits"][0].update(shares=[1.0]), "shares"),
])
def test_bad_split_records_are_refused_naming_the_field(mutate, message):
    doc = plan_to_dict(head_plan())
    mutate(doc)
    with pytest.raises(FormatError, match=message) as exc:
        plan_from_dict(doc, "p.json", num_layers=3)
    assert "p.json" in str(exc.value) and "$.splits" in str(exc.value)


def test_incomplete_or_misplaced_shard_actions_are_refused():
    with pytest.raises(PlanError, match="device 1: no head-shard weight-gradient 1K0"):
        validate_plan(head_plan(rows=[["0F0", "1H0", "1J0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0"]]))
    with pytest.raises(PlanError, match="without a shard of layer 2"):
        validate_plan(head_plan(splits=(SplitLayer(layer=2, devices=(1,), shares=(1.0,)),)))
    with pytest.raises(PlanError, match="splits no LM head"):
        validate_plan(head_plan(splits=()))
    with pytest.raises(PlanError, match="belongs to stage 1"):
        validate_plan(head_plan(rows=[["0F0", "0H0", "1J0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]))


def test_split_of_a_layer_that_is_not_a_vocabulary_layer_is_refused():
    model = Model(name="head", layers=HEAD_MODEL.layers[:2] + (layer("dense", 2, 2, 2),))
    with pytest.raises(PlanError, match="is a 'dense' layer"):
        simulate(model, cluster(), head_plan())


def test_a_deadlocking_split_plan_is_refused_before_running_naming_the_wait():
    rows = [["0F0", "1J0", "1H0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]
    with pytest.raises(DeadlockError, match="device 0 stuck at 1J0") as exc:
        check_runnable(head_plan(rows=rows))
    assert "head-shard forward 1H0 on device 0" in str(exc.value)


def test_the_executor_accepts_a_valid_split_plan_and_nccl_rules_pass():
    check_runnable(head_plan(), nccl=True)


def test_split_options_other_than_launch_cost_are_refused():
    with pytest.raises(PlanError, match="reference semantics only"):
        simulate(HEAD_MODEL, cluster(), head_plan(), SimOptions(contention=True))
    base = simulate(HEAD_MODEL, cluster(), head_plan()).step_time_ms
    assert simulate(HEAD_MODEL, cluster(), head_plan(), SimOptions(launch_ms=0.5)).step_time_ms > base


def test_split_messages_follow_the_sender_list_order():
    msgs = {str(m) for _, m in split_messages(head_plan())}
    assert msgs == {"head-input[1F0->1H0] dev1->dev0", "head-partial[1J0->1B0] dev0->dev1"}
    pairs = pair_messages(head_plan())
    assert [str(m) for m in pairs[(0, 1)]] == ["act[0F0->1F0] dev0->dev1", "head-partial[1J0->1B0] dev0->dev1"]
    assert [str(m) for m in pairs[(1, 0)]] == ["head-input[1F0->1H0] dev1->dev0", "grad[1B0->0B0] dev1->dev0"]
    # the statistics are no messages: one all-gather a micro-batch over the shard devices (issue 36)
    assert [str(g) for g in stats_gathers(head_plan())] == ["stats[1H0->1J0] all-gather over dev0,1"]


FOUR = Model(name="four", layers=(layer("embedding", 0, 0, 0),) + tuple(layer("dense", 1, 1, 1) for _ in range(3))
             + (layer("lm_head", 2, 2, 2),))


def four_plan(m: int = 2, orders=None) -> Plan:
    """Four devices, one dense stage each (the last also owns the head), the head split over all four; each device
    runs its stage's F, every H and J, its B, every K; `orders[d]`: device d's H micro-batch order."""
    rows = []
    for d in range(4):
        row = [f"{d}F{mb}" for mb in range(m)]
        for mb in (orders or {}).get(d, range(m)):
            row += [f"3H{mb}", f"3J{mb}"]
        row += [f"{d}B{mb}" for mb in range(m)] + [f"3K{mb}" for mb in range(m)]
        rows.append(row)
    stages = (Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1), Stage(start=3, end=4, device=2),
              Stage(start=4, end=5, device=3))
    return Plan(model="four", num_devices=4, num_microbatches=m, stages=stages, schedule=parse_schedule(rows),
                splits=(SplitLayer(layer=4, devices=(0, 1, 2, 3), shares=(0.25,) * 4, stats_bytes=1000),))


def test_statistics_all_gather_is_a_ring_over_the_shards_after_the_last_h():
    """By hand, 4 shards over 2 nodes (1 GB/s and 10 us in a node, 0.1 GB/s and 10 us across): the ring 0-1-2-3-0
    has two cross-node hops of 1000 bytes (0.02 ms), so the all-gather takes 3 rounds of 0.02 ms after the last
    shard's H; each J starts then (n(n - 1) = 12 messages a micro-batch before)."""
    from octopipe_plugin.simulator.split import gather_ms

    fast, slow = Link(bandwidth_gb_per_s=1.0, latency_us=10.0), Link(bandwidth_gb_per_s=0.1, latency_us=10.0)
    two_nodes = Cluster(num_devices=4, devices_per_node=2, memory_bytes=1 << 40, intra_node=fast, inter_node=slow)
    assert gather_ms(two_nodes, (0, 1, 2, 3), 1000) == pytest.approx(3 * 0.02)
    assert gather_ms(two_nodes, (0, 1), 1000) == pytest.approx(0.011) and gather_ms(two_nodes, (2,), 1000) == 0.0
    res = simulate(FOUR, two_nodes, four_plan(1))
    times = {(d, str(a)): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    last_h = max(times[(d, "3H0")][1] for d in range(4))
    for d in range(4):
        assert times[(d, "3J0")][0] == pytest.approx(last_h + 0.06), d
    assert len(stats_gathers(four_plan(1))) == 1 and not [m for _, m in split_messages(four_plan(1))
                                                         if m.what == "stats"]


def test_shard_devices_running_their_h_in_different_orders_are_refused_naming_them():
    """A collective pairs by its order on the group: device 2 starting micro-batch 1's statistics where the others
    start micro-batch 0's would gather the wrong shards' numbers, so the executor refuses it before running."""
    check_runnable(four_plan(2))
    with pytest.raises(PlanError, match=r"schedule\[2\]: .* micro-batch 1 where schedule\[0\] runs 0 .*fix: order"):
        check_runnable(four_plan(2, orders={2: [1, 0]}))


def test_memory_curve_of_a_split_plan_counts_the_shards():
    res = simulate(HEAD_MODEL, cluster(), head_plan())
    for d in range(2):
        curve = res.memory_curve(d)
        assert max(b for _, b in curve) == res.peak_memory_bytes[d] == 550
        assert curve[-1][1] == res.static_bytes[d] == 500


def test_busy_sender_delivery_is_charged_like_the_launch_cost_on_every_hand_over():
    # both are in flight on every cross-device message (costs.hop_times, SplitGraph.move): a fixed delivery
    # delay of 0.5 ms and a launch cost of 0.5 ms give the same step, stage hops and shard hand-overs alike
    from octopipe_plugin.formats.overheads import MessageCost, Overheads

    launch = simulate(HEAD_MODEL, cluster(), head_plan(), SimOptions(launch_ms=0.5)).step_time_ms
    busy = SimOptions(overheads=Overheads(delivery=MessageCost(fixed_ms=0.5)))
    assert simulate(HEAD_MODEL, cluster(), head_plan(), busy).step_time_ms == pytest.approx(launch)


def test_split_messages_pay_the_host_cost_of_each_end_on_the_actions_that_send_and_take_them():
    """The worked check with 0.1 ms per send and 0.2 ms per receive (issue 36): by hand, the owner's F sends the head
    input, each H sends its statistics (dev0's also receives the head input), each J receives the other's and dev0's
    sends its partial, the owner's B receives it; the stage messages pay as before (0F0 sends, 1F0 receives...)."""
    from octopipe_plugin.formats.overheads import MessageCost, Overheads

    ov = Overheads(send=MessageCost(fixed_ms=0.1), recv=MessageCost(fixed_ms=0.2))
    res = simulate(HEAD_MODEL, cluster(), head_plan(), SimOptions(overheads=ov))
    times = {(d, str(a)): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    want = {(0, "0F0"): (0, 1.1), (1, "1F0"): (1.1, 1.4), (0, "1H0"): (1.4, 2.7), (1, "1H0"): (1.4, 2.5),
            (0, "1J0"): (2.7, 4.0), (1, "1J0"): (2.7, 3.9), (1, "1B0"): (4.0, 4.3), (0, "0B0"): (4.3, 6.5),
            (1, "1K0"): (4.3, 5.3), (0, "1K0"): (6.5, 7.5)}
    for k, (s, e) in want.items():
        assert times[k] == (pytest.approx(s), pytest.approx(e)), k
    assert res.step_time_ms == pytest.approx(7.5)


def test_host_share_counts_the_split_messages():
    """The scale check (stand-in benchmarks' --target-ms) counts a split head's hand-overs: by hand, each device of the
    worked check sends and receives 0.1 / 0.2 ms per message: dev0 0F0's send, 0B0's receive, the head input in, its
    statistics out and in, its partial out = 0.9 ms; dev1 likewise 0.9 ms (0.3 without the split messages)."""
    from octopipe_plugin.formats.overheads import MessageCost, Overheads
    from octopipe_plugin.simulator.overheads import host_share

    ov = Overheads(send=MessageCost(fixed_ms=0.1), recv=MessageCost(fixed_ms=0.2))
    assert host_share(head_plan(), ov, step_ms=10.0).host_ms == pytest.approx(0.9)
    assert host_share(head_plan(splits=()), ov, step_ms=10.0).host_ms == pytest.approx(0.3)


def test_host_share_counts_one_post_and_one_wait_per_shard_for_the_statistics():
    """By hand at 0.1 ms a send and 0.2 a receive, four_plan's busiest device is 3 (the head's owner): 3F0's receive
    0.2, the head's input to three shards 0.3, its H's post 0.1, its J's wait 0.2, 3B0's three partials 0.6 and its
    gradient out 0.1 = 1.5 ms; with the statistics as messages its H would send three and its J take three (2.1)."""
    from octopipe_plugin.formats.overheads import MessageCost, Overheads
    from octopipe_plugin.simulator.overheads import host_share

    ov = Overheads(send=MessageCost(fixed_ms=0.1), recv=MessageCost(fixed_ms=0.2))
    got = host_share(four_plan(1), ov, step_ms=10.0)
    assert (got.device, got.host_ms) == (3, pytest.approx(1.5))


def test_the_all_gather_pays_its_host_cost_once_and_shard_actions_pay_their_action_cost():
    """By hand (1 GB/s, no latency, 1000 bytes of statistics: 0.001 ms a hop): with a 0.5 ms gather round and 0.1 ms a
    send the gather over four shards lasts 3 x 0.001 + 0.5 + 2 x 0.1 = 0.703 ms after the last H (the collective at
    two members, then a part sent for each further one), and the H runs 0.4 ms longer (its action cost, its post)."""
    from octopipe_plugin.formats.overheads import MessageCost, Overheads
    from octopipe_plugin.simulator.split import gather_ms

    ov = Overheads(action_ms=(("H", 0.3),), gather_round=MessageCost(fixed_ms=0.5), send=MessageCost(fixed_ms=0.1))
    assert gather_ms(cluster(4), (0, 1, 2, 3), 1000, overheads=ov) == pytest.approx(0.703)
    assert gather_ms(cluster(4), (0, 1), 1000, overheads=ov) == pytest.approx(0.501)
    base = simulate(FOUR, cluster(4), four_plan(1))
    res = simulate(FOUR, cluster(4), four_plan(1), SimOptions(overheads=ov))
    for r, extra in ((base, 0.0), (res, 0.4)):
        times = {(d, str(a)): (s, e) for d, row in enumerate(r.timeline) for a, s, e in row}
        for d in range(4):
            s, e = times[(d, "3H0")]
            assert e - s == pytest.approx(0.25 * 2 + extra), d  # a quarter of the head's 2 ms forward
        last_h = max(times[(d, "3H0")][1] for d in range(4))
        gather = 0.003 + (0.7 if extra else 0.0)
        assert min(times[(d, "3J0")][0] for d in range(4)) == pytest.approx(last_h + gather)
