"""Data-parallel gradient reduction started per stage, at the stage's last backward of the step.

PipelineEngine reduces every gradient after the whole step (`_exec_reduce_grads`). With the
executor's `on_last_backward(stage)` hook, a stage's gradients are final as soon as its last B or
W ran, so their all-reduce over the data-parallel group can run while the rank still computes its
other stages (and the other ranks their backwards). The arithmetic is DeepSpeed's
`allreduce_bucket` (flatten, post-scale by the predivide factor / DP size, copy back), so the
gradients equal the stock engine's.

Only where DeepSpeed's own path would be a plain bucketed all-reduce (fp32 or bf16 weights
without the bf16 optimizer, no ZeRO, no MoE, gradient averaging, communication dtype = gradient
dtype); anything else keeps the reduction after the step. Parameters of tied modules, or used by
more than one local stage, are left to the after-step reduction (the tied all-reduce comes
first there, as in PipelineEngine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def overlap_applies(engine) -> bool:
    """Whether the engine's DP reduction is the plain bucketed all-reduce this module reproduces."""
    return (engine.dp_world_size > 1 and engine.pipeline_enable_backward_allreduce
            and not engine.using_bf16_optimizer and not engine.zero_optimization() and not engine.has_moe_layers
            and engine.gradient_average and not engine.is_deepcompile_active())


@dataclass
class _Flight:
    work: object
    flat: torch.Tensor
    grads: list


class StageReduction:
    """Starts a stage's DP all-reduce at its last backward; `finish()` completes them after the step."""

    def __init__(self, engine):
        import deepspeed.comm as dist

        self.engine = engine
        self.dist = dist
        self.group = engine.mpu.get_data_parallel_group()
        self.dp = dist.get_world_size(self.group)
        module = engine.module
        tied = {id(p) for m in module.tied_modules.values() for p in m.parameters()}
        users: dict[int, int] = {}
        per_stage = {s: module.stage_parameters(s) for s in module.local_stages}
        for params in per_stage.values():
            for p in params:
                users[id(p)] = users.get(id(p), 0) + 1
        comm = engine.communication_data_type
        self.params = {s: [p for p in ps if id(p) not in tied and users[id(p)] == 1 and p.numel() > 0
                           and p.dtype == comm] for s, ps in per_stage.items()}
        self.covered = {id(p) for ps in self.params.values() for p in ps}
        self.flights: list[_Flight] = []

    def start(self, stage: int) -> None:
        """The executor's on_last_backward: launch stage `stage`'s all-reduce (async), one bucket per dtype."""
        params = self.params.get(stage, ())
        for p in params:
            if p.grad is None:  # DeepSpeed reduces zeros for a missing gradient, so every rank sends the same size
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad.data)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            pre = self.engine.gradient_predivide_factor()
            if self.engine.postscale_gradients():
                if pre != 1.0:
                    flat.mul_(1.0 / pre)
            else:
                flat.mul_(1.0 / self.dp)
            work = self.dist.all_reduce(flat, group=self.group, async_op=True)
            self.flights.append(_Flight(work, flat, grads))

    def finish(self) -> None:
        """Wait for every started reduction and write the averaged gradients back."""
        pre = self.engine.gradient_predivide_factor()
        for f in self.flights:
            f.work.wait()
            if self.engine.postscale_gradients() and pre != self.dp:
                f.flat.mul_(pre / self.dp)
            for g, synced in zip(f.grads, _unflatten_dense_tensors(f.flat, f.grads)):
                g.copy_(synced)
        self.flights = []

    def rest(self) -> list[torch.Tensor]:
        """The gradients left to the after-step reduction (zeros where missing, as DeepSpeed does)."""
        out = []
        for p in self.engine.module.parameters():
            if not p.requires_grad or p.numel() == 0 or id(p) in self.covered:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad.data)
        return out
