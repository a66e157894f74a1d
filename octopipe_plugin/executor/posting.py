"""The operations one rank posts in one step, in order, and their text form.

This is the host-side order of `PipelineExecutor.run_step` with the per-message exchange
of `Transport` (`ExecutorOptions(exchange="message")`, every backend's default) and every
boundary meta declared (the batched exchange issues the same operations in the same order
per communicator, held until the next exchange point; it is not replayed here): per step, the receives its `post_upto`
asks for (a per-peer prefix), then the wait for its own input, its compute, then the
non-blocking send of its output; at the end of the step, the wait for every send in the
order it was posted (`Transport.finish`). An overlapped pair (`RankProgram.pair_starts`) is one
unit: both halves' receives are posted and waited for, then both compute, then the first
half's sends, then the second's, all belonging to the pair's last step (both halves end
together). The NCCL-rules checker replays these lists, and `format_ops` prints them for
debugging ordering problems (`octopipe lower`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..actions import Action
from ..schedules.messages import Message
from .program import RankProgram


class OpKind(str, enum.Enum):
    """What the host does: post or wait a receive, run an action, post or wait a send, warm a communicator."""

    WARM = "warm"
    POST_RECV = "post recv"
    WAIT_RECV = "wait recv"
    COMPUTE = "compute"
    SEND = "send"
    WAIT_SEND = "wait send"


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One host operation of a rank: `step` is the index of the program step it belongs to (-1: none)."""

    kind: OpKind
    step: int
    action: Action | None = None  # COMPUTE: the action run
    msg: Message | None = None  # receives and sends: the message
    pair: tuple[int, int] | None = None  # WARM: the (src, dst) direction warmed
    overlapped: bool = False  # COMPUTE: the first half of an overlapped pair (the next COMPUTE its second)


def rank_ops(program: RankProgram, warm: tuple[tuple[int, int], ...] = ()) -> tuple[Op, ...]:
    """The host operations of one step of `program`, after warming the directions `warm` (in that order)."""
    ops = [Op(kind=OpKind.WARM, step=-1, pair=p) for p in warm]
    posted: dict[int, int] = {}
    sends: list[Op] = []
    position = {m: k for msgs in program.recv_order.values() for k, m in enumerate(msgs)}

    def post(peer: int, count: int, step: int) -> None:
        order = program.recv_order.get(peer, ())
        for k in range(posted.get(peer, 0), count):
            ops.append(Op(kind=OpKind.POST_RECV, step=step, msg=order[k]))
        posted[peer] = max(posted.get(peer, 0), count)

    steps, starts = program.steps, program.pair_starts
    i = 0
    while i < len(steps):
        unit = range(i, i + 2) if i in starts else range(i, i + 1)  # a pair: both halves, as one
        for j in unit:
            for peer, count in steps[j].post_upto:
                post(peer, count, j)
        for j in unit:
            for msg in steps[j].recvs:  # its stage input, then a split layer's hand-overs (split_program.py)
                post(msg.src, position[msg] + 1, j)
                ops.append(Op(kind=OpKind.WAIT_RECV, step=j, msg=msg))
        for j in unit:
            ops.append(Op(kind=OpKind.COMPUTE, step=j, action=steps[j].action, overlapped=j in starts))
        for j in unit:
            for msg in steps[j].sends:
                send = Op(kind=OpKind.SEND, step=unit[-1], msg=msg)
                ops.append(send)
                sends.append(send)
        i = unit[-1] + 1
    ops += [Op(kind=OpKind.WAIT_SEND, step=len(program.steps), msg=s.msg) for s in sends]
    return tuple(ops)


def describe(op: Op, rank: int) -> str:
    """One op as text: `3F12` (`3F12+` the first half of an overlapped pair), `recv ACT 2F5 from r1` (the message
    made by 2F5), `send GRAD 3B0 to r2`."""
    if op.kind is OpKind.COMPUTE:
        return f"{op.action}+" if op.overlapped else str(op.action)
    if op.kind is OpKind.WARM:
        return f"warm r{op.pair[0]}->r{op.pair[1]}"
    m = op.msg
    peer = f"from r{m.src}" if m.dst == rank else f"to r{m.dst}"
    what = m.kind.name if m.kind is not None else m.what  # a split layer's message names what it carries
    return f"{op.kind.value} {what} {m.producer} {peer}"


def format_ops(ops, rank: int, *, compact: bool = False) -> str:
    """The text form of a rank's ops, one per line (`compact`: omit the receive posts)."""
    lines = [f"rank {rank}:"]
    for op in ops:
        if compact and op.kind is OpKind.POST_RECV:
            continue
        lines.append(("  " if op.kind is OpKind.COMPUTE else "    ") + describe(op, rank))
    return "\n".join(lines)


def format_lowered(lowered, *, warm=False, compact: bool = False) -> str:
    """The text form of a `LoweredPlan`'s program (compute and comm, in posting order); `warm`: True (its own
    directions) or the directions the executor warmed before the step, in order."""
    pairs = lowered.my_pairs if warm is True else tuple(warm or ())
    return format_ops(rank_ops(lowered.program, pairs), lowered.rank, compact=compact)
