"""Communicators and receive buffers made once and shared by every executor of a process.

`CommCache.direction_groups` gives each direction of each communicating rank pair its own
process group (what NCCL needs, see comm.py). `new_group` is collective over the default
group, and with TP x DP > 1 several pipeline groups each need their own pairs, so the
pairs every rank needs are gathered over the world first and every rank then creates the
union in one order; a pair made once is never made again, so a second executor (or a
second plan using the same pairs) opens no communicator. `torch.distributed`'s
`use_local_synchronization` is not used: its group names count the groups each process
made so far, which differ between pipeline groups.

NCCL creates a communicator at its first operation and blocks until both ranks arrive, so
communicators first touched inside a step deadlock 1F1B-like plans (rank r first waits in
the GRAD direction with r+1 while r+1 first waits in the ACT one; `nccl_rules` replays it).
`direction_groups(warm_up=True)` therefore initialises every direction group right away:
each rank runs a one-element exchange on each group it belongs to, in the sorted order of
the world's (src, dst) pairs. All ranks walk the same sorted list, so the smallest pair not
yet warmed always has both its ranks waiting on it: the warm-up cannot deadlock. Both
operations the transport lanes use are warmed: a plain isend/irecv (NCCL's per-pair
communicator) and a `batch_isend_irecv` (the group's own communicator, the batched lane).

`CommCache.gather_groups` gives each split head's shard devices one process group, on which
their statistics' all-gathers run (schedules/split_messages.py `StatsGather`): made the same way
(the world's sets gathered, the union made in one sorted order, never made twice) and warmed at
once by one all-gather on each, in that order (the smallest set not yet warmed always has every
member waiting on it), so no group is created or connected inside a step.

Receive buffers are kept per (plan, process group) and message, and reused by the next
step when the shape and dtype still fit.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from .errors import ExecutorError
from ..schedules.split_messages import stats_gathers
from .lowered import plan_key, plan_pairs

__all__ = ["CommCache", "default_cache", "group_key", "plan_key", "reusable"]

log = logging.getLogger(__name__)
WARM_UP_TIMEOUT_S = 300.0  # both ranks of a pair reach the warm-up at executor construction, close in time


def group_key(group) -> str:
    """A name of the process group that is the same on every member."""
    g = group if group is not None else dist.group.WORLD
    return g.group_name


class CommCache:
    """Per-direction process groups (by global rank pair) and receive buffers (by plan, group, message)."""

    def __init__(self):
        self._world = None
        self.groups: dict[tuple[int, int], object] = {}
        self.shard_sets: dict[tuple[int, ...], object] = {}  # sorted global ranks of a split head's shards -> group
        self.buffers: dict[tuple, dict] = {}
        self.groups_created = 0
        self.warmed: list[tuple[int, int]] = []  # global (src, dst) pairs this rank warmed, in warm-up order

    def _check_world(self) -> None:
        """Forget everything made for an earlier default process group (destroyed and re-initialised)."""
        world = dist.group.WORLD
        if world is not self._world:
            self._world = world
            self.groups.clear()
            self.shard_sets.clear()
            self.buffers.clear()
            self.warmed.clear()

    def buffers_of(self, plan, group) -> dict:
        """The receive-buffer store of (plan, group): message key -> tensor, kept across steps."""
        self._check_world()
        return self.buffers.setdefault((plan_key(plan), group_key(group)), {})

    def direction_groups(self, plan, group=None, *, warm_up: bool = True, device="cpu",
                         timeout_s: float = WARM_UP_TIMEOUT_S) -> dict[tuple[int, int], object]:
        """(src, dst) group ranks -> the process group of that direction. Collective over the default group:
        every rank of the world calls it at the same point (each with its own pipeline group and plan).
        `warm_up`: initialise every direction group of this rank now, in the world's sorted pair order."""
        self._check_world()
        pairs = plan_pairs(plan)
        mine = sorted({tuple(_global(group, r) for r in pair) for pair in pairs})
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        world_pairs = sorted({tuple(p) for ranks in everyone for p in ranks})
        for pair in world_pairs:
            if pair not in self.groups:
                # both directions of a pair hold the same two ranks; each is its own communicator
                self.groups[pair] = dist.new_group(ranks=sorted(pair))
                self.groups_created += 1
        log.debug("direction groups: %d made in this process so far", self.groups_created)
        if warm_up:
            me, done = dist.get_rank(), set(self.warmed)
            for pair in world_pairs:  # one order on every rank: see the module docstring
                if me in pair and pair not in done:
                    _warm(self.groups[pair], pair, me, device, timeout_s)
                    self.warmed.append(pair)
        return {pair: self.groups[tuple(_global(group, r) for r in pair)] for pair in pairs}


    def gather_groups(self, plan, group=None, *, device="cpu",
                      timeout_s: float = WARM_UP_TIMEOUT_S) -> dict[tuple[int, ...], tuple[object, tuple[int, ...]]]:
        """A split head's shard devices (group ranks, sorted) -> (their process group, the group rank of each of its
        members in its rank order), made and warmed now. Collective over the default group, as `direction_groups`:
        every rank of the world calls it at the same point (nothing happens for a plan without statistics to
        gather, which every rank of the world then runs alike)."""
        self._check_world()
        sets = sorted({g.devices for g in stats_gathers(plan)})
        if not sets:
            return {}
        mine = sorted(tuple(sorted(_global(group, r) for r in devs)) for devs in sets)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        me, made = dist.get_rank(), []
        for ranks in sorted({tuple(s) for got in everyone for s in got}):
            if ranks not in self.shard_sets:
                self.shard_sets[ranks] = dist.new_group(ranks=list(ranks))
                self.groups_created += 1
                made.append(ranks)
        for ranks in made:  # one order on every rank (module docstring): the smallest set first
            if me in ranks:
                g = self.shard_sets[ranks]
                buf = torch.zeros(1, device=torch.device("cpu") if dist.get_backend(g) == "gloo" else device)
                dist.all_gather([torch.empty_like(buf) for _ in ranks], buf, group=g, async_op=True).wait(
                    timeout=datetime.timedelta(seconds=timeout_s))
        out = {}
        for devs in sets:
            ranks = tuple(sorted(_global(group, r) for r in devs))
            out[devs] = (self.shard_sets[ranks], tuple(dist.get_group_rank(group, r) if group is not None else r
                                                       for r in ranks))
        return out


