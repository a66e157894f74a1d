"""Communicators and receive buffers made once and shared by every executor of a process.

`CommCache.direction_groups` gives each direction of each communicating rank pair its own
process group (what NCCL needs, see comm.py). `new_group` is collective over the default
group, and with TP x DP > 1 several pipeline groups each need their own pairs, so the
pairs every rank needs are gathered over the world first and every rank then creates the
union in one order; a pair made once is never made again, so a second executor (or a
second plan using the same pairs) opens no communicator. `torch.distributed`'s
`use_local_synchronization` is not used: its group names count the groups each process
made so far, which differ between pipeline groups.

Receive buffers are kept per (plan, process group) and message, and reused by the next
step when the shape and dtype still fit.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..schedules.messages import plan_messages

log = logging.getLogger(__name__)


def plan_key(plan) -> tuple:
    """What identifies a plan's messages: devices, stages and every device's list."""
    return (plan.num_devices, plan.stages, plan.schedule)


def group_key(group) -> str:
    """A name of the process group that is the same on every member."""
    g = group if group is not None else dist.group.WORLD
    return g.group_name


class CommCache:
    """Per-direction process groups (by global rank pair) and receive buffers (by plan, group, message)."""

    def __init__(self):
        self._world = None
        self.groups: dict[tuple[int, int], object] = {}
        self.buffers: dict[tuple, dict] = {}
        self.groups_created = 0

    def _check_world(self) -> None:
        """Forget everything made for an earlier default process group (destroyed and re-initialised)."""
        world = dist.group.WORLD
        if world is not self._world:
            self._world = world
            self.groups.clear()
            self.buffers.clear()

    def buffers_of(self, plan, group) -> dict:
        """The receive-buffer store of (plan, group): message key -> tensor, kept across steps."""
        self._check_world()
        return self.buffers.setdefault((plan_key(plan), group_key(group)), {})

    def direction_groups(self, plan, group=None) -> dict[tuple[int, int], object]:
        """(src, dst) group ranks -> the process group of that direction. Collective over the default group:
        every rank of the world calls it at the same point (each with its own pipeline group and plan)."""
        self._check_world()
        mine = sorted({tuple(_global(group, r) for r in pair) for pair in plan_messages(plan)})
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for pair in sorted({tuple(p) for ranks in everyone for p in ranks}):
            if pair not in self.groups:
                # both directions of a pair hold the same two ranks; each is its own communicator
                self.groups[pair] = dist.new_group(ranks=sorted(pair))
                self.groups_created += 1
        log.debug("direction groups: %d made in this process so far", self.groups_created)
        return {pair: self.groups[tuple(_global(group, r) for r in pair)] for pair in plan_messages(plan)}


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
