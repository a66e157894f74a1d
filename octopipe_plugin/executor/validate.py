"""Refuse a plan before any message is sent: coverage and ownership, then deadlock-freedom."""

from __future__ import annotations

from ..errors import PlanError
from ..formats import Cluster, Link, validate_plan
from ..formats.model import head_inputs
from ..simulator import StageCosts, simulate
from .lowered import is_forward_only
from .nccl_rules import check_nccl_rules

__all__ = ["check_runnable", "check_model_runnable", "is_forward_only"]


def check_runnable(plan, *, nccl: bool = False, eager_comms: bool = True, prefetch: int = 2) -> None:
    """Raise PlanError / DeadlockError unless every device of `plan` can run its whole list.

    `nccl`: also replay one step under NCCL's rules (`nccl_rules.check_nccl_rules`, per-direction
    communicators, created eagerly unless `eager_comms=False`, receives posted `prefetch` ahead).

    A plan of forwards only (evaluation) is checked as such. The simulator's dependency
    semantics are exactly the executor's (a device blocks only on inputs, sends never
    block), so a plan it finishes cannot deadlock the executor; unit costs suffice because
    deadlock does not depend on durations.
    """
    validate_plan(plan, forward_only=is_forward_only(plan))
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
    """Raise PlanError when the shard runners cannot run `plan` for `model`: a split LM head with MTP inputs.

    A model with multi-token prediction feeds its LM head 1 + depth hidden states (`formats.model.head_inputs`:
    the `mtp` layers before it); the shard math (executor/vocab_shard.py) takes one. The simulator and the
    dry run's stand-ins price such a plan; real tensors are refused here, by name, before any process starts.
    """
    n = plan.stages[-1].end if plan.stages else 0
    heads = head_inputs(model)
    for sp in plan.splits:
        if heads > 1 and sp.layer == n - 1 == model.num_layers - 1:
            raise PlanError(f"plan splits the LM head (layer {sp.layer}) of model {model.name!r}, whose head takes "
                            f"{heads} hidden states (the main model's and {heads - 1} MTP depth(s): the 'mtp' layers "
                            f"before it); the shard runners take one (fix: plan without splits, `--splits off`, or "
                            f"split only the embedding)")
