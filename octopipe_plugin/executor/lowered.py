"""One rank's lowered plan, built once: messages, programs, communicating pairs, stage roles.

Everything the executor, the communicator cache, the NCCL-rules checker and the adapters
need to know about "what rank r does with plan p" is derived here, from the plan and the
kind table (`actions.RULES`), and kept in a frozen `LoweredPlan`. `lowered_plan(plan, rank)`
builds it the first time and returns the same object afterwards (keyed by what identifies
the plan's messages, `plan_key`), so `plan_messages` runs once per plan, however many
executors, caches or checkers read it.

Forward-only programs (evaluation) exist for any micro-batch count: `forward_plan(plan, m)`
is the one rule for them, and `LoweredPlan.forward(m)` lowers it (cached the same way).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from ..actions import Action, Kind
from ..formats.splits import FORWARD_SHARD_KINDS, owner_stage, side_of
from ..schedules.messages import Message, messages_by_action, plan_messages
from ..schedules.split_messages import pair_messages
from .program import RankProgram, build_program

# the shard kinds that write a shard weight's gradient (the head's K, the embedding's G)
SHARD_WEIGHT_GRAD = (Kind.K, Kind.G)
_CACHE_SIZE = 64  # plans x ranks x prefetch kept; a process runs a handful (training, evaluation counts)


def plan_key(plan) -> tuple:
    """What identifies a plan's messages and programs: devices, stages, every device's list, split layers and
    overlapped pairs (a pair changes when receives are posted and waited for, not the messages)."""
    return (plan.num_devices, plan.stages, plan.schedule, plan.splits, getattr(plan, "pairs", ()))


class _Key:
    """A plan_key with its hash computed once: hashing a long schedule costs one Python call per action."""

    __slots__ = ("value", "hash")

    def __init__(self, value: tuple):
        self.value = value
        self.hash = hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and (
            self.value is other.value or self.value == other.value)


_keys: OrderedDict = OrderedDict()  # id(plan) -> (plan, its _Key); holding the plan keeps its id unique


def cache_key(plan) -> _Key:
    """The hashable key of `plan` in the lowering caches (plan_key, hashed once per plan object)."""
    held = _keys.get(id(plan))
    if held is not None and held[0] is plan:
        return held[1]
    key = _Key(plan_key(plan))
    _keys[id(plan)] = (plan, key)
    if len(_keys) > _CACHE_SIZE:
        _keys.popitem(last=False)
    return key


def first_rank(plan) -> int:
    """The pipeline rank that runs the first stage (it loads the inputs)."""
    return plan.first_device


def loss_rank(plan) -> int:
    """The pipeline rank that runs the last stage (it computes the loss)."""
    return plan.loss_device


# The kinds an evaluation step runs: the stages' F and, of split layers, the head's H and J (its loss, without
# the gradient: no partial goes back, no K) and the embedding's E (no G).
FORWARD_KINDS = frozenset({Kind.F, *FORWARD_SHARD_KINDS})


def is_forward_only(plan) -> bool:
    """Whether a plan holds forwards only (an evaluation plan)."""
    return all(a.kind in FORWARD_KINDS for row in plan.schedule for a in row)


def forward_plan(plan, num_microbatches: int | None = None):
    """The forward-only (evaluation) plan of `plan` for `num_microbatches` (None: the plan's own count).

    With the plan's count, every device keeps the plan's forward kinds (`FORWARD_KINDS`) in the
    plan's order (a subset of a deadlock-free plan's dependencies, in its order, cannot deadlock),
    each alone: an overlapped pair's forward runs unpaired (its partner is a backward).
    With another count (Megatron and DeepSpeed may evaluate on another micro-batch count than they
    train on) every device runs, per micro-batch in order, the embedding's E on its shard devices,
    the stages' forwards in stage order, the head's H then J on its shard devices: a topological
    order of the forward dependencies, so no placement can make it deadlock.
    """
    m = plan.num_microbatches if num_microbatches is None else num_microbatches
    if m < 1:
        raise ValueError(f"forward_plan: num_microbatches: expected >= 1, got {m}")
    if m == plan.num_microbatches:
        rows = tuple(tuple(a for a in row if a.kind in FORWARD_KINDS) for row in plan.schedule)
        return replace(plan, schedule=rows, pairs=())
    n = plan.stages[-1].end
    split = {side_of(sp, n): (owner_stage(sp, plan.stages), sp.devices) for sp in plan.splits}
    rows = [[] for _ in range(plan.num_devices)]
    for mb in range(m):
        if "input" in split:
            o, devs = split["input"]
            for d in devs:
                rows[d].append(Action(o, Kind.E, mb))
        for s, st in enumerate(plan.stages):
            rows[st.device].append(Action(s, Kind.F, mb))
        if "output" in split:
            o, devs = split["output"]
            for kind in (Kind.H, Kind.J):
                for d in devs:
                    rows[d].append(Action(o, kind, mb))
    return replace(plan, num_microbatches=m, schedule=tuple(tuple(r) for r in rows), pairs=())


@dataclass(frozen=True, kw_only=True, slots=True)
class LoweredPlan:
    """Rank `rank`'s share of `plan`, lowered once (see `lowered_plan`)."""

    plan: object
    rank: int
    prefetch: int
    # (src, dst) -> every cross-device message between them, in the sender's production order (whole plan)
    messages: Mapping[tuple[int, int], tuple[Message, ...]]
    # (src, dst) directions that carry messages, sorted: the communicators the plan needs (pipeline ranks)
    pairs: tuple[tuple[int, int], ...]
    program: RankProgram  # the rank's program of a training step (of an evaluation step for a forward-only plan)
    last_backward: Mapping[int, int]  # stage -> index in program.steps of its last weight-gradient action
    # shard kind with a weight gradient (K, G) -> index in program.steps of the rank's last action of that kind
    last_shard_backward: Mapping[Kind, int]
    first_rank: int
    loss_rank: int
    forward_only: bool  # the plan holds forwards only

    @property
    def my_pairs(self) -> tuple[tuple[int, int], ...]:
        """The directions of `pairs` this rank sends or receives on, in the same (global) order."""
        return tuple(p for p in self.pairs if self.rank in p)

    def is_last_backward(self, index: int, action: Action) -> bool:
        """Whether step `index` of the training program is `action.stage`'s last weight-gradient action (for a
        shard action: the rank's last K, or last G, of the step)."""
        if action.rule.side is not None:
            return self.last_shard_backward.get(action.kind) == index
        return self.last_backward.get(action.stage) == index

    def forward(self, num_microbatches: int | None = None) -> "LoweredPlan":
        """The lowered forward-only plan of `num_microbatches` (None: the plan's count) for this rank."""
        if self.forward_only and num_microbatches in (None, self.plan.num_microbatches):
            return self
        return lowered_plan(forward_plan(self.plan, num_microbatches), self.rank, self.prefetch)

    def forward_program(self, num_microbatches: int | None = None) -> RankProgram:
        """This rank's program of an evaluation step of `num_microbatches` (None: the plan's count)."""
        return self.forward(num_microbatches).program


