"""The messages a plan's split layers imply (docs/formats.md, "Split layers"), in the per-pair order rule.

Read from the shard rows of the kind table (`takes`, `peer`, `gives`): the head's input from
the owner's F to every shard, the statistics from every H to every other shard's J, the
partials from every J to the owner's backward; the embedding's partials from every E to stage
0's F and its output gradient from stage 0's backward to every G. `pair_messages` merges them
with the stage-to-stage messages of messages.py, every pair's list in the sender's list order
(what lets order-matching backends such as NCCL pair them).
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


WHATS = ("head-input", "stats", "head-partial", "embedding-partial", "embedding-grad")
# the side of the split layer (formats.splits.side_of) each kind of message belongs to
SIDE_OF = {"head-input": "output", "stats": "output", "head-partial": "output", "embedding-partial": "input",
           "embedding-grad": "input"}
SPLIT_TAG_BASE = 1 << 24  # above (mb * num_stages + stage) * 2 + 1, the stage messages' tags, for any real plan


def split_messages(plan, *, same_device: bool = False) -> list[tuple[int, SplitMessage]]:
    """(position of the producer in its device's list, message) of every cross-device split message.

    `same_device`: also the hand-overs whose two ends share a device (src == dst: the executor passes them in
    memory), all but the statistics (a shard keeps its own)."""
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
                    elif rule.takes == "peers":
                        for e in sp.devices:
                            if e != d:
                                prod = Action(o, rule.peer, m)
                                out.append((shard_pos.get((e, prod), -1), SplitMessage("stats", m, e, d, prod, me)))
                    if rule.gives == "owner" and (d != own or same_device):
                        flow = Flow.GRAD if side == "output" else Flow.ACT
                        cons = consumer_action(index, flow, o, m) if side == "output" else Action(o, Kind.F, m)
                        if cons not in index:
                            continue  # an evaluation plan: the owner runs no backward to take the partial
                        what = "head-partial" if side == "output" else "embedding-partial"
                        out.append((shard_pos.get((d, me), -1), SplitMessage(what, m, d, own, me, cons)))
    return out


def pair_messages(plan) -> dict[tuple[int, int], list]:
    """Every cross-device message, stage-to-stage and split, by (src, dst) in the sender's list order."""
    index = action_index(plan)
    by_pair: dict[tuple[int, int], list] = {}
    for pair, msgs in plan_messages(plan).items():
        by_pair.setdefault(pair, []).extend((index[m.producer][1], m) for m in msgs)
    for pos, msg in split_messages(plan):
        by_pair.setdefault((msg.src, msg.dst), []).append((pos, msg))
    return {pair: [m for _, m in sorted(msgs, key=lambda t: t[0])] for pair, msgs in by_pair.items()}
