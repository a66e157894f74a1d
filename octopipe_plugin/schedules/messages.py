"""The one rule for the messages a plan implies and their order between every pair of devices.

The executor posts both ends of every message in this order, so backends that ignore
tags, like NCCL, still match every message correctly. The simulator does not call this
module (its hot loop would pay for the lookups), but its link contention serialises
transfers in the same order, a device sending in the order its own list produces;
tests/simulator/test_sim_message_order.py holds the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import Action, Flow, receivers


# A message carries one boundary flow: ACT (stage s output to stage s+1's F) or GRAD (stage s+1's
# input-gradient to stage s's B or I). The name stays for the executor and the tests that read it.
MsgKind = Flow


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


def consumer_action(schedule_index: dict, flow: Flow, stage: int, mb: int) -> Action:
    """The action of `stage` that consumes `flow` for `mb`: the first kind receiving it that the plan runs."""
    kinds = receivers(flow)
    for kind in kinds:
        a = Action(stage, kind, mb)
        if a in schedule_index:
            return a
    return Action(stage, kinds[-1], mb)


def action_index(plan) -> dict[Action, tuple[int, int]]:
    """Map every action of a plan to (device, position in that device's list)."""
    return {a: (d, i) for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}


def device_positions(plan) -> dict[tuple[int, Action], int]:
    """Map (device, action) to its position in that device's list (a split layer's shard action runs on several)."""
    return {(d, a): i for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}


def plan_messages(plan) -> dict[tuple[int, int], list[Message]]:
    """Every cross-device message of a plan, grouped by (src, dst), in the sender's production order.

    Same-device hand-offs (consecutive stages on one device) are not messages.
    """
    index = action_index(plan)
    by_pair: dict[tuple[int, int], list[tuple[int, Message]]] = {}
    for d, row in enumerate(plan.schedule):
        for pos, a in enumerate(row):
            msg = _message_of(plan, index, a, plan.num_stages)
            if msg is not None:
                by_pair.setdefault((msg.src, msg.dst), []).append((pos, msg))
    return {pair: [m for _, m in sorted(msgs, key=lambda t: t[0])] for pair, msgs in by_pair.items()}


def _message_of(plan, index, a: Action, num_stages: int) -> Message | None:
    dst_stage = a.output_stage(num_stages)
    if dst_stage is None:
        return None
    src, dst = plan.stages[a.stage].device, plan.stages[dst_stage].device
    if src == dst:
        return None
    flow = a.rule.sends
    consumer = consumer_action(index, flow, dst_stage, a.microbatch)
    return Message(flow, a.microbatch, a.stage, dst_stage, src, dst, a, consumer)


def messages_by_action(plan, messages=None) -> tuple[dict[Action, Message], dict[Action, Message]]:
    """(message each action sends, message each action receives) for one plan (`messages`: its
    `plan_messages`, when the caller has them already)."""
    sends: dict[Action, Message] = {}
    recvs: dict[Action, Message] = {}
    for msgs in (plan_messages(plan) if messages is None else messages).values():
        for msg in msgs:
            if not isinstance(msg, Message):
                continue  # a split layer's message (split_messages.py): shard actions repeat over devices
            sends[msg.producer] = msg
            recvs[msg.consumer] = msg
    return sends, recvs
