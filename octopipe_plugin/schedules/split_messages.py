"""The messages a plan's split layers imply (docs/formats.md, "Split layers"), in the per-pair order rule.

Read from the shard rows of the kind table (`takes`, `peer`, `gives`): the head's input from
the owner's F to every shard, the partials from every J to the owner's backward; the embedding's
partials from every E to stage 0's F and its output gradient from stage 0's backward to every G.
`pair_messages` merges them with the stage-to-stage messages of messages.py, every pair's list in
the sender's list order (what lets order-matching backends such as NCCL pair them).

The head's softmax statistics are no point-to-point messages: one micro-batch's are one all-gather
over the shard devices (`stats_gathers`), started by every H and awaited by every J. n(n - 1)
messages per micro-batch cost a 16-rank shard 448 of its 576 messages a step (issue 36); one
collective costs each shard one post and one wait. A collective pairs by order on its group, so
every shard device must run the H of the micro-batches in one order (`gather_order_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..actions import RULES, Action, Flow, Kind, shard_kinds
from ..formats.splits import owner_stage, side_of
from .messages import action_index, consumer_action, plan_messages


@dataclass(frozen=True, slots=True)
class SplitMessage:
    """One transfer to or from a split layer's shard: `producer` on `src` makes it, `consumer` on `dst` needs it."""

    what: str  # "head-input", "stats", "head-partial", "embedding-partial", "embedding-grad"
    microbatch: int
    src: int
    dst: int
    producer: Action
    consumer: Action
    kind: ClassVar[None] = None  # not a stage-boundary flow (messages.Message.kind is ACT or GRAD)

    def tag(self, num_stages: int) -> int:
        """A tag unique within the step between two devices, apart from every stage message's tag."""
        return SPLIT_TAG_BASE + self.microbatch * len(WHATS) + WHATS.index(self.what)

    def __str__(self) -> str:
        return f"{self.what}[{self.producer}->{self.consumer}] dev{self.src}->dev{self.dst}"


# "stats" keeps its place (the tags of the others) though the statistics travel by collective (StatsGather)
WHATS = ("head-input", "stats", "head-partial", "embedding-partial", "embedding-grad")
# the side of the split layer (formats.splits.side_of) each kind of message belongs to
SIDE_OF = {"head-input": "output", "stats": "output", "head-partial": "output", "embedding-partial": "input",
           "embedding-grad": "input"}
SPLIT_TAG_BASE = 1 << 24  # above (mb * num_stages + stage) * 2 + 1, the stage messages' tags, for any real plan


def split_messages(plan, *, same_device: bool = False) -> list[tuple[int, SplitMessage]]:
    """(position of the producer in its device's list, message) of every cross-device split message.

    `same_device`: also the hand-overs whose two ends share a device (src == dst: the executor passes them in
    memory). The statistics are not here: they are `stats_gathers`."""
    if not plan.splits:
        return []
    index = action_index(plan)  # stage actions: one device each
    shard_pos = {(d, a): i for d, row in enumerate(plan.schedule) for i, a in enumerate(row)
                 if RULES[a.kind].side is not None}
    n = plan.stages[-1].end
    present = {a.kind for row in plan.schedule for a in row}  # an evaluation plan runs no K, G, B or I
    out = []
    for sp in plan.splits:
        side = side_of(sp, n)
        o = owner_stage(sp, plan.stages)
        own = plan.stages[o].device
        for m in range(plan.num_microbatches):
            for k in (k for k in shard_kinds(side) if k in present):
                rule = RULES[k]
                for d in sp.devices:
                    me = Action(o, k, m)
                    if rule.takes == "owner":  # the owner hands over: its F output (head) / its input gradient (embedding)
                        flow = Flow.ACT if side == "output" else Flow.GRAD
                        prod = Action(o, Kind.F, m) if side == "output" else consumer_action(index, flow, o, m)
                        what = "head-input" if side == "output" else "embedding-grad"
                        if (own != d or same_device) and prod in index:
                            out.append((index[prod][1], SplitMessage(what, m, own, d, prod, me)))
                    if rule.gives == "owner" and (d != own or same_device):
                        flow = Flow.GRAD if side == "output" else Flow.ACT
                        cons = consumer_action(index, flow, o, m) if side == "output" else Action(o, Kind.F, m)
                        if cons not in index:
                            continue  # an evaluation plan: the owner runs no backward to take the partial
                        what = "head-partial" if side == "output" else "embedding-partial"
                        out.append((shard_pos.get((d, me), -1), SplitMessage(what, m, d, own, me, cons)))
    return out


