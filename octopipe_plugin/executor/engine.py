"""The executor: runs one rank's action list of a plan over torch.distributed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..actions import Action, Kind
from .comm import Transport, direction_groups
from .errors import ExecutorError
from .program import RankProgram, build_program, local_input_key, local_output_key
from .validate import check_runnable


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorOptions:
    """How the executor waits and posts: every wait is bounded by `timeout_s`."""

    timeout_s: float = 60.0
    prefetch: int = 2  # post each receive this many actions before its consumer
    validate: bool = True
    # gloo honours tags; False sends every message with tag 0 so only the per-peer order matches them,
    # which is what NCCL does (lets gloo tests prove the order rule alone is right)
    tags: bool = True


@dataclass(kw_only=True)
class StepResult:
    """One step on one rank: last-stage losses (scaled) and the wall-clock span of every action."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)

    @property
    def loss(self) -> torch.Tensor | None:
        """Sum of the scaled micro-batch losses (the step's mean loss); None off the last stage."""
        return sum(self.losses.values()) if self.losses else None


class PipelineExecutor:
    """Runs `plan`'s actions for one rank, driving `runner` (a StageRunner) and the transport."""

    def __init__(self, plan, runner, *, rank: int | None = None, group=None, device="cpu",
                 options: ExecutorOptions | None = None):
        self.options = options or ExecutorOptions()
        if self.options.validate:
            check_runnable(plan)  # before touching torch.distributed: a bad plan sends nothing
        self.plan = plan
        self.runner = runner
        self.rank = dist.get_rank(group) if rank is None else rank
        size = dist.get_world_size(group)
        if size != plan.num_devices:
            raise ExecutorError(f"rank {self.rank}: plan has {plan.num_devices} devices, process group has {size} ranks",
                                rank=self.rank)
        self.program: RankProgram = build_program(plan, self.rank, self.options.prefetch)
        backend = dist.get_backend(group)
        pairs = direction_groups(plan, group) if backend != "gloo" else None
        self.transport = Transport(
            rank=self.rank, num_stages=plan.num_stages, recv_order=self.program.recv_order,
            meta_of=runner.boundary_meta, device=torch.device(device), timeout_s=self.options.timeout_s,
            group=group, pair_groups=pairs, tags=self.options.tags,
        )

    def run_step(self) -> StepResult:
        """Run every action of this rank once; returns its losses and timeline."""
        result = StepResult()
        local: dict[tuple[str, int, int], torch.Tensor] = {}
        last = self.plan.num_stages - 1
        tp = self.transport
        for step in self.program.steps:
            tp.post_upto(step.post_upto)
            a = step.action
            if step.recv is not None:
                inp = tp.recv(step.recv, a)
            else:
                key = local_input_key(a, self.plan.num_stages)
                inp = local.pop(key) if key is not None else None
            start = time.time()
            out = self._run(a, inp)
            result.timeline.append((a, start, time.time()))
            if a.kind is Kind.F and a.stage == last:
                result.losses[a.microbatch] = out.detach()
            elif a.kind is not Kind.W and (a.kind is Kind.F or a.stage > 0):
                if out is None:
                    raise ExecutorError(f"rank {self.rank}: {a} returned no tensor for the next stage",
                                        rank=self.rank, action=str(a))
                if step.send is not None:
                    tp.send(step.send, out, a)
                else:
                    local[local_output_key(a, self.plan.num_stages)] = out
            tp.reap()
        tp.finish()
        tp.reset()
        return result

    def _run(self, a: Action, inp: torch.Tensor | None):
        r, s, mb = self.runner, a.stage, a.microbatch
        if a.kind is Kind.F:
            return r.forward(s, mb, inp)
        if a.kind is Kind.B:
            return r.backward(s, mb, inp)
        if a.kind is Kind.I:
            return r.backward_input(s, mb, inp)
        return r.backward_weight(s, mb)
