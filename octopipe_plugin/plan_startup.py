"""The plan at start-up, framework-neutral: rank 0 obtains it, every rank gets the plan or rank 0's error.

Both adapters call `plan_at_startup` with what their run offers: a plan file, a plan saved next
to the checkpoint being resumed, a tuning function (which may profile first), checks against the
run, and where to save the result. Rank 0 runs those steps in that order; whatever it ends with,
a plan or a failure, is broadcast, so a failure on rank 0 (a missing file, a tuning error, a plan
for another model) ends every rank with the same one-line message instead of leaving the others
waiting in a collective.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from .errors import FormatError, OctoPipeError, one_line
from .formats import Plan, plan_from_dict, plan_to_dict, read_plan, write_plan

log = logging.getLogger("octopipe.startup")


class StartupError(OctoPipeError):
    """Rank 0 could not produce a plan; the message is the same on every rank."""


@dataclass(frozen=True)
class PlanSteps:
    """Where a run's plan may come from, tried in field order on rank 0, and what happens to it."""

    plan_file: str | None = None                    # the user's plan: read it
    resume_file: str | None = None                  # a plan saved next to the checkpoint being loaded
    tune: Callable[[], Plan] | None = None          # otherwise tune (profiling inside, if asked)
    check: Callable[[Plan, str], None] | None = None  # refuse a plan that does not match the run
    adapt: Callable[[Plan, str], Plan] | None = None  # the plan the run executes (e.g. fused where it cannot split)
    save_to: tuple[str, ...] = ()                   # files rank 0 writes the plan to
    missing: str = "a plan: give a plan file or tuning settings"  # the message when no step applies
    plan_field: tuple[str, str] | None = None       # (document, field) that named plan_file, for a missing file


def obtain_plan(steps: PlanSteps) -> tuple[Plan, str]:
    """(plan, where it came from) by the steps, checked, adapted and saved; raises on failure (rank 0's part)."""
    if steps.plan_file is not None:
        if steps.plan_field is not None and not os.path.isfile(steps.plan_file):
            raise FormatError(*steps.plan_field, "an existing octopipe-plan/1 file", steps.plan_file)
        plan, source = read_plan(steps.plan_file), steps.plan_file
    elif steps.resume_file is not None and os.path.exists(steps.resume_file):
        plan, source = read_plan(steps.resume_file), steps.resume_file
        log.info("octopipe: resuming under the plan saved at %s", source)
    elif steps.tune is not None:
        plan, source = steps.tune(), "the plan tuned at start-up"
    else:
        raise StartupError(f"octopipe: no plan for this run; expected {steps.missing}")
    if steps.check is not None:
        steps.check(plan, source)
    if steps.adapt is not None:
        plan = steps.adapt(plan, source)
    for path in steps.save_to:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_plan(plan, path)
        log.info("octopipe: plan saved to %s", path)
    return plan, source


def plan_at_startup(steps: PlanSteps, *, group=None) -> tuple[Plan, str]:
    """Every rank's (plan, source): rank 0 runs `obtain_plan`, then broadcasts the plan or its error.

    Without an initialized process group (one process) the steps run here. Any exception on rank 0
    becomes a StartupError carrying its one-line message on every rank (the original is chained on
    rank 0)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return obtain_plan(steps)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box: list[object] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == src:
        try:
            plan, source = obtain_plan(steps)
            box[0] = {"plan": plan_to_dict(plan), "source": source}
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            failure = exc
            box[0] = {"error": one_line(exc)}
    dist.broadcast_object_list(box, src=src, group=group)
    msg = box[0]
    if "error" in msg:
        raise StartupError(msg["error"]) from failure
    return plan_from_dict(msg["plan"], f"<plan broadcast from rank {src}: {msg['source']}>"), msg["source"]

