"""Lower one rank's share of a plan into a program: its actions with their receives and sends.

Messages and their per-peer order come from `schedules.messages` (the one rule shared with
the simulator): both ends of every (src, dst) pair walk the sender's production order, so
receives match sends even where tags are ignored (NCCL). Consecutive stages on the same
device exchange nothing: the tensor is handed over in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import Action, pair_starts
from ..schedules.messages import Message, messages_by_action, plan_messages
from ..schedules.split_messages import pair_messages
from .split_program import ShardIO, shard_io


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One action of the rank: the message it consumes and the one it produces (None when local)."""

    action: Action
    recv: Message | None
    send: Message | None
    # per peer: how many of that peer's messages (in per-peer order) must be posted before this step
    post_upto: tuple[tuple[int, int], ...]
    shard: ShardIO | None = None  # a split layer's hand-overs it takes and gives (split_program.py)

    @property
    def recvs(self) -> tuple:
        """Every message it waits for, in order: its stage input, then its split hand-overs."""
        own = () if self.recv is None else (self.recv,)
        return own + (self.shard.recvs if self.shard is not None else ())

    @property
    def sends(self) -> tuple:
        """Every message it sends, in order: its stage output, then its split hand-overs."""
        own = () if self.send is None else (self.send,)
        return own + (self.shard.sends if self.shard is not None else ())


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProgram:
    """Everything rank `rank` does in one step, in order."""

    rank: int
    num_stages: int
    steps: tuple[Step, ...]
    recv_order: dict[int, tuple[Message, ...]]  # peer -> messages from it, in per-peer order
    send_order: dict[int, tuple[Message, ...]]  # peer -> messages to it, in per-peer order
    # indices of `steps` where an overlapped pair starts (docs/formats.md, "Overlapped pairs"): step i and i + 1
    # run as one unit, which waits for both halves' inputs and then hands on the first's output, then the second's
    pair_starts: frozenset[int] = frozenset()

    def pair_at(self, index: int) -> bool:
        """Whether step `index` is the first half of an overlapped pair (step index + 1 its second)."""
        return index in self.pair_starts


def build_program(plan, rank: int, prefetch: int = 2, *, messages=None, by_action=None) -> RankProgram:
    """Lower `plan` for `rank`; receives are posted `prefetch` actions ahead of their consumer.

    Posting is a per-peer prefix: to post a message, every earlier message from that peer is
    posted too. This is what keeps the order rule intact and never deadlocks: a prefix only
    holds messages the sender produces before the one needed. An overlapped pair's first half
    also posts its second half's receives (the pair waits for both inputs before it starts).
    `messages` is the plan's `plan_messages` when the caller has them, `by_action` its
    `messages_by_action` (executor.lowered computes both once per plan).
    """
    if messages is None:  # with a split layer's messages too, in one per-pair order
        messages = pair_messages(plan) if plan.splits else plan_messages(plan)
    pairs = messages
    recv_order = {src: tuple(msgs) for (src, dst), msgs in pairs.items() if dst == rank}
    send_order = {dst: tuple(msgs) for (src, dst), msgs in pairs.items() if src == rank}
    sends, recvs = messages_by_action(plan, pairs) if by_action is None else by_action
    position = {msg: (src, i) for src, msgs in recv_order.items() for i, msg in enumerate(msgs)}
    row = plan.schedule[rank]
    shards = shard_io(plan, rank)
    stage_row = [None if a.rule.side is not None else a for a in row]  # shard actions carry no stage message
    need = [[position[m] for m in (recvs.get(a),) + (shards[i].recvs if i in shards else ()) if m is not None]
            for i, a in enumerate(stage_row)]
    starts = pair_starts(row, getattr(plan, "pairs", ()))
    steps = []
    for i, a in enumerate(row):
        upto: dict[int, int] = {}
        for positions in need[i:i + 1 + max(prefetch, 0) + (i in starts)]:
            for pos in positions:
                upto[pos[0]] = max(upto.get(pos[0], 0), pos[1] + 1)
        st = stage_row[i]
        steps.append(Step(action=a, recv=recvs.get(st), send=sends.get(st), post_upto=tuple(sorted(upto.items())),
                          shard=shards.get(i)))
    return RankProgram(rank=rank, num_stages=plan.num_stages, steps=tuple(steps),
                       recv_order=recv_order, send_order=send_order, pair_starts=starts)


def local_input_key(action: Action, num_stages: int) -> tuple[str, int, int] | None:
    """Key of the same-device hand-off an action consumes: ('act', stage, mb) or ('grad', stage, mb)."""
    if action.input_stage(num_stages) is None:
        return None
    return (action.rule.receives.value, action.stage, action.microbatch)


def local_output_key(action: Action, num_stages: int) -> tuple[str, int, int] | None:
    """Key under which an action's result is handed to the next consumer on the same device."""
    dst = action.output_stage(num_stages)
    if dst is None:
        return None
    return (action.rule.sends.value, dst, action.microbatch)
