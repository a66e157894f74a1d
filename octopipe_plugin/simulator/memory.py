"""Activation memory accounting: what each action does to its device's live activation bytes.

The one rule, read from the kind table (`actions.RULES`, column `activation`): F makes the
stage's activation of its micro-batch live, I keeps it (W still reads it), B and W free it.
The simulator's peaks and memory curves, the tuner's memory cap and its memory floors all
count with these helpers.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..actions import RULES, Kind


def activation_changes(activation: tuple[int, ...]) -> dict[Kind, tuple[int, ...]]:
    """Per kind, the signed change of live bytes when it runs on each stage (precomputed for hot loops)."""
    # a split layer's shard kinds change their share of that layer's activation, not the stage's
    # (simulator/split.py counts them): nothing here, so sums over kinds stay the stage kinds' own
    return {kind: tuple(rule.activation * a if rule.side is None else 0 for a in activation)
            for kind, rule in RULES.items()}


def peak_live(changes: Iterable[int]) -> int:
    """Peak of the running sum of changes, from zero: one device's order already sorts its events in time."""
    cur = peak = 0
    for c in changes:
        cur += c
        if cur > peak:
            peak = cur
    return peak


def memory_curve(timeline, activation: tuple[int, ...], static: int, live=None) -> list[tuple[float, int]]:
    """(time, bytes) steps of one device's memory from its (action, start, end) timeline.

    Memory is taken when an action starts and given back when it ends, so a curve never
    dips below what is really held. `live`, when given, is each timeline entry's change
    (a split plan's, whose shard actions change their share of the split layer).
    """
    changes = activation_changes(activation)
    cur = static
    pts = [(0.0, cur)]
    for i, (a, start, end) in enumerate(timeline):
        c = changes[a.kind][a.stage] if live is None else live[i]
        if c:
            cur += c
            pts.append((start if c > 0 else end, cur))
    return pts


def per_microbatch(activation: tuple[int, ...]) -> tuple[int, ...]:
    """Per stage, the bytes one micro-batch makes live there (what its F takes, until B or W frees it)."""
    changes = activation_changes(activation).values()
    return tuple(sum(c[s] for c in changes if c[s] > 0) for s in range(len(activation)))


def least_live(devices, activation: tuple[int, ...], num_devices: int) -> list[int]:
    """Per device, the live activation no order can avoid: one micro-batch of each of its stages.

    A micro-batch's last F runs before any of its backwards frees an activation, so at that
    moment every stage holds it at once.
    """
    need = [0] * num_devices
    for s, b in enumerate(per_microbatch(activation)):
        need[devices[s]] += b
    return need


def choice_events(row, times, mc, outs, ins) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """One device's (time, change) events of its live activation and of its host memory under memory choices.

    `row` its actions, `times` their (start, end), `mc` the plan's simulator.costs.MemoryCosts, `outs` / `ins` per
    position the (start, end) of the host copy after it (an F's copy-out, an I's for `offload_w`) / before it (a B's
    or I's copy-in, a W's) or None. F makes `kept` live at its start; an offloaded stage's bytes leave when its
    copy-out ends and come back when its copy-in starts (the host holds them from copy-out start to copy-in end);
    B brings back `remat_b` at its start and frees everything at its end; I brings back `remat_i` (kept), its
    `offload_w` bytes leave after it the same way and come back before W; W frees everything at its end.
    """
    dev, host = [], []
    for a, (start, end), co, ci in zip(row, times, outs, ins):
        s = a.stage
        back = mc.offload_w[s] if a.kind is Kind.W else mc.offload[s]
        if ci is not None:
            dev.append((ci[0], back))
            host.append((ci[1], -back))
        if co is not None:
            away = mc.offload[s] if a.kind is Kind.F else mc.offload_w[s]
            dev.append((co[1], -away))
            host.append((co[0], away))
        if a.kind is Kind.F:
            dev.append((start, mc.kept[s]))
        elif a.kind is Kind.B:
            dev.append((start, mc.remat_b[s]))
            dev.append((end, -(mc.kept[s] + mc.remat_b[s])))
        elif a.kind is Kind.I:
            dev.append((start, mc.remat_i[s]))
        elif a.kind is Kind.W:
            dev.append((end, -(mc.kept[a.stage] + mc.remat_i[a.stage])))
    return dev, host


def recompute_steps(kind: Kind, stage: int, mc) -> tuple[int, ...]:
    """The changes, in order, one stage action makes to its device's live bytes under recompute choices (no
    offload; `mc` a simulator.costs.MemoryCosts): F `kept`; B `remat_b` while it runs, then all of it freed; I
    `remat_i`; W frees `kept` and `remat_i` (choice_events' rule without times, for list-order peaks)."""
    if kind is Kind.F:
        return (mc.kept[stage],)
    if kind is Kind.B:
        return (mc.remat_b[stage], -(mc.kept[stage] + mc.remat_b[stage]))
    if kind is Kind.I:
        return (mc.remat_i[stage],)
    if kind is Kind.W:
        return (-(mc.kept[stage] + mc.remat_i[stage]),)
    return ()


def timed_peak(events) -> int:
    """Peak of the running sum of (time, change) events in time order; at one instant frees count first (an action
    ending as the next starts, as the list order has it)."""
    cur = peak = 0
    for _, c in sorted(events, key=lambda e: (e[0], e[1] > 0)):
        cur += c
        if cur > peak:
            peak = cur
    return peak