_messages: OrderedDict = OrderedDict()
_by_action: OrderedDict = OrderedDict()
_lowered: OrderedDict = OrderedDict()


def _remember(store: OrderedDict, key, make):
    value = store.get(key)
    if value is None:
        value = store[key] = make()
        if len(store) > _CACHE_SIZE:
            store.popitem(last=False)
    else:
        store.move_to_end(key)
    return value


def plan_message_map(plan) -> Mapping[tuple[int, int], tuple[Message, ...]]:
    """`plan_messages(plan)` computed once per plan (read-only, tuples); a plan with split layers also has their
    messages (`schedules.split_messages.pair_messages`: one per-pair order for both kinds)."""
    def make():
        msgs = pair_messages(plan) if plan.splits else plan_messages(plan)
        return MappingProxyType({pair: tuple(m) for pair, m in sorted(msgs.items())})
    return _remember(_messages, cache_key(plan), make)


def _message_of_action(plan) -> tuple[dict, dict]:
    """(message each action sends, message each action receives), once per plan (every rank reads them)."""
    return _remember(_by_action, cache_key(plan), lambda: messages_by_action(plan, plan_message_map(plan)))


def plan_pairs(plan) -> tuple[tuple[int, int], ...]:
    """The (src, dst) directions of `plan` that carry messages, sorted (the order every rank agrees on)."""
    return tuple(plan_message_map(plan))


def lowered_plan(plan, rank: int, prefetch: int = 2) -> LoweredPlan:
    """Rank `rank`'s lowered share of `plan` (receives posted `prefetch` actions ahead), built once."""
    if not 0 <= rank < plan.num_devices:
        raise ValueError(f"lowered_plan: rank: expected 0..{plan.num_devices - 1}, got {rank}")
    return _remember(_lowered, (cache_key(plan), rank, prefetch), lambda: _lower(plan, rank, prefetch))


def _lower(plan, rank: int, prefetch: int) -> LoweredPlan:
    messages = plan_message_map(plan)
    program = build_program(plan, rank, prefetch, messages=messages, by_action=_message_of_action(plan))
    last: dict[int, int] = {}
    last_shard: dict = {}
    for i, step in enumerate(program.steps):
        if step.action.rule.weight_grad:
            last[step.action.stage] = i
        elif step.action.kind in SHARD_WEIGHT_GRAD:
            last_shard[step.action.kind] = i
    return LoweredPlan(plan=plan, rank=rank, prefetch=prefetch, messages=messages, pairs=tuple(messages),
                       program=program, last_backward=MappingProxyType(last),
                       last_shard_backward=MappingProxyType(last_shard), first_rank=first_rank(plan),
                       loss_rank=loss_rank(plan), forward_only=is_forward_only(plan))
