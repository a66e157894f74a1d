"""The executor: runs one rank's action list of a plan over torch.distributed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from ..actions import Action, Kind
from .comm import Transport
from .comm_cache import CommCache, default_cache
from .data import StepData
from .errors import ExecutorError
from .interface import LossOutput
from .program import RankProgram, build_program, local_input_key, local_output_key
from .validate import check_runnable, is_forward_only


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorOptions:
    """How the executor waits and posts: every wait is bounded by `timeout_s`."""

    timeout_s: float = 60.0
    prefetch: int = 2  # post each receive this many actions before its consumer
    validate: bool = True
    # gloo honours tags; False sends every message with tag 0 so only the per-peer order matches them,
    # which is what NCCL does (lets gloo tests prove the order rule alone is right)
    tags: bool = True
    # one process group per direction of each rank pair: None = where the backend needs it (not gloo)
    pair_groups: bool | None = None
    # keep receive buffers for the next step (and the next executor on the same plan and group)
    reuse_buffers: bool = True


@dataclass(kw_only=True)
class StepResult:
    """One step on one rank: what the last stage's loss reported per micro-batch, and every action's span."""

    outputs: dict[int, LossOutput] = field(default_factory=dict)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    forward_only: bool = False

    @property
    def losses(self) -> dict[int, torch.Tensor]:
        """Micro-batch -> its scaled loss (detached); empty off the last stage."""
        return {mb: out.loss for mb, out in sorted(self.outputs.items())}

    @property
    def loss(self) -> torch.Tensor | None:
        """Sum of the scaled micro-batch losses (the step's mean loss); None off the last stage."""
        return sum(self.losses.values()) if self.outputs else None

    @property
    def num_tokens(self):
        """Sum of the tokens the loss function reported (None when it reported none, or off the last stage)."""
        counts = [o.num_tokens for o in self.outputs.values() if o.num_tokens is not None]
        return sum(counts) if counts else None

    @property
    def logs(self) -> list:
        """The loss function's dict of each micro-batch, in micro-batch order (None where it gave none)."""
        return [out.logs for _, out in sorted(self.outputs.items())]


def forward_plan(plan, num_microbatches: int | None = None):
    """The plan with only its F actions (evaluation): every device keeps its forwards in the same order.

    With `num_microbatches` other than the plan's (an evaluation batch of another size), the
    forwards of that many micro-batches on the plan's stages and placement, each device in
    (micro-batch, stage) order: one global topological order, so no device waits on a later one.
    """
    if num_microbatches is None or num_microbatches == plan.num_microbatches:
        return replace(plan, schedule=tuple(tuple(a for a in row if a.kind is Kind.F) for row in plan.schedule))
    rows = tuple(tuple(Action(s, Kind.F, mb) for mb in range(num_microbatches) for s in plan.stages_of(d))
                 for d in range(plan.num_devices))
    return replace(plan, num_microbatches=num_microbatches, schedule=rows)


class PipelineExecutor:
    """Runs `plan`'s actions for one rank, driving `runner` (a StageRunner) and the transport.

    `on_last_backward(stage)` is called right after the stage's last B or W of a training step
    (its weight gradients are complete), so a framework can start that stage's gradient
    reduction while other stages still compute. Communicators and receive buffers come from
    `cache` (the process-wide `default_cache()` unless given).
    """

    def __init__(self, plan, runner, *, rank: int | None = None, group=None, device="cpu",
                 options: ExecutorOptions | None = None, cache: CommCache | None = None,
                 on_last_backward: Callable[[int], None] | None = None):
        self.options = options or ExecutorOptions()
        if self.options.validate:
            check_runnable(plan)  # before touching torch.distributed: a bad plan sends nothing
        self.plan = plan
        self.runner = runner
        self.on_last_backward = on_last_backward
        self.rank = dist.get_rank(group) if rank is None else rank
        size = dist.get_world_size(group)
        if size != plan.num_devices:
            raise ExecutorError(f"rank {self.rank}: plan has {plan.num_devices} devices, process group has {size} ranks",
                                rank=self.rank)
        self.cache = cache or default_cache()
        self.device = torch.device(device)
        self.group = group
        self.evaluation_only = is_forward_only(plan)
        self.programs: dict[bool, RankProgram] = {False: build_program(plan, self.rank, self.options.prefetch)}
        self.last_backward = _last_backward(self.programs[False])
        use_pairs = self.options.pair_groups
        if use_pairs is None:
            use_pairs = dist.get_backend(group) != "gloo"
        self.pair_groups = self.cache.direction_groups(plan, group) if use_pairs else None
        self.buffers = self.cache.buffers_of(plan, group) if self.options.reuse_buffers else None
        self._transports: dict[bool, Transport] = {}

    @property
    def transport(self) -> Transport:
        """The transport of training steps (of evaluation steps for a forward-only plan)."""
        return self._transport(self.evaluation_only)

    def _transport(self, forward_only: bool) -> Transport:
        tp = self._transports.get(forward_only)
        if tp is None:
            prog = self._program(forward_only)
            tp = self._transports[forward_only] = Transport(
                rank=self.rank, num_stages=self.plan.num_stages, recv_order=prog.recv_order,
                send_order=prog.send_order, device=self.device, timeout_s=self.options.timeout_s, group=self.group,
                pair_groups=self.pair_groups, tags=self.options.tags, buffers=self.buffers)
        return tp

    def _program(self, forward_only: bool) -> RankProgram:
        if forward_only not in self.programs:
            self.programs[True] = build_program(forward_plan(self.plan), self.rank, self.options.prefetch)
        return self.programs[forward_only]

    def run_step(self, data=None, *, forward_only: bool = False) -> StepResult:
        """Run every action of this rank once (only the forwards when `forward_only`).

        `data` is the step's data source: None (the runner loads its own), one iterable of
        micro-batches shared by this rank's stages, or a mapping stage -> iterable; each
        forward gets micro-batch mb of it as `batch`.
        """
        forward_only = forward_only or self.evaluation_only  # a plan of forwards only is an evaluation plan
        ns = self.plan.num_stages
        result = StepResult(forward_only=forward_only)
        batches = StepData(data, self.plan.stages_of(self.rank), self.plan.num_microbatches, self.rank)
        local: dict[tuple[str, int, int], object] = {}
        tp = self._transport(forward_only)
        tp.begin({s: self.runner.boundary_meta(s) for s in range(ns - 1)}, forward_only)
        for i, step in enumerate(self._program(forward_only).steps):
            tp.post_upto(step.post_upto)
            a = step.action
            if step.recv is not None:
                inp = tp.recv(step.recv, a)
            else:
                key = local_input_key(a, ns)
                inp = local.pop(key) if key is not None else None
            start = time.time()
            out = self._run(a, inp, batches, forward_only)
            result.timeline.append((a, start, time.time()))
            if a.kind is Kind.F and a.stage == ns - 1:
                result.outputs[a.microbatch] = _loss_output(out, self.rank, a)
            elif a.output_stage(ns) is not None:
                if step.send is not None:
                    tp.send(step.send, out, a)
                else:
                    local[local_output_key(a, ns)] = out
            if not forward_only and self.on_last_backward is not None and self.last_backward.get(a.stage) == i:
                self.on_last_backward(a.stage)
            tp.reap()
        tp.finish()
        tp.reset()
        return result

    def _run(self, a: Action, inp, batches: StepData, forward_only: bool):
        r, s, mb = self.runner, a.stage, a.microbatch
        if a.kind is Kind.F:
            return r.forward(s, mb, inp, batch=batches.get(s, mb), forward_only=forward_only)
        if a.kind is Kind.B:
            return r.backward(s, mb, inp)
        if a.kind is Kind.I:
            return r.backward_input(s, mb, inp)
        return r.backward_weight(s, mb)


def _last_backward(program: RankProgram) -> dict[int, int]:
    """Stage -> index of its last weight-gradient action (B or W) in the rank's program: after it, the
    stage's weight gradients are final."""
    out: dict[int, int] = {}
    for i, step in enumerate(program.steps):
        if "wgrad" in step.action.rule.cost:
            out[step.action.stage] = i
    return out


def _loss_output(out, rank: int, action: Action) -> LossOutput:
    if isinstance(out, LossOutput):
        return out
    if isinstance(out, torch.Tensor):
        return LossOutput(loss=out.detach())
    raise ExecutorError(f"rank {rank}: {action} (last stage) returned {type(out).__name__}: expected the loss "
                        f"tensor or a LossOutput", rank=rank, action=str(action))