@dataclass(frozen=True, slots=True)
class StatsGather:
    """One micro-batch's softmax statistics: every shard's `producer` (H) output gathered, in `devices` order, by
    every shard's `consumer` (J), one all-gather over `devices` (sorted)."""

    microbatch: int
    devices: tuple[int, ...]
    producer: Action
    consumer: Action
    what: ClassVar[str] = "stats"
    kind: ClassVar[None] = None

    def __str__(self) -> str:
        return f"stats[{self.producer}->{self.consumer}] all-gather over dev{','.join(map(str, self.devices))}"


def _peers_side(plan):
    """(split record, owner stage, the kind that takes its peers' output, that peer kind) of the split layer whose
    shards exchange statistics, or None (no split head, or one over a single device: nothing to exchange)."""
    n = plan.stages[-1].end
    for sp in plan.splits:
        side = side_of(sp, n)
        for k in shard_kinds(side):
            if RULES[k].takes == "peers" and len(sp.devices) > 1:
                return sp, owner_stage(sp, plan.stages), k, RULES[k].peer
    return None


def stats_gathers(plan) -> list[StatsGather]:
    """Every micro-batch's statistics all-gather of the plan's split head (empty without one over several devices)."""
    got = _peers_side(plan) if plan.splits else None
    if got is None:
        return []
    sp, o, kind, peer = got
    devices = tuple(sorted(sp.devices))
    return [StatsGather(m, devices, Action(o, peer, m), Action(o, kind, m)) for m in range(plan.num_microbatches)]


def gather_order_problem(plan) -> str | None:
    """Why the shard devices would call the statistics' all-gathers in different orders (one line, with the fix),
    or None. A collective pairs by its position on the group: every member must start them in one order."""
    got = _peers_side(plan) if plan.splits else None
    if got is None:
        return None
    sp, _, _, peer = got
    orders = {d: [a.microbatch for a in plan.schedule[d] if a.kind is peer] for d in sorted(sp.devices)}
    first, want = next(iter(orders.items()))
    for d, order in orders.items():
        if order != want:
            i = next(i for i, (x, y) in enumerate(zip(order, want)) if x != y)
            return (f"schedule[{d}]: the split head's {peer.value} actions run micro-batch {order[i]} where "
                    f"schedule[{first}] runs {want[i]} (position {i} of their {peer.value}s); every shard device of "
                    f"splits (devices {list(sp.devices)}) must run its {peer.value}s in one micro-batch order, each "
                    f"starting the statistics' all-gather of its micro-batch (fix: order the {peer.value}s of every "
                    f"shard device's list alike, e.g. by micro-batch)")
    return None


def pair_messages(plan) -> dict[tuple[int, int], list]:
    """Every cross-device message, stage-to-stage and split, by (src, dst) in the sender's list order."""
    index = action_index(plan)
    by_pair: dict[tuple[int, int], list] = {}
    for pair, msgs in plan_messages(plan).items():
        by_pair.setdefault(pair, []).extend((index[m.producer][1], m) for m in msgs)
    for pos, msg in split_messages(plan):
        by_pair.setdefault((msg.src, msg.dst), []).append((pos, msg))
    return {pair: [m for _, m in sorted(msgs, key=lambda t: t[0])] for pair, msgs in by_pair.items()}
