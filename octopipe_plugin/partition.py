"""Stage boundaries: Megatron's even split of the decoder layers, and an exact min-max balanced split.

Both return half-open layer ranges `[(start, end), ...]`, one per stage in model order;
a range may be empty when there are more stages than layers to give them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from .errors import PlanError

# Megatron keeps these with the first / last pipeline stage and splits only the rest.
FIRST_STAGE_KINDS = frozenset({"embedding", "vision", "projector"})
LAST_STAGE_KINDS = frozenset({"mtp", "lm_head"})


def megatron_split(model, num_stages: int, first_stage_layers: int | None = None,
                   last_stage_layers: int | None = None) -> list[tuple[int, int]]:
    """Megatron's default split: pinned head/tail kinds, decoder layers spread evenly over the stages.

    The leading run of {embedding, vision, projector} layers joins stage 0 and the trailing
    run of {mtp, lm_head} layers joins the last stage; every other layer is a decoder layer.
    `first_stage_layers` / `last_stage_layers` fix the decoder-layer count of stage 0 / the
    last stage (Megatron's num_layers_in_first/last_pipeline_stage) and the rest is spread over
    the other stages. Megatron asserts the spread is exact; where it is not, the leftover
    layers go one each to the interior stages first (they carry neither embedding nor head),
    then to stage 0, then to the last stage.
    """
    if num_stages < 1:
        raise PlanError(f"megatron_split: num_stages must be >= 1, got {num_stages}")
    kinds = [layer.kind for layer in model.layers]
    head = _run_length(kinds, FIRST_STAGE_KINDS)
    tail = _run_length(kinds[head:][::-1], LAST_STAGE_KINDS)
    decoder = len(kinds) - head - tail
    counts = _decoder_counts(decoder, num_stages, first_stage_layers, last_stage_layers)
    bounds, pos = [], head
    for s, c in enumerate(counts):
        start = 0 if s == 0 else pos
        pos += c
        end = len(kinds) if s == num_stages - 1 else pos
        bounds.append((start, end))
    return bounds


def _run_length(kinds: Sequence[str], allowed: frozenset) -> int:
    n = 0
    while n < len(kinds) and kinds[n] in allowed:
        n += 1
    return n


def _decoder_counts(decoder: int, num_stages: int, first: int | None, last: int | None) -> list[int]:
    """Decoder layers per stage, with the fixed first/last counts honoured."""
    fixed = {}
    if first is not None:
        fixed[0] = first
    if last is not None:
        if num_stages == 1 and first is not None and first != last:
            raise PlanError(f"megatron_split: one stage cannot hold both {first} and {last} decoder layers")
        fixed[num_stages - 1] = last
    for s, c in fixed.items():
        if c < 0:
            raise PlanError(f"megatron_split: stage {s} layer count must be >= 0, got {c}")
    free = [s for s in range(num_stages) if s not in fixed]
    left = decoder - sum(fixed.values())
    if left < 0 or (not free and left != 0):
        raise PlanError(
            f"megatron_split: first/last stage layer counts {first}/{last} do not fit the model's "
            f"{decoder} decoder layers over {num_stages} stages")
    counts = [fixed.get(s, 0) for s in range(num_stages)]
    if free:
        base, extra = divmod(left, len(free))
        interior = [s for s in free if 0 < s < num_stages - 1]
        order = interior + [s for s in free if s not in interior]  # stage 0 before the last stage
        for s in free:
            counts[s] = base
        for s in order[:extra]:
            counts[s] += 1
    return counts


def balanced_split(model, num_stages: int, weights: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous split minimising the largest stage cost (F+I+W per layer, or `weights`); exact.

    Dynamic programme over (stages used, layers covered); the best value of each cell is found
    by bisection because the left part's optimum grows and the right part's cost shrinks with
    the cut. When one heavy layer fixes that maximum, many splits tie; among them the one with
    the smallest sum of squared stage costs is returned, so the other stages share the rest of
    the work instead of being left empty. Deterministic: ties go to the later cut.
    """
    if num_stages < 1:
        raise PlanError(f"balanced_split: num_stages must be >= 1, got {num_stages}")
    cost = list(weights) if weights is not None else [layer.total_ms for layer in model.layers]
    if len(cost) != len(model.layers):
        raise PlanError(f"balanced_split: {len(cost)} weights for {len(model.layers)} layers")
    if any(c < 0 for c in cost):
        raise PlanError("balanced_split: weights must be >= 0")
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    best = [prefix[j] for j in range(n + 1)]  # one stage covering layers [0, j)
    for _ in range(1, num_stages):
        best = [_best_value(best, prefix, j) for j in range(n + 1)]
    return _spread_under_cap(prefix, num_stages, best[n])


def _spread_under_cap(prefix: list[float], num_stages: int, cap: float) -> list[tuple[int, int]]:
    """Among splits whose every stage costs at most `cap`, the one with the least sum of squares."""
    n = len(prefix) - 1
    limit = cap + 1e-9 * max(1.0, cap)
    inf = float("inf")
    score = [0.0] + [inf] * n  # one stage covering [0, j)
    for j in range(1, n + 1):
        if prefix[j] <= limit:
            score[j] = prefix[j] ** 2
    cuts: list[list[int]] = [[0] * (n + 1)]
    for _ in range(1, num_stages):
        nxt, cut = [inf] * (n + 1), [0] * (n + 1)
        for j in range(n + 1):
            for i in range(j, -1, -1):
                last = prefix[j] - prefix[i]
                if last > limit:
                    break
                val = score[i] + last * last
                if val < nxt[j] - 1e-12 * max(1.0, val):
                    nxt[j], cut[j] = val, i
        score = nxt
        cuts.append(cut)
    bounds, end = [], n
    for k in range(num_stages - 1, -1, -1):
        start = cuts[k][end] if k > 0 else 0
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def _best_value(best: list[float], prefix: list[float], j: int) -> float:
    """min over i <= j of max(best[i], prefix[j] - prefix[i])."""
    # best[i] is non-decreasing in i, the last stage's cost non-increasing: find the crossing.
    lo = bisect_left(range(j + 1), True, key=lambda i: best[i] >= prefix[j] - prefix[i])
    return min(max(best[i], prefix[j] - prefix[i]) for i in (lo - 1, lo) if 0 <= i <= j)
