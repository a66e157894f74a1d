"""Neighbourhood moves on (layout, spec): each attacks one cause of a slow step.

A spec is a list-scheduling Policy or an explicit per-device order (a built-in schedule's,
or a list-scheduled one being polished); moves that do not apply to a spec return None.

A move takes a seeded `random.Random`, the problem's `Context` and a candidate, and returns
a new candidate or None when it does not apply. Moves never check memory or time: the
evaluator (list scheduler + simulator) judges what they produce.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layout import Layout
from .listsched import Order, Policy, Split, WFill


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """What moves need to know of the problem: sizes and each layer's F+I+W time."""

    num_devices: int
    num_microbatches: int
    prefix: tuple[float, ...]  # prefix[i] = F+I+W time of layers [0, i)

    @staticmethod
    def of(model, num_devices: int, num_microbatches: int) -> "Context":
        """Context of a model on a cluster size."""
        acc = [0.0]
        for layer in model.layers:
            acc.append(acc[-1] + layer.total_ms)
        return Context(num_devices=num_devices, num_microbatches=num_microbatches, prefix=tuple(acc))

    def loads(self, layout: Layout) -> list[float]:
        """Per-device F+I+W time of one micro-batch."""
        out = [0.0] * self.num_devices
        pre = self.prefix
        for (a, b), d in zip(layout.bounds, layout.devices):
            out[d] += pre[b] - pre[a]
        return out


def rebalance(model, layout: Layout, num_devices: int) -> Layout:
    """Move layers from the busiest device toward lighter ones while that lowers its load (deterministic).

    A transfer shifts every boundary between a stage of the busiest device and a stage of
    another device by one layer, so the stages in between keep their size and the load moves
    across devices that are not neighbours in the pipeline (V and looped placements).
    """
    ctx = Context.of(model, num_devices, 1)
    cur = layout
    key = _balance_key(ctx.loads(cur))
    for _ in range(4 * model.num_layers):
        loads = ctx.loads(cur)
        hot = max(range(num_devices), key=lambda d: loads[d])
        best = None
        for a in (s for s, d in enumerate(cur.devices) if d == hot):
            for b in range(cur.num_stages):
                cand = transfer(cur, a, b)
                if cand is not None:
                    k = _balance_key(ctx.loads(cand))
                    if k < key and (best is None or k < best[0]):
                        best = (k, cand)
        if best is None:
            return cur
        key, cur = best
    return cur


def transfer(layout: Layout, a: int, b: int) -> Layout | None:
    """Shift every boundary between stages a and b by one so stage a loses a layer and stage b gains one."""
    if a == b or layout.devices[a] == layout.devices[b]:
        return None
    lo, hi = layout.bounds[a]
    if hi - lo < 2:
        return None
    cuts = list(layout.cuts())
    if a < b:
        for k in range(a, b):
            cuts[k] -= 1
    else:
        for k in range(b, a):
            cuts[k] += 1
    return Layout.from_cuts(cuts, layout.bounds[-1][1], layout.devices)


def _balance_key(loads: list[float]) -> tuple[float, float]:
    return (round(max(loads), 9), round(sum(x * x for x in loads), 6))


def _shift(layout: Layout, stage: int, side: int, count: int) -> Layout | None:
    """Give `count` layers of `stage` to its neighbour on `side` (-1 before, +1 after); keep stages non-empty."""
    cuts = list(layout.cuts())
    n = layout.bounds[-1][1]
    a, b = layout.bounds[stage]
    if b - a <= count:
        return None
    if side < 0 and stage > 0:
        cuts[stage - 1] = a + count
    elif side > 0 and stage + 1 < layout.num_stages:
        cuts[stage] = b - count
    else:
        return None
    return Layout.from_cuts(cuts, n, layout.devices)


def shift_off_bottleneck(rng, ctx: Context, layout: Layout, policy: Policy):
    """Move a layer from a stage of the busiest device to a neighbouring stage on another device."""
    loads = ctx.loads(layout)
    top = max(loads)
    hot = [d for d, x in enumerate(loads) if x >= top - 1e-9]
    d = rng.choice(hot)
    stages = [s for s, dev in enumerate(layout.devices) if dev == d]
    s = rng.choice(stages)
    side = rng.choice((-1, 1))
    new = _shift(layout, s, side, 1)
    return None if new is None else (new, policy)


def shift_random(rng, ctx: Context, layout: Layout, policy: Policy):
    """Move one boundary by one or two layers in either direction."""
    s = rng.randrange(layout.num_stages)
    new = _shift(layout, s, rng.choice((-1, 1)), rng.choice((1, 1, 2)))
    return None if new is None else (new, policy)


