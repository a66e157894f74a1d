"""Lowering of a split layer's hand-overs for one rank: what each action takes from and gives to shards.

The messages are `schedules.split_messages` (the one list, with the same-device hand-overs the
executor passes in memory): the head's input from the owner's F to every H, the partials from
every J to the owner's B/I; the embedding's partials from every E to stage 0's F and its output
gradient from stage 0's B/I to every G. The statistics are one all-gather per micro-batch
(`stats_gathers`): each shard's H starts it, its J awaits it. An action that takes several (the
owner summing partials, a J reading every peer's statistics) takes them in shard-device order, so
every rank adds them up in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.split_messages import SplitMessage, StatsGather, split_messages, stats_gathers


@dataclass(frozen=True, kw_only=True, slots=True)
class Take:
    """One input of an action from a split layer's hand-over: a message, or a same-device hand-off key."""

    src: int  # the device that made it
    msg: SplitMessage | None  # None: handed over in memory under `key`
    key: tuple | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardIO:
    """A step's split hand-overs: what it takes (shard-device order) and what it gives (messages, local keys)."""

    takes: tuple[Take, ...] = ()
    sends: tuple[SplitMessage, ...] = ()
    keeps: tuple[tuple, ...] = ()  # same-device hand-off keys its output is stored under
    starts: StatsGather | None = None  # an H: the statistics' all-gather its output goes into
    awaits: StatsGather | None = None  # a J: the all-gather of every shard's statistics it reads

    @property
    def recvs(self) -> tuple[SplitMessage, ...]:
        """The messages it receives, in the order it waits for them."""
        return tuple(t.msg for t in self.takes if t.msg is not None)


def local_key(msg: SplitMessage) -> tuple:
    """The key of a same-device hand-over: what it is and its micro-batch (one owner or shard per side and rank)."""
    return ("split", msg.what, msg.microbatch)


def shard_io(plan, rank: int) -> dict[int, ShardIO]:
    """Position in the rank's list -> its split hand-overs (only the positions that have some)."""
    if not plan.splits:
        return {}
    pos = {a: i for i, a in enumerate(plan.schedule[rank])}
    takes: dict[int, list[Take]] = {}
    sends: dict[int, list[SplitMessage]] = {}
    keeps: dict[int, list[tuple]] = {}
    for _, msg in split_messages(plan, same_device=True):
        if msg.src == rank and msg.dst == rank:
            keeps.setdefault(pos[msg.producer], []).append(local_key(msg))
            takes.setdefault(pos[msg.consumer], []).append(Take(src=rank, msg=None, key=local_key(msg)))
        elif msg.dst == rank:
            takes.setdefault(pos[msg.consumer], []).append(Take(src=msg.src, msg=msg))
        elif msg.src == rank:
            sends.setdefault(pos[msg.producer], []).append(msg)
    starts = {pos[g.producer]: g for g in stats_gathers(plan) if rank in g.devices}
    awaits = {pos[g.consumer]: g for g in starts.values()}
    out = {}
    for i in sorted(set(takes) | set(sends) | set(keeps) | set(starts) | set(awaits)):
        out[i] = ShardIO(takes=tuple(sorted(takes.get(i, ()), key=lambda t: t.src)),
                         sends=tuple(sorted(sends.get(i, ()), key=lambda m: m.dst)), keeps=tuple(keeps.get(i, ())),
                         starts=starts.get(i), awaits=awaits.get(i))
    return out