def _warm(g, pair: tuple[int, int], me: int, device, timeout_s: float) -> None:
    """One element from pair[0] to pair[1] on `g`, plainly and batched: NCCL creates both communicators now."""
    backend = dist.get_backend(g)
    dev = torch.device("cpu") if backend == "gloo" else torch.device(device)
    src, dst = pair
    if backend == "nccl" and dev.type == "cpu":
        raise ExecutorError(f"rank {me}: warming the direction group r{src}->r{dst}: backend nccl moves device "
                            f"tensors, the executor's device is cpu (pass PipelineExecutor(device=...))", rank=me)
    peer = dist.get_group_rank(g, dst if me == src else src)
    buf = torch.zeros(1, device=dev)
    bound = datetime.timedelta(seconds=timeout_s)
    if me == src:
        op, work = dist.isend, dist.isend(buf, group=g, group_dst=peer)
    else:
        op, work = dist.irecv, dist.irecv(buf, group=g, group_src=peer)
    work.wait(timeout=bound)
    for work in dist.batch_isend_irecv([dist.P2POp(op, buf, group=g, group_peer=peer)]):
        work.wait(timeout=bound)


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


_DEFAULT = CommCache()


def default_cache() -> CommCache:
    """The process-wide cache executors share unless given their own."""
    return _DEFAULT


def reusable(buf: torch.Tensor | None, shape, dtype, device) -> bool:
    """Whether a kept buffer can receive a tensor of this shape, dtype and device."""
    return (buf is not None and tuple(buf.shape) == tuple(shape) and buf.dtype == dtype
            and buf.device == torch.device(device))
