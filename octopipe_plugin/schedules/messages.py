"""The one rule for the messages a plan implies and their order between every pair of devices.

The executor posts both ends of every message in this order, so backends that ignore
tags, like NCCL, still match every message correctly. The simulator does not call this
module (its hot loop would pay for the lookups), but its link contention serialises
transfers in the same order, a device sending in the order its own list produces;
tests/simulator/test_sim_message_order.py holds the two to each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .actions import Action, Kind


class MsgKind(str, enum.Enum):
    """ACT: stage s output to stage s+1's F; GRAD: stage s+1 input-gradient to stage s's B/I."""

    ACT = "act"
    GRAD = "grad"


@dataclass(frozen=True, slots=True)
class Message:
    """One transfer: `producer` on `src` makes it, `consumer` on `dst` needs it."""

    kind: MsgKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src: int
    dst: int
    producer: Action
    consumer: Action

    def tag(self, num_stages: int) -> int:
        """A tag unique within the step: (micro-batch, receiving stage, direction)."""
        return (self.microbatch * num_stages + self.dst_stage) * 2 + (self.kind is MsgKind.GRAD)

    def __str__(self) -> str:
        return f"{self.kind.value}[{self.producer}->{self.consumer}] dev{self.src}->dev{self.dst}"


def backward_action(schedule_index: dict, stage: int, mb: int) -> Action:
    """The action that makes stage `stage`'s input gradient for `mb`: its B or its I."""
    b = Action(stage, Kind.B, mb)
    return b if b in schedule_index else Action(stage, Kind.I, mb)


def action_index(plan) -> dict[Action, tuple[int, int]]:
    """Map every action of a plan to (device, position in that device's list)."""
    return {a: (d, i) for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}


def plan_messages(plan) -> dict[tuple[int, int], list[Message]]:
    """Every cross-device message of a plan, grouped by (src, dst), in the sender's production order.

    Same-device hand-offs (consecutive stages on one device) are not messages.
    """
    index = action_index(plan)
    last = plan.num_stages - 1
    by_pair: dict[tuple[int, int], list[tuple[int, Message]]] = {}
    for d, row in enumerate(plan.schedule):
        for pos, a in enumerate(row):
            msg = _message_of(plan, index, a, last)
            if msg is not None:
                by_pair.setdefault((msg.src, msg.dst), []).append((pos, msg))
    return {pair: [m for _, m in sorted(msgs, key=lambda t: t[0])] for pair, msgs in by_pair.items()}


def _message_of(plan, index, a: Action, last: int) -> Message | None:
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F and s < last:
        src, dst = plan.stages[s].device, plan.stages[s + 1].device
        if src != dst:
            return Message(MsgKind.ACT, mb, s, s + 1, src, dst, a, Action(s + 1, Kind.F, mb))
    elif a.kind in (Kind.B, Kind.I) and s > 0:
        src, dst = plan.stages[s].device, plan.stages[s - 1].device
        if src != dst:
            return Message(MsgKind.GRAD, mb, s, s - 1, src, dst, a, backward_action(index, s - 1, mb))
    return None


def messages_by_action(plan) -> tuple[dict[Action, Message], dict[Action, Message]]:
    """(message each action sends, message each action receives) for one plan."""
    sends: dict[Action, Message] = {}
    recvs: dict[Action, Message] = {}
    for msgs in plan_messages(plan).values():
        for msg in msgs:
            sends[msg.producer] = msg
            recvs[msg.consumer] = msg
    return sends, recvs
