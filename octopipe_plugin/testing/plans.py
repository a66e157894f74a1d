"""Placements and random valid plans (for tests, the benchmark and dry runs of irregular schedules).

A random plan is built by sampling a topological order of the plan's dependency graph
(the kind table of `actions.RULES`: F(s) after F(s-1); the backward of s after F(s) and the
backward of s+1; W after I) and
giving each device the sub-sequence of its own actions: the sampled order is itself an
execution, so every plan made this way is valid and deadlock-free by construction.
"""

from __future__ import annotations

import random
from typing import Sequence

from ..formats import Plan, Stage
from ..actions import RULES, Action, Kind, forms
from ..schedules.placement import Placement, place_stages


def placement(kind: str, num_stages: int, num_devices: int, rng: random.Random | None = None) -> list[int]:
    """Stage -> device: 'looped' (s mod p), 'v' (zig-zag: 0..p-1, p-1..0, ...) or 'arbitrary' (random, none idle)."""
    p = num_devices
    if kind in (Placement.LOOPED.value, Placement.V.value):
        return place_stages(kind, p, num_stages)
    if kind == "arbitrary":
        if num_stages < p:  # else the list below would be longer than the stage count
            raise ValueError(f"placement 'arbitrary' leaves no device idle: expected >= {p} stages, got {num_stages}")
        rng = rng or random.Random(0)
        devs = list(range(p)) + [rng.randrange(p) for _ in range(num_stages - p)]
        rng.shuffle(devs)
        return devs
    raise ValueError(f"placement {kind!r}: expected 'looped', 'v' or 'arbitrary'")


def random_bounds(num_layers: int, num_stages: int, rng: random.Random) -> list[tuple[int, int]]:
    """Non-uniform consecutive layer ranges, each with at least one layer."""
    cuts = sorted(rng.sample(range(1, num_layers), num_stages - 1))
    edges = [0] + cuts + [num_layers]
    return [(edges[i], edges[i + 1]) for i in range(num_stages)]


def _lane(kind: Kind) -> str:
    """Actions that make the same output share a lane (B and I both make the input gradient); W has its own."""
    rule = RULES[kind]
    return rule.sends.value if rule.sends is not None else kind.value


def sample_schedule(stage_devices: Sequence[int], num_devices: int, num_microbatches: int,
                    rng: random.Random, split_prob: float = 0.5,
                    in_order: bool = False) -> tuple[tuple[Action, ...], ...]:
    """Per-device lists from a random topological order; each backward is B or I+W at random.

    The dependencies are the kind table's (`after` and `receives`). `in_order` also keeps every
    stage's forwards, backwards and weight passes in micro-batch order (what runtimes that
    store per-stage results positionally need).
    """
    ns, m = len(stage_devices), num_microbatches
    phases = forms()
    forward, backward = phases["forward"]["forward"], phases["backward"]
    chosen = {}
    for s in range(ns):
        for mb in range(m):
            chosen[(s, mb)] = forward + (backward["split"] if rng.random() < split_prob else backward["fused"])
    deps = {Action(s, k, mb): _deps(Action(s, k, mb), chosen, ns) for (s, mb), kinds in chosen.items() for k in kinds}
    waiting_on = {a: len(d) for a, d in deps.items()}
    unblocks: dict[Action, list[Action]] = {}
    for a, d in deps.items():
        for q in d:
            unblocks.setdefault(q, []).append(a)
    for lst in unblocks.values():
        lst.sort(key=lambda a: -a.stage)  # the stage after first: F(s+1) before B(s), W(s) before B(s-1)
    prev = _previous_in_order(chosen, ns, m)
    ready = [a for a in deps if waiting_on[a] == 0]
    done: set[Action] = set()
    rows: list[list[Action]] = [[] for _ in range(num_devices)]
    while ready:
        eligible = [i for i, a in enumerate(ready) if not in_order or (q := prev[a]) is None or q in done]
        a = ready.pop(eligible[rng.randrange(len(eligible))])
        rows[stage_devices[a.stage]].append(a)
        done.add(a)
        for nxt in unblocks.get(a, ()):
            waiting_on[nxt] -= 1
            if waiting_on[nxt] == 0:
                ready.append(nxt)
    return tuple(tuple(r) for r in rows)


def _deps(a: Action, chosen: dict, ns: int) -> list[Action]:
    """What `a` waits for: its own `after` action and the neighbour's action that sends its input."""
    rule, out = a.rule, []
    if rule.after is not None:
        out.append(Action(a.stage, rule.after, a.microbatch))
    src = a.input_stage(ns)
    if src is not None:
        out += [Action(src, k, a.microbatch) for k in chosen[(src, a.microbatch)] if RULES[k].sends is rule.receives]
    return out


def _previous_in_order(chosen: dict, ns: int, m: int) -> dict:
    """Each action -> its stage's action of the same lane on the latest earlier micro-batch that has one, or None."""
    prev = {}
    for s in range(ns):
        last: dict[str, Action] = {}
        for mb in range(m):
            for k in chosen[(s, mb)]:
                a = Action(s, k, mb)
                prev[a] = last.get(_lane(k))
            for k in chosen[(s, mb)]:
                last[_lane(k)] = Action(s, k, mb)
    return prev


def make_plan(*, stage_devices: Sequence[int], bounds: Sequence[tuple[int, int]], num_devices: int,
              num_microbatches: int, schedule, model: str = "") -> Plan:
    """Assemble a Plan from its parts."""
    stages = tuple(Stage(start=b[0], end=b[1], device=d) for b, d in zip(bounds, stage_devices))
    return Plan(model=model, num_devices=num_devices, num_microbatches=num_microbatches, stages=stages,
                schedule=tuple(tuple(r) for r in schedule))


def random_plan(rng: random.Random, *, num_devices: int, num_layers: int, num_stages: int,
                num_microbatches: int, placement_kind: str) -> Plan:
    """A random valid irregular plan with non-uniform stages."""
    devs = placement(placement_kind, num_stages, num_devices, rng)
    return make_plan(stage_devices=devs, bounds=random_bounds(num_layers, num_stages, rng), num_devices=num_devices,
                     num_microbatches=num_microbatches,
                     schedule=sample_schedule(devs, num_devices, num_microbatches, rng))
