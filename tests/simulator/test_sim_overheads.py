"""Host overheads in the simulator and the tuner, against a hand-computed case and an independent oracle.

The oracle times every action from the definition in docs/formats.md ("Host overheads"): an
action starts when its device has finished the previous one and its input has arrived, and
lasts its layers' time plus its kind's action cost plus, per cross-device message it sends or
receives, that end's message cost; a cross-device message arrives its link time plus the in-flight
costs (launch, the busy sender's delivery delay) after its producer ends. It iterates start times
to a fixed point instead of running events, and computes overheads itself (not through
simulator/overheads.py or costs.hop_times).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.actions import RULES, Flow, Kind
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage
from octopipe_plugin.formats.overheads import MessageCost, Overheads
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import SimOptions, simulate
from octopipe_plugin.tuner.layout import Layout, make_job
from octopipe_plugin.simulator.costs import kind_durations

OV = Overheads(action_ms=(("B", 0.2), ("F", 0.1), ("I", 0.15), ("W", 0.07)),
               send=MessageCost(fixed_ms=0.05, per_mb_ms=0.01), recv=MessageCost(fixed_ms=0.03, per_mb_ms=0.02))
OV_BUSY = replace(OV, delivery=MessageCost(fixed_ms=0.4, per_mb_ms=0.1))  # 1e6 bytes: 0.5 ms in flight per hop


def model(n: int, out: int = 1_000_000) -> Model:
    return Model(name="m", layers=tuple(Layer(name=f"l{k}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0,
                                              state_bytes=0, activation_bytes=1, output_bytes=out)
                                        for k in range(n)))


def cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_per_s=1.0, latency_us=0.0)  # 1e6 bytes: 1 ms
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=link, inter_node=link)


def test_hand_computed_two_stage_gpipe():
    # 0F0 1 + 0.1 + send 0.06 = 1.16, lands 2.16; 1F0 1 + 0.1 + recv 0.05 ends 3.31;
    # 1B0 2 + 0.2 + send 0.06 ends 5.57, lands 6.57; 0B0 2 + 0.2 + recv 0.05 ends 8.82
    m = model(2)
    plan = build_plan(m, "gpipe", 2, 1)
    assert simulate(m, cluster(2), plan).step_time_ms == pytest.approx(8.0)
    assert simulate(m, cluster(2), plan, SimOptions(overheads=OV)).step_time_ms == pytest.approx(8.82)
    # the in-flight launch cost is one figure, given either way
    both = SimOptions(overheads=OV, launch_ms=0.5)
    assert both.overheads.launch_ms == 0.5 and both.launch_ms == 0.5
    assert simulate(m, cluster(2), plan, both).step_time_ms == pytest.approx(9.82)


def test_hand_computed_two_stage_gpipe_with_busy_sender_delivery():
    # as above, each of the two hops (0F0 -> 1F0, 1B0 -> 0B0) lands 0.4 + 0.1 x 1 MB = 0.5 ms later:
    # 0F0 ends 1.16, lands 2.66; 1F0 ends 3.81; 1B0 ends 6.07, lands 7.57; 0B0 ends 9.82
    m = model(2)
    plan = build_plan(m, "gpipe", 2, 1)
    assert simulate(m, cluster(2), plan, SimOptions(overheads=OV_BUSY)).step_time_ms == pytest.approx(9.82)
    # in flight only: no device is busier (0F0 still ends at 1.16, 1F0 lasts 1.15)
    res = simulate(m, cluster(2), plan, SimOptions(overheads=OV_BUSY))
    spans = {str(a): (t0, t1) for row in res.timeline for a, t0, t1 in row}
    assert spans["0F0"][1] == pytest.approx(1.16) and spans["1F0"] == (pytest.approx(2.66), pytest.approx(3.81))
    # plain predictions do not charge it
    assert simulate(m, cluster(2), plan).step_time_ms == pytest.approx(8.0)


def test_same_device_handoff_pays_only_the_action_cost():
    m = model(2)
    plan = Plan(model="m", num_devices=1, num_microbatches=1,
                stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=0)),
                schedule=(tuple(build_plan(m, "gpipe", 2, 1).schedule[0][:1]) +
                          tuple(build_plan(m, "gpipe", 2, 1).schedule[1]) +
                          tuple(build_plan(m, "gpipe", 2, 1).schedule[0][1:]),))
    got = simulate(m, cluster(1), plan, SimOptions(overheads=OV)).step_time_ms
    assert got == pytest.approx(6.0 + 2 * 0.1 + 2 * 0.2)


def oracle(m: Model, cl: Cluster, plan: Plan, ov: Overheads) -> float:
    """Step time by fixed-point iteration over start times (see the module docstring)."""
    dev = [st.device for st in plan.stages]
    ns = len(dev)
    out = [m.layers[st.end - 1].output_bytes for st in plan.stages]
    cost = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0, Kind.B: 2.0}
    act_ms = dict(ov.action_ms)

    def duration(a) -> float:
        s, rule = a.stage, RULES[a.kind]
        layers = plan.stages[s].end - plan.stages[s].start
        d = cost[a.kind] * layers + act_ms.get(a.kind.value, 0.0)
        if rule.sends is not None and 0 <= s + rule.sends.step < ns and dev[s + rule.sends.step] != dev[s]:
            d += ov.send.fixed_ms + ov.send.per_mb_ms * out[min(s, s + rule.sends.step)] / 1e6
        src = s - rule.receives.step if rule.receives is not None else -1
        if 0 <= src < ns and dev[src] != dev[s]:
            d += ov.recv.fixed_ms + ov.recv.per_mb_ms * out[min(s, src)] / 1e6
        return d

    def inputs(a):
        """(action, transfer ms) pairs a waits for."""
        s, rule, got = a.stage, RULES[a.kind], []
        if rule.after is not None:
            got.append(((s, rule.after, a.microbatch), 0.0))
        if rule.receives is not None:
            src = s - rule.receives.step
            if 0 <= src < ns:
                kinds = [Kind.F] if rule.receives is Flow.ACT else [Kind.B, Kind.I]
                nbytes = out[min(s, src)]
                hop = 0.0 if dev[src] == dev[s] else (cl.transfer_ms(dev[src], dev[s], nbytes) + ov.launch_ms +
                                                      ov.delivery.fixed_ms + ov.delivery.per_mb_ms * nbytes / 1e6)
                got.extend(((src, k, a.microbatch), hop) for k in kinds)
        return got

    present = {(a.stage, a.kind, a.microbatch) for row in plan.schedule for a in row}
    end: dict = {}
    for _ in range(10 * sum(len(r) for r in plan.schedule)):
        changed = False
        for row in plan.schedule:
            t = 0.0
            for a in row:
                start = t
                for key, hop in inputs(a):
                    if key in present:
                        start = max(start, end.get(key, 0.0) + hop)
                e = start + duration(a)
                key = (a.stage, a.kind, a.microbatch)
                if end.get(key) != e:
                    end[key], changed = e, True
                t = e
        if not changed:
            return max(end.values())
    raise AssertionError("oracle did not settle")


@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("gpipe", 3, 1), ("zb-h1", 3, 1), ("interleaved-1f1b", 2, 2),
                                      ("zb-v", 2, 2)])
@pytest.mark.parametrize("m_count", [2, 3, 4])
@pytest.mark.parametrize("ov", [OV, OV_BUSY], ids=["idle-sender", "busy-sender"])
def test_simulator_matches_the_oracle(name, p, v, m_count, ov):
    m = model(p * v * 2, out=400_000)
    plan = build_plan(m, name, p, m_count, v) if v > 1 else build_plan(m, name, p, m_count)
    got = simulate(m, cluster(p), plan, SimOptions(overheads=ov)).step_time_ms
    assert got == pytest.approx(oracle(m, cluster(p), plan, ov))
    assert got > simulate(m, cluster(p), plan).step_time_ms


def test_tuner_job_prices_actions_like_the_simulator():
    m = model(4)
    layout = Layout.from_cuts((1, 2, 3), 4, (0, 1, 1, 0))
    job, sc, _ = make_job(m, cluster(2), 2, layout, overheads=OV)
    dur = kind_durations(job, job.extra)
    # stage 1 (device 1) F: receives from device 0 and sends to device 1 (same): 1 + 0.1 + recv 0.05
    assert dur[Kind.F][1] == pytest.approx(1.15)
    # stage 2 I: receives from stage 3 (device 0) and sends to stage 1 (same device): 1 + 0.15 + recv 0.05
    assert dur[Kind.I][2] == pytest.approx(1.2)
    assert dur[Kind.W][0] == pytest.approx(1.07)
    assert kind_durations(make_job(m, cluster(2), 2, layout)[0]) == kind_durations(sc)
    # the busy sender's delay is the hop's (in flight), as the simulator charges it: 1 MB at 1 GB/s + 0.4 + 0.1
    busy, _, _ = make_job(m, cluster(2), 2, layout, overheads=OV_BUSY)
    assert busy.hop == (pytest.approx(1.5), None, pytest.approx(1.5))
    assert kind_durations(busy, busy.extra) == dur


def test_host_share_hand_computed():
    from octopipe_plugin.simulator.overheads import host_share

    m = model(2)
    plan = build_plan(m, "gpipe", 2, 3)
    # device 0: 3 x (F 0.1 + send 0.05) + 3 x (B 0.2 + recv 0.03) = 1.14 ms (no bytes: fixed costs only)
    got = host_share(plan, OV, step_ms=10.0, limit=0.05)
    assert got.host_ms == pytest.approx(1.14) and got.share == pytest.approx(0.114) and got.too_high
    assert got.least_step_ms() == pytest.approx(22.8)
    assert "--target-ms 22.8 or more" in got.message("--target-ms")
    assert not host_share(plan, OV, step_ms=100.0).too_high
