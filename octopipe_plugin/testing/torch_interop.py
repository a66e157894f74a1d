"""Run an OctoPipe plan on torch.distributed.pipelining's `_PipelineScheduleRuntime` (the peer to compare with).

Our action notation is torch's (`2F0`, `1I3`, `0W1`, `3B2`), so a plan exports as its
compute-only CSV (one row per rank) and torch lowers it with its own comm passes.
`_PipelineScheduleRuntime` is private torch API (checked against torch 2.13).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from ..schedules.torch_csv import plan_to_torch_csv  # the CSV's one home (`octopipe export --torch-csv` too)


def torch_runtime(plan, modules: Mapping[int, nn.Module], loss_fn: Callable, rank: int, csv_path: str,
                  device: str = "cpu"):
    """A `_PipelineScheduleRuntime` running `plan` for `rank` over `modules` (stage -> module).

    The plan is written to `csv_path` and loaded from there, lowered with torch's own
    send/recv passes (PipelineStage infers the boundary shapes on the first step).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    ns = plan.num_stages
    stages = [PipelineStage(modules[s], s, ns, torch.device(device)) for s in plan.stages_of(rank)]
    runtime = _PipelineScheduleRuntime(stages, plan.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    with open(csv_path, "w", newline="") as fh:
        fh.write(plan_to_torch_csv(plan))
    runtime._load_csv(csv_path, format="compute_only")
    return runtime
