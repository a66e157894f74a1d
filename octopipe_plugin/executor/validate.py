"""Refuse a plan before any message is sent: coverage and ownership, then deadlock-freedom."""

from __future__ import annotations

from ..errors import PlanError
from ..formats import Cluster, Link, validate_plan
from ..schedules.split_messages import gather_order_problem
from ..simulator import StageCosts, simulate
from .lowered import is_forward_only
from .nccl_rules import check_nccl_rules

__all__ = ["check_runnable", "check_model_runnable", "is_forward_only"]


def check_runnable(plan, *, nccl: bool = False, eager_comms: bool = True, prefetch: int = 2) -> None:
    """Raise PlanError / DeadlockError unless every device of `plan` can run its whole list.

    A split head's shard devices must run its H in one micro-batch order (`gather_order_problem`): each H starts
    its micro-batch's statistics all-gather, and a collective pairs by its position on the group.

    `nccl`: also replay one step under NCCL's rules (`nccl_rules.check_nccl_rules`, per-direction
    communicators, created eagerly unless `eager_comms=False`, receives posted `prefetch` ahead).

    A plan of forwards only (evaluation) is checked as such. The simulator's dependency
    semantics are exactly the executor's (a device blocks only on inputs, sends never
    block), so a plan it finishes cannot deadlock the executor; unit costs suffice because
    deadlock does not depend on durations.
    """
    validate_plan(plan, forward_only=is_forward_only(plan))
    problem = gather_order_problem(plan)  # the statistics' all-gathers pair by their order on the shards' group
    if problem is not None:
        raise PlanError(problem)
    ns, nd = plan.num_stages, plan.num_devices
    ones = tuple(1.0 for _ in range(ns))
    zeros = tuple(0 for _ in range(ns))
    costs = StageCosts(ones, ones, ones, zeros, zeros, zeros)
    link = Link(bandwidth_gb_per_s=1.0, latency_us=1.0)
    cluster = Cluster(num_devices=nd, devices_per_node=nd, memory_bytes=1, intra_node=link, inter_node=link)
    simulate(None, cluster, plan, costs=costs, detail=False)  # split plans too: simulator/split.py
    if nccl:
        check_nccl_rules(plan, prefetch=prefetch, pair_groups=True, eager=eager_comms)


def check_model_runnable(model, plan) -> None:
    """Raise PlanError when the shard runners cannot run `plan` for `model`; no model refuses today.

    A model with multi-token prediction feeds its LM head 1 + depth hidden states (`formats.model.head_inputs`:
    the `mtp` layers before it); a split head runs every one of them over its shards (executor/vocab_shard.py
    `VocabShards(heads=)`, `SplitTorchStages(mtp_depth=)`: one weight, each head its own loss coefficient), as
    the simulator prices it and the dry run's stand-ins sleep it. The framework runners keep their own start-up
    refusals (Megatron's `--mtp-num-layers` with a split head: adapters/megatron/mapping.side_split_blocker).
    """
    del model, plan  # kept as the one place a model-dependent refusal of a split plan would go
