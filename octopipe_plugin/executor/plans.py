"""Placements and random valid plans (for tests, the benchmark and dry runs of irregular schedules).

A random plan is built by sampling a topological order of the plan's dependency graph
(F(s) after F(s-1); the backward of s after F(s) and the backward of s+1; W after I) and
giving each device the sub-sequence of its own actions: the sampled order is itself an
execution, so every plan made this way is valid and deadlock-free by construction.
"""

from __future__ import annotations

import random
from typing import Sequence

from ..formats import Plan, Stage
from ..schedules.actions import Action, Kind
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


def _phase(a: Action) -> str:
    return "f" if a.kind is Kind.F else "b" if a.kind in (Kind.B, Kind.I) else "w"


def sample_schedule(stage_devices: Sequence[int], num_devices: int, num_microbatches: int,
                    rng: random.Random, split_prob: float = 0.5,
                    in_order: bool = False) -> tuple[tuple[Action, ...], ...]:
    """Per-device lists from a random topological order; each backward is B or I+W at random.

    `in_order` also keeps every stage's forwards, backwards and weight passes in micro-batch
    order (what runtimes that store per-stage results positionally need).
    """
    ns, m = len(stage_devices), num_microbatches
    split = {(s, mb): rng.random() < split_prob for s in range(ns) for mb in range(m)}
    done: set[tuple[int, int, str]] = set()
    ready = [Action(0, Kind.F, mb) for mb in range(m)]
    rows: list[list[Action]] = [[] for _ in range(num_devices)]
    prev = _previous_in_order(ns, m, split)
    while ready:
        eligible = [i for i, a in enumerate(ready)
                    if not in_order or (q := prev[(a.stage, a.microbatch, _phase(a))]) is None or q in done]
        a = ready.pop(eligible[rng.randrange(len(eligible))])
        rows[stage_devices[a.stage]].append(a)
        done.add((a.stage, a.microbatch, _phase(a)))
        ready.extend(_newly_ready(a, ns, split, done))
    return tuple(tuple(r) for r in rows)


def _previous_in_order(ns: int, m: int, split: dict) -> dict:
    """(stage, mb, phase) -> the same stage's previous micro-batch in that phase (W only where split), or None."""
    prev = {}
    for s in range(ns):
        last_w = None
        for mb in range(m):
            prev[(s, mb, "f")] = (s, mb - 1, "f") if mb else None
            prev[(s, mb, "b")] = (s, mb - 1, "b") if mb else None
            prev[(s, mb, "w")] = last_w
            if split[(s, mb)]:
                last_w = (s, mb, "w")
    return prev


def _newly_ready(a: Action, ns: int, split: dict, done: set) -> list[Action]:
    s, mb = a.stage, a.microbatch

    def backward(stage: int) -> Action:
        return Action(stage, Kind.I if split[(stage, mb)] else Kind.B, mb)

    out = []
    if a.kind is Kind.F:
        if s + 1 < ns:
            out.append(Action(s + 1, Kind.F, mb))
        if s == ns - 1 or (s + 1, mb, "b") in done:
            out.append(backward(s))
    elif a.kind in (Kind.B, Kind.I):
        if a.kind is Kind.I:
            out.append(Action(s, Kind.W, mb))
        if s > 0 and (s - 1, mb, "f") in done:
            out.append(backward(s - 1))
    return out


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