def transfer_off_bottleneck(rng, ctx: Context, layout: Layout, policy):
    """Move one layer's worth of work from a stage of the busiest device to a stage of a lighter device."""
    loads = ctx.loads(layout)
    hot = max(range(len(loads)), key=lambda d: (loads[d], -d))
    a = rng.choice([s for s, d in enumerate(layout.devices) if d == hot])
    light = sorted(range(len(loads)), key=lambda d: loads[d])[:max(1, len(loads) // 2)]
    b = rng.choice([s for s, d in enumerate(layout.devices) if d in light])
    new = transfer(layout, a, b)
    return None if new is None else (new, policy)


def remap_stage(rng, ctx: Context, layout: Layout, policy: Policy):
    """Run one stage of the busiest device on the least loaded device instead."""
    loads = ctx.loads(layout)
    hot = max(range(len(loads)), key=lambda d: (loads[d], -d))
    cold = min(range(len(loads)), key=lambda d: (loads[d], d))
    stages = [s for s, dev in enumerate(layout.devices) if dev == hot]
    if hot == cold or len(stages) < 2:
        return None
    if not isinstance(policy, Policy):
        return None  # an explicit order belongs to its placement
    s = rng.choice(stages)
    devices = list(layout.devices)
    devices[s] = cold
    return replace(layout, devices=tuple(devices)), policy


def swap_devices(rng, ctx: Context, layout: Layout, policy: Policy):
    """Exchange two devices' stages (changes which boundaries cross slow links)."""
    if ctx.num_devices < 3:
        return None
    a, b = rng.sample(range(ctx.num_devices), 2)
    swap = {a: b, b: a}
    devices = tuple(swap.get(d, d) for d in layout.devices)
    if not isinstance(policy, Policy):  # an explicit order: the two devices trade their lists
        rows = list(policy)
        rows[a], rows[b] = rows[b], rows[a]
        return replace(layout, devices=devices), tuple(rows)
    depth, split, wl = list(policy.depth), list(policy.split), list(policy.w_limit)
    for arr in (depth, split, wl):
        arr[a], arr[b] = arr[b], arr[a]
    return replace(layout, devices=devices), replace(policy, depth=tuple(depth), split=tuple(split),
                                                     w_limit=tuple(wl))


def change_depth(rng, ctx: Context, layout: Layout, policy):
    """Raise or lower one device's warm-up depth (or every device's, uniformly)."""
    if not isinstance(policy, Policy):
        return None
    depth = list(policy.depth)
    m = ctx.num_microbatches
    targets = range(len(depth)) if rng.random() < 0.25 else [rng.randrange(len(depth))]
    step = rng.choice((-2, -1, 1, 2))
    for d in targets:
        base = min(depth[d], m)
        depth[d] = max(1, min(m, base + step))
    new = tuple(depth)
    return None if new == policy.depth else (layout, replace(policy, depth=new))


def change_split(rng, ctx: Context, layout: Layout, policy):
    """Fuse or split one device's backwards."""
    if not isinstance(policy, Policy):
        return None
    split = list(policy.split)
    d = rng.randrange(len(split))
    split[d] = rng.choice([s for s in Split if s is not split[d]])
    return layout, replace(policy, split=tuple(split))


def change_w_limit(rng, ctx: Context, layout: Layout, policy):
    """Bound how many deferred W one device may hold (forces W earlier, frees memory sooner)."""
    if not isinstance(policy, Policy):
        return None
    wl = list(policy.w_limit)
    d = rng.randrange(len(wl))
    big = ctx.num_microbatches * max(1, layout.num_stages // ctx.num_devices)
    wl[d] = rng.choice((0, 1, 2, 4, ctx.num_devices, big))
    new = tuple(wl)
    return None if new == policy.w_limit else (layout, replace(policy, w_limit=new))


def change_flags(rng, ctx: Context, layout: Layout, policy):
    """Flip when W fills gaps or which ready chunk goes first."""
    if not isinstance(policy, Policy):
        return None
    which = rng.randrange(3)
    if which == 0:
        return layout, replace(policy, w_fill=WFill.FIT if policy.w_fill is WFill.ALWAYS else WFill.ALWAYS)
    if which == 1:
        return layout, replace(policy, f_order=Order.SHALLOW if policy.f_order is Order.DEEP else Order.DEEP)
    return layout, replace(policy, b_order=Order.SHALLOW if policy.b_order is Order.DEEP else Order.DEEP)


def reorder(rng, ctx: Context, layout: Layout, schedule):
    """Pull one action of an explicit order one to three places earlier (the simulator rejects deadlocks)."""
    if isinstance(schedule, Policy):
        return None
    d = rng.randrange(len(schedule))
    if len(schedule[d]) < 2:
        return None
    i = rng.randrange(1, len(schedule[d]))
    row = list(schedule[d])
    row.insert(max(0, i - rng.choice((1, 1, 2, 3))), row.pop(i))
    return layout, tuple(tuple(row) if e == d else r for e, r in enumerate(schedule))


# (move, weight): partition moves dominate because imbalance is the largest cause of idle time.
MOVES = (
    (shift_off_bottleneck, 4),
    (transfer_off_bottleneck, 4),
    (shift_random, 2),
    (remap_stage, 1),
    (swap_devices, 1),
    (change_depth, 3),
    (change_split, 2),
    (change_w_limit, 2),
    (change_flags, 1),
    (reorder, 3),
)


def pick_move(rng):
    """A move drawn by weight."""
    total = sum(w for _, w in MOVES)
    x = rng.random() * total
    for move, w in MOVES:
        x -= w
        if x < 0:
            return move
    return MOVES[-1][0]
