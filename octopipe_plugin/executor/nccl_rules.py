"""Replay every rank's step under NCCL's rules and refuse a plan that would hang there.

The simulator proves a plan deadlock-free for a transport where sends never block and
each device waits only on its inputs (gloo with tags). NCCL adds three rules the plan
must also survive, replayed here over each rank's host operations (`posting.rank_ops`,
the order `run_step` posts them):

1. a communicator is created at its first operation on a rank, and creation blocks that
   rank's host until the other rank of the communicator also reaches its own first
   operation on it (unless both warmed it before the step, `ExecutorOptions.eager_comms`);
2. the operations one rank posts on one communicator run one after the other, in posting
   order (one NCCL stream per communicator), each send or receive pairing with the peer's
   operation in the same position of the peer's sequence, and both ends must run together;
3. with `host_waits` (every lane but CUDA's) a wait blocks the host until the operation
   completed; with `host_waits=False` (`lanes.CudaLane`) a receive's wait is a stream
   dependency of the compute that consumes it, and the host runs on.

An overlapped pair (`RankProgram.pair_starts`) is one unit in both places: the host waits for
both halves' receives before either computes and posts the first half's sends, then the
second's, after both (`rank_ops`); on the device the first half also waits for the second
half's receives, and a send of either half needs both computed.

With `pair_groups` each direction of each rank pair is its own communicator (comm_cache);
without, both directions of a pair share one (NCCL's per-pair communicator of one group).
Metas are taken as declared (a handshake message adds one operation in the same place of
the same sequence as the first activation it describes, so the order argument is the same).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import DeadlockError, PlanError
from .lowered import cache_key, lowered_plan
from .posting import Op, OpKind, describe, rank_ops
from .program import RankProgram

_passed: set = set()  # (plan_key, options) already checked in this process


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclReplay:
    """How a replay ended: `stuck` maps rank -> what it waits on (empty when every rank finished)."""

    stuck: dict[int, str]
    completed: int  # point-to-point pairs completed

    @property
    def ok(self) -> bool:
        """Whether every rank finished its step."""
        return not self.stuck


def check_nccl_rules(plan, *, prefetch: int = 2, pair_groups: bool = True, eager: bool = True,
                     host_waits: bool = True) -> None:
    """Raise DeadlockError (naming every stuck rank and what it waits on) if one step of `plan` hangs under NCCL."""
    key = (cache_key(plan), prefetch, pair_groups, eager, host_waits)
    if key in _passed:
        return
    programs = [lowered_plan(plan, r, prefetch).program for r in range(plan.num_devices)]
    result = replay(programs, pair_groups=pair_groups, eager=eager, host_waits=host_waits)
    if not result.ok:
        hint = ("" if eager or not pair_groups else
                " (its communicators are first used inside the step: create them eagerly, "
                "ExecutorOptions(eager_comms=True))")
        lines = "\n  ".join(f"rank {r}: {why}" for r, why in sorted(result.stuck.items()))
        raise DeadlockError(f"plan would hang under NCCL's rules at its first step{hint}:\n  {lines}",
                            result.stuck)
    _passed.add(key)


def comm_of(src: int, dst: int, pair_groups: bool) -> tuple[int, int]:
    """The communicator a src -> dst operation uses: its direction, or the unordered pair when shared."""
    return (src, dst) if pair_groups else (min(src, dst), max(src, dst))


def _comm_name(c: tuple[int, int], pair_groups: bool) -> str:
    return f"r{c[0]}->r{c[1]}" if pair_groups else f"r{c[0]}<->r{c[1]}"


def replay(programs: Sequence[RankProgram], *, pair_groups: bool = True, eager: bool = True,
           host_waits: bool = True) -> NcclReplay:
    """Replay one step of every rank's program under NCCL's rules (module docstring)."""
    return _Replay(programs, pair_groups, eager, host_waits).run()


class _Replay:
    def __init__(self, programs, pair_groups: bool, eager: bool, host_waits: bool):
        self.programs = list(programs)
        self.pair_groups = pair_groups
        self.host_waits = host_waits
        n = len(self.programs)
        pairs = sorted({(m.src, m.dst) for p in self.programs for msgs in p.send_order.values() for m in msgs})
        # the executor warms only per-direction groups (comm_cache.direction_groups), in this global order
        warm = eager and pair_groups
        self.ops = [rank_ops(p, tuple(q for q in pairs if r in q) if warm else ()) for r, p in enumerate(self.programs)]
        self.pc = [0] * n
        self.ready = [0] * n  # computes finished on the device
        self.enqueued = [0] * n  # computes the host has enqueued
        self.inited: set[tuple[int, tuple[int, int]]] = set()
        self.creating: dict[int, tuple[int, int]] = {}  # rank -> communicator it blocks creating
        self.queues: dict[tuple[int, tuple[int, int]], deque[Op]] = {}
        self.done: set = set()  # (msg, "recv" | "send") completed
        self.completed = 0

    def run(self) -> NcclReplay:
        progress = True
        while progress:
            progress = False
            for r in range(len(self.programs)):
                while self._host(r):
                    progress = True
            progress |= self._device()
            progress |= self._match()
        stuck = {r: self._why(r) for r in range(len(self.programs)) if not self._finished(r)}
        return NcclReplay(stuck=stuck, completed=self.completed)

    # ----- host

    def _comm(self, op: Op, r: int) -> tuple[tuple[int, int], int]:
        """(communicator, peer) of a p2p or warm op on rank r."""
        if op.kind is OpKind.WARM:
            src, dst = op.pair
        else:
            src, dst = op.msg.src, op.msg.dst
        return comm_of(src, dst, self.pair_groups), dst if r == src else src

    def _create(self, r: int, c: tuple[int, int], peer: int) -> bool:
        """Rule 1: whether communicator c exists on r now (created when the peer also waits to create it)."""
        if (r, c) in self.inited:
            return True
        self.creating[r] = c
        if self.creating.get(peer) == c:
            self.inited |= {(r, c), (peer, c)}
            del self.creating[r], self.creating[peer]
            return True
        return False

    def _host(self, r: int) -> bool:
        ops = self.ops[r]
        if self.pc[r] >= len(ops):
            return False
        op = ops[self.pc[r]]
        k = op.kind
        if k in (OpKind.WARM, OpKind.POST_RECV, OpKind.SEND):
            c, peer = self._comm(op, r)
            if not self._create(r, c, peer):
                return False
            if k is not OpKind.WARM:
                self.queues.setdefault((r, c), deque()).append(op)
        elif k is OpKind.WAIT_RECV:
            if self.host_waits and (op.msg, "recv") not in self.done:
                return False
        elif k is OpKind.WAIT_SEND:
            if (op.msg, "send") not in self.done:
                return False
        elif k is OpKind.COMPUTE:
            self.enqueued[r] += 1
            if self.host_waits:  # its input has landed already: the compute stream never waits
                self.ready[r] = self.enqueued[r]
        self.pc[r] += 1
        return True

    # ----- devices

    def _device(self) -> bool:
        """Rule 3 without host waits: the compute stream runs each action once its received input completed."""
        moved = False
        for r, prog in enumerate(self.programs):
            while self.ready[r] < self.enqueued[r]:
                i = self.ready[r]
                # a pair's first half starts once both halves' inputs are there
                needs = prog.steps[i].recvs + (prog.steps[i + 1].recvs if i in prog.pair_starts else ())
                if any((m, "recv") not in self.done for m in needs):
                    break
                self.ready[r] += 1
                moved = True
        return moved

    def _head(self, r: int, c) -> Op | None:
        q = self.queues.get((r, c))
        return q[0] if q else None

    def _match(self) -> bool:
        """Rule 2: pair the heads of both ends of each communicator; a send also needs its data computed."""
        moved = False
        for (r, c), q in list(self.queues.items()):
            while q:
                op = q[0]
                if op.kind is not OpKind.SEND or self.ready[r] <= op.step:
                    break
                dst = op.msg.dst
                other = self._head(dst, c)
                if other is None or other.kind is not OpKind.POST_RECV or other.msg.src != r:
                    break
                if other.msg != op.msg:
                    raise PlanError(f"NCCL rules: rank {r} sends {op.msg} to rank {dst} while rank {dst} receives "
                                    f"{other.msg} in that place of communicator {_comm_name(c, self.pair_groups)}: "
                                    f"the per-peer orders of the two ends differ")
                q.popleft()
                self.queues[(dst, c)].popleft()
                self.done |= {(op.msg, "send"), (op.msg, "recv")}
                self.completed += 1
                moved = True
        return moved

    # ----- report

    def _finished(self, r: int) -> bool:
        return (self.pc[r] >= len(self.ops[r]) and self.ready[r] >= self.enqueued[r]
                and not any(q for (q_r, _), q in self.queues.items() if q_r == r))

    def _why(self, r: int) -> str:
        ops = self.ops[r]
        if self.pc[r] >= len(ops):
            return f"device stuck before {self.programs[r].steps[self.ready[r]].action}" + self._queued(r)
        op = ops[self.pc[r]]
        if r in self.creating:
            c = self.creating[r]
            return (f"creating communicator {_comm_name(c, self.pair_groups)} at its first use "
                    f"({describe(op, r)}), which its peer has not reached")
        if op.kind in (OpKind.WAIT_RECV, OpKind.WAIT_SEND):
            c, _ = self._comm(op, r)
            return f"{describe(op, r)} on {_comm_name(c, self.pair_groups)}" + self._queued(r)
        return f"at {describe(op, r)}" + self._queued(r)

    def _queued(self, r: int) -> str:
        heads = [f"{_comm_name(c, self.pair_groups)} runs {describe(q[0], r)}"
                 for (q_r, c), q in sorted(self.queues.items()) if q_r == r and q]
        return f" ({'; '.join(heads)})" if heads else ""
