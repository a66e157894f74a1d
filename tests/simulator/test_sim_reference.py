"""The simulator against closed forms and hand-computed timings.

Unless a test says otherwise: every stage has the same cost, F = 1 and B = I + W = 2 per
device-worth of layers (split evenly over the v stages of a device), transfers cost nothing
(output_bytes = 0, latency 0), so step times are exact binary fractions.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage
from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import SimOptions, simulate


def uniform(num_layers: int, f: float, i: float, w: float, *, act: int = 1, out: int = 0, state: int = 0) -> Model:
    layer = dict(kind="dense", fwd_ms=f, bwd_ms=i, wgrad_ms=w, state_bytes=state, activation_bytes=act,
                 output_bytes=out)
    return Model(name="uniform", layers=tuple(Layer(name=f"l{k}", **layer) for k in range(num_layers)))


def cluster(n: int = 64, gbps: float = 1.0, latency_us: float = 0.0) -> Cluster:
    link = Link(bandwidth_gb_per_s=gbps, latency_us=latency_us)
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=link, inter_node=link)


def run(name: str, p: int, m: int, v: int = 1, f: float = 1.0, i: float = 1.0, w: float = 1.0, **opts):
    model = uniform(p * v, f / v, i / v, w / v)
    return simulate(model, cluster(), build_plan(model, name, p, m, v), SimOptions(**opts))


def test_formats_worked_checks():
    assert run("1f1b", 4, 8).step_time_ms == 33.0
    assert run("gpipe", 4, 8).step_time_ms == 33.0
    assert run("1f1b", 4, 8).bubble_ratio == pytest.approx(3 / 11)
    assert run("interleaved-1f1b", 4, 8, v=2).step_time_ms == 28.5


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_gpipe_1f1b_closed_form(name, p, m):
    res = run(name, p, m)
    assert res.step_time_ms == 3 * (m + p - 1)
    assert res.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("m", [0, 1, 3, 4])  # m = p + offset; offsets 1, 3 make m % p != 0
def test_interleaved_closed_form(p, v, m):
    m += p
    res = run("interleaved-1f1b", p, m, v=v)
    # Megatron paper: bubble time / ideal time = (p-1)/(v m); as idle / total that is (p-1)/(v m + p - 1).
    assert res.step_time_ms == pytest.approx(3 * (m + (p - 1) / v))
    assert res.idle_ms[0] / res.busy_ms[0] == pytest.approx((p - 1) / (v * m))
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zb_h1_idle_is_a_third_of_1f1b(p, extra):
    # F = I = W = 1: 1F1B idles (p-1)(F+B) = 3(p-1) per device, ZB-H1 (p-1)(F+I-W) = p-1, for m >= p.
    m = p + extra
    zb, base = run("zb-h1", p, m), run("1f1b", p, m)
    assert zb.step_time_ms == 3 * m + (p - 1)
    assert sum(zb.idle_ms) == pytest.approx(sum(base.idle_ms) / 3)


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_v_schedules_reach_the_start_lag_bound(name, p, extra):
    # F = I = W = T per stage, two stages per device: each device has 6mT of work and the last
    # device cannot start before (p-1)T, so step >= 6mT + (p-1)T; ZB-V (m >= 2p-1) and DualPipeV's
    # order run action by action (m >= 2p, its overlapped pairs taken apart) meet that bound exactly:
    # bubble ratio (p-1)/(6m+p-1), i.e. near zero.
    m = 2 * p + extra
    t = 0.5
    model = uniform(2 * p, t, t, t)
    plan = build_plan(model, name, p, m, 2)
    res = simulate(model, cluster(), replace(plan, pairs=()))
    assert res.step_time_ms == pytest.approx(6 * m * t + (p - 1) * t)
    assert res.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_dualpipev_with_its_pairs_has_dualpipes_bubble(p, extra):
    # Run as DualPipe runs it, each overlapped F&B pair starts once both its inputs are there and sends
    # both outputs at its end; without communication to hide a pair costs F + B, and the idle time per
    # device is DeepSeek's DualPipe formula (PP/2 - 1)(F&B + B - 3W), with PP/2 = p for the V and
    # F&B = F + B = 3T, B = 2T, W = T: 2(p-1)T, twice the start-lag bound's (p-1)T, whatever m.
    m = 2 * p + extra
    t = 0.5
    res = run("dualpipev", p, m, v=2, f=2 * t, i=2 * t, w=2 * t)
    assert res.step_time_ms == pytest.approx(6 * m * t + (p - 1) * (3 * t + 2 * t - 3 * t))


@pytest.mark.parametrize("p, m", [(2, 1), (3, 2), (4, 5), (6, 3)])
def test_zb_v_few_microbatches_is_slower_but_valid(p, m):
    res = run("zb-v", p, m, v=2)
    assert res.step_time_ms >= 3 * m + (p - 1) * 0.5


@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_1f1b_peak_activations(p, m):
    # Device r holds p - r micro-batches at its peak (fewer when m is smaller).
    assert run("1f1b", p, m).peak_activation_bytes == [min(p - r, m) for r in range(p)]
    assert run("gpipe", p, m).peak_activation_bytes == [m] * p


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (4, 2, 8), (4, 3, 8), (3, 2, 7), (4, 4, 6), (2, 3, 5)])
def test_interleaved_peak_activations(p, v, m):
    # Derivation: rank r runs w = 2(p-r-1) + (v-1)g warm-up forwards (g = Megatron's micro-batch
    # group size, p when p divides m), then one more forward before its first backward frees
    # anything: min(w + 1, v m) stage activations live at the peak (one unit per stage here).
    from octopipe_plugin.schedules.generators import megatron_group_size

    g = megatron_group_size(p, m)
    expect = [min(2 * (p - r - 1) + (v - 1) * g + 1, v * m) for r in range(p)]
    assert run("interleaved-1f1b", p, m, v=v).peak_activation_bytes == expect


def test_zb_h1_peak_matches_1f1b_device0():
    # ZB-H1 defers r W's on rank r: every rank peaks at p, the 1F1B peak of rank 0.
    assert run("zb-h1", 4, 8).peak_activation_bytes == [4, 4, 4, 4]


def two_stage_gpipe() -> tuple[Model, Plan]:
    """Two layers (F=1, I=1, W=1), one per device, 2 micro-batches, GPipe order."""
    model = uniform(2, 1.0, 1.0, 1.0, out=2_000_000)  # 2 ms over a 1 GB/s link
    plan = Plan(model="uniform", num_devices=2, num_microbatches=2,
                stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1)),
                schedule=parse_schedule([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]))
    return model, plan


def test_switch_reference_hand_computed():
    # 0F0 [0,1] -> arrives 3; 0F1 [1,2] -> 4; 1F0 [3,4]; 1F1 [4,5]; 1B0 [5,7] -> 9; 1B1 [7,9] -> 11;
    # 0B0 [9,11]; 0B1 [11,13].
    model, plan = two_stage_gpipe()
    res = simulate(model, cluster(2), plan)
    assert res.step_time_ms == 13.0
    assert [t[1] for t in res.timeline[1]] == [3.0, 4.0, 5.0, 7.0]


def test_switch_contention_hand_computed():
    # act1 waits for act0 on link 0->1: [3,5]; 1F1 [5,6]; 1B0 [6,8] -> grad [8,10]; 1B1 [8,10];
    # grad1 waits for grad0 on link 1->0: [10,12]; 0B0 [10,12]; 0B1 [12,14].
    model, plan = two_stage_gpipe()
    res = simulate(model, cluster(2), plan, SimOptions(contention=True))
    assert res.step_time_ms == 14.0
    assert [(t.start, t.end) for t in res.transfers if t.src == 1] == [(8.0, 10.0), (10.0, 12.0)]


def test_switch_no_overlap_hand_computed():
    # Sender busy while sending, receiver busy for the transfer time before the consumer:
    # 0F0 [0,1] send [1,3]; 0F1 [3,4] send [4,6]; 1F0 max(0+2, 3) = [3,4]; 1F1 max(4+2, 6) = [6,7];
    # 1B0 [7,9] send [9,11]; 1B1 [11,13] send [13,15]; 0B0 max(6+2, 11) = [11,13]; 0B1 max(13+2, 15) = [15,17].
    model, plan = two_stage_gpipe()
    res = simulate(model, cluster(2), plan, SimOptions(overlap=False))
    assert res.step_time_ms == 17.0
    assert [t[1] for t in res.timeline[0]] == [0.0, 3.0, 11.0, 15.0]
    assert [t[1] for t in res.timeline[1]] == [3.0, 6.0, 7.0, 11.0]


def test_switch_launch_cost_hand_computed():
    # Every message costs 2 + 0.5: 1F0 [3.5,4.5]; 1F1 [4.5,5.5]; 1B0 [5.5,7.5] -> 10; 1B1 [7.5,9.5] -> 12;
    # 0B0 [10,12]; 0B1 [12,14].
    model, plan = two_stage_gpipe()
    assert simulate(model, cluster(2), plan, SimOptions(launch_ms=0.5)).step_time_ms == 14.0


def test_launch_cost_skips_same_device_handoff():
    # two stages on one device: the hand-off is no message, so neither launch cost nor transfer applies
    model = uniform(2, 1.0, 1.0, 1.0, out=2_000_000)
    plan = Plan(model="uniform", num_devices=1, num_microbatches=2,
                stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=0)),
                schedule=parse_schedule([["0F0", "1F0", "1B0", "0B0", "0F1", "1F1", "1B1", "0B1"]]))
    res = simulate(model, cluster(1), plan, SimOptions(launch_ms=5, overlap=False, contention=True))
    assert res.step_time_ms == 12.0 and res.transfers == []


def test_memory_curve_and_peak_include_static_state():
    model = uniform(4, 1.0, 1.0, 1.0, act=10, state=1000)
    res = simulate(model, cluster(), build_plan(model, "1f1b", 2, 4, boundaries=[(0, 1), (1, 4)]))
    assert res.static_bytes == [1000, 3000]
    assert res.peak_activation_bytes == [20, 30]
    assert res.peak_memory_bytes == [1020, 3030]
    curve = res.memory_curve(1)
    assert max(b for _, b in curve) == 3030 and curve[-1][1] == 3000
    assert [t for t, _ in curve] == sorted(t for t, _ in curve)


def test_critical_path_spans_the_step():
    res = run("interleaved-1f1b", 4, 8, v=2)
    (_, first), (_, last) = res.critical_path[0], res.critical_path[-1]
    times = {a: (s, e) for row in res.timeline for a, s, e in row}
    assert times[first][0] == 0.0 and times[last][1] == res.step_time_ms
    # with free transfers, a critical chain has no gaps: each action starts when its predecessor ends
    for (_, a), (_, b) in zip(res.critical_path, res.critical_path[1:]):
        assert times[b][0] == pytest.approx(times[a][1])


def test_deadlock_names_devices_actions_and_draws_grid():
    model = uniform(2, 1.0, 1.0, 1.0)
    plan = Plan(model="uniform", num_devices=2, num_microbatches=2,
                stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1)),
                schedule=parse_schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]))
    # device 1 insists on micro-batch 1 first; device 0 waits for 0B0's gradient before sending 0F1.
    with pytest.raises(DeadlockError) as err:
        simulate(model, cluster(2), plan)
    text = str(err.value)
    assert set(err.value.stuck) == {0, 1}
    assert "device 0 stuck at 0B0" in text and "device 1 stuck at 1F1" in text
    assert "[0B0]" in text and "[1F1]" in text and "dev1" in text
