"""The executor: runs one rank's action list of a plan over torch.distributed."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..actions import Action, Kind
from ..formats.splits import side_of
from ..schedules.split_messages import WHATS
from ..schedules.messages import device_positions
from .comm import Transport
from .comm_cache import CommCache, default_cache
from .data import StepData
from .errors import ExecutorError
from .interface import (
    FORWARD_ONLY, LAST_BACKWARD, PAIR_METHOD, RUNNER_METHODS, SHARD_METHODS, LossOutput, check_evaluation,
    check_runner,
)
from .lowered import LoweredPlan, forward_plan, lowered_plan
from .nccl_rules import check_nccl_rules
from .program import RankProgram, local_input_key, local_output_key
from .validate import check_runnable

__all__ = ["ExecutorOptions", "PipelineExecutor", "StepResult", "forward_plan"]


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
    # keep receive buffers for the next step (and the next executor on the same plan and group); False: each
    # step receives into buffers of its own
    reuse_buffers: bool = True
    # initialise every per-direction communicator when the executor is built, all ranks in one global order
    # (sorted pair, direction); False leaves NCCL to create each at its first use inside a step, which
    # deadlocks 1F1B-like plans (executor.nccl_rules refuses such a plan on a non-gloo backend)
    eager_comms: bool = True
    # "message" (each message issued when ready) or "batched" (a step's ready sends and receives issued as one
    # batch_isend_irecv per peer); None: the backend's default (comm.DEFAULT_EXCHANGE)
    exchange: str | None = None
    # give the core up once after posting sends (comm.py YIELD_AFTER_SEND); None: the backend's default (gloo: yes)
    yield_after_send: bool | None = None
    # Python's cyclic collector paused during a step's actions and let run again after it (Megatron's
    # --manual-gc does the same between iterations): a full pass inside a split backward's I, whose pending
    # W hold many objects, cost ~8 ms per action on MoE stages (benchmarks/action_costs.py --no-gc) —
    # time the profile never sees. False: the collector runs whenever its thresholds say.
    pause_gc: bool = True


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


class PipelineExecutor:
    """Runs `plan`'s actions for one rank, driving `runner` (a StageRunner) and the transport.

    The runner's interface is checked here (`interface.check_runner`), against the kinds of
    this rank's actions. A runner method that accepts `last_backward=` is told, before it
    runs, whether the call is its stage's last weight-gradient action of a training step;
    `on_last_backward(stage)` is called right after that action (its weight gradients are
    complete), so a framework can start that stage's gradient reduction while other stages
    still compute. An overlapped pair of the plan (`Plan.pairs`) waits for both halves'
    inputs, runs through the runner's optional `pair` (else half after half) and then hands
    on the first half's output and the second's. Communicators and receive buffers come from `cache` (the process-wide
    `default_cache()` unless given). Everything derived from the plan is `self.lowered`
    (`executor.lowered.lowered_plan`).
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
        if not 0 <= self.rank < plan.num_devices:
            raise ExecutorError(f"rank {self.rank}: the plan has devices 0..{plan.num_devices - 1}", rank=self.rank)
        self.lowered: LoweredPlan = lowered_plan(plan, self.rank, self.options.prefetch)
        # before any message: a runner that cannot take the executor's calls fails here, not at its first action
        self.binding = check_runner(runner, {a.kind for a in plan.schedule[self.rank]} | {Kind.F},
                                    split=any(st.shard is not None for st in self.lowered.program.steps),
                                    pairs=bool(self.lowered.program.pair_starts))
        # with a split LM head the loss is the shards' (their J), not the last stage's F
        self.head_split = any(side_of(sp, plan.stages[-1].end) == "output" for sp in plan.splits)
        size = dist.get_world_size(group)
        if size != plan.num_devices:
            raise ExecutorError(f"rank {self.rank}: plan has {plan.num_devices} devices, process group has {size} ranks",
                                rank=self.rank)
        self.cache = cache or default_cache()
        self.device = torch.device(device)
        self.group = group
        self.evaluation_only = self.lowered.forward_only
        gloo = dist.get_backend(group) == "gloo"
        use_pairs = self.options.pair_groups
        if use_pairs is None:
            use_pairs = not gloo
        if self.options.validate and not gloo:
            # NCCL creates communicators lazily and orders each one's operations: refuse a hang before any send
            # the CUDA lane waits on the stream (lanes.CudaLane), any other lane blocks the host
            check_nccl_rules(plan, prefetch=self.options.prefetch, pair_groups=use_pairs,
                             eager=self.options.eager_comms, host_waits=self.device.type != "cuda")
        self.pair_groups = (self.cache.direction_groups(plan, group, warm_up=self.options.eager_comms,
                                                        device=self.device, timeout_s=self.options.timeout_s)
                            if use_pairs else None)
        # a split head's statistics travel by one all-gather per micro-batch over its shards: their group made now
        self.gather_groups = self.cache.gather_groups(plan, group, device=self.device, timeout_s=self.options.timeout_s)
        self.buffers = self.cache.buffers_of(plan, group) if self.options.reuse_buffers else None
        self._transports: dict[tuple[bool, int], Transport] = {}

    @property
    def transport(self) -> Transport:
        """The transport of training steps (of evaluation steps for a forward-only plan)."""
        return self._transport(self._lowered_for(self.evaluation_only, None))

    def program(self, forward_only: bool = False, num_microbatches: int | None = None) -> RankProgram:
        """This rank's program of a training step, or of an evaluation step of `num_microbatches`."""
        return self._lowered_for(forward_only, num_microbatches).program

    def _lowered_for(self, forward_only: bool, num_microbatches: int | None) -> LoweredPlan:
        m = self.plan.num_microbatches if num_microbatches is None else num_microbatches
        if forward_only or self.evaluation_only:
            return self.lowered.forward(m)
        if m != self.plan.num_microbatches:
            raise ExecutorError(f"rank {self.rank}: a training step runs the plan's {self.plan.num_microbatches} "
                                f"micro-batches, got num_microbatches={m} (only evaluation, forward_only=True, "
                                f"may use another count)", rank=self.rank)
        return self.lowered

    def _transport(self, low: LoweredPlan) -> Transport:
        key = (low.forward_only, low.plan.num_microbatches)
        tp = self._transports.get(key)
        if tp is None:
            prog = low.program
            tp = self._transports[key] = Transport(
                rank=self.rank, num_stages=self.plan.num_stages, recv_order=prog.recv_order,
                send_order=prog.send_order, device=self.device, timeout_s=self.options.timeout_s, group=self.group,
                pair_groups=self.pair_groups, tags=self.options.tags, buffers=self.buffers,
                exchange=self.options.exchange, positions=device_positions(low.plan),
                yield_after_send=self.options.yield_after_send, gather_groups=self.gather_groups)
        return tp

    def run_step(self, data=None, *, forward_only: bool = False, num_microbatches: int | None = None) -> StepResult:
        """Run every action of this rank once (only the forwards when `forward_only`).

        `data` is the step's data source: None (the runner loads its own), one iterable of
        micro-batches shared by this rank's stages, or a mapping stage -> iterable; each
        forward gets micro-batch mb of it as `batch`. An evaluation (`forward_only`) may run
        another `num_microbatches` than the plan's (`lowered.forward_plan`).
        """
        paused = self.options.pause_gc and gc.isenabled()  # a collector the user switched off stays off
        if paused:
            gc.disable()
        try:
            return self._run_step(data, forward_only=forward_only, num_microbatches=num_microbatches)
        finally:
            if paused:
                gc.enable()

    def _run_step(self, data, *, forward_only: bool, num_microbatches: int | None) -> StepResult:
        forward_only = forward_only or self.evaluation_only  # a plan of forwards only is an evaluation plan
        low = self._lowered_for(forward_only, num_microbatches)
        if forward_only and self.plan.splits:  # a shard method without forward_only= fails here, not mid-step
            check_evaluation(self.runner, self.binding, {st.action.kind for st in low.program.steps})
        ns = self.plan.num_stages
        result = StepResult(forward_only=forward_only)
        batches = StepData(data, self.plan.stages_of(self.rank), low.plan.num_microbatches, self.rank)
        local: dict[tuple[str, int, int], object] = {}
        tp = self._transport(low)
        split_metas = ({w: self.runner.split_meta(w) for w in WHATS}
                       if any(st.shard is not None for st in low.program.steps) else None)
        tp.begin({s: self.runner.boundary_meta(s) for s in range(ns - 1)}, forward_only, split_metas)
        steps, starts = low.program.steps, low.program.pair_starts
        i = 0
        while i < len(steps):
            if i in starts:  # an overlapped pair: steps i and i + 1 as one unit
                self._run_pair(i, steps[i], steps[i + 1], low, tp, local, batches, result)
                i += 2
                continue
            step = steps[i]
            tp.post_upto(step.post_upto)
            a = step.action
            inp = self._input(step, tp, local, ns)
            last = not forward_only and low.is_last_backward(i, a)
            start = time.time()
            out = self._run(a, inp, batches, forward_only, last)
            result.timeline.append((a, start, time.time()))
            self._hand_on(step, out, last, tp, local, result, ns)
            tp.end_sends()
            tp.reap()
            i += 1
        tp.finish()
        tp.reset()
        return result

    def _input(self, step, tp: Transport, local: dict, ns: int):
        """What a step's action takes: its received or same-device input, with a split layer's hand-overs."""
        a = step.action
        if step.recv is not None:
            inp = tp.recv(step.recv, a)
        else:
            key = local_input_key(a, ns)
            inp = local.pop(key) if key is not None else None
        takes = step.shard.takes if step.shard is not None else ()
        if step.shard is not None and step.shard.awaits is not None:
            inp = tp.gathered(step.shard.awaits, a)  # a J: every other shard's statistics, in shard-device order
        elif takes or a.kind is Kind.J:  # a J of the only shard takes no peer statistics
            inp = taken(a, [tp.recv(t.msg, a) if t.msg is not None else local.pop(t.key) for t in takes])
        return inp

    def _hand_on(self, step, out, last: bool, tp: Transport, local: dict, result: StepResult, ns: int) -> None:
        """Send or keep what a step's action made (and take the loss it reports)."""
        a = step.action
        if a.kind is Kind.J:  # a head shard: its partial goes on (not in evaluation), every shard reports the loss
            out, loss = out
            result.outputs[a.microbatch] = _loss_output(loss, self.rank, a)
        if step.shard is not None:
            if step.shard.starts is not None:  # an H: its statistics into the micro-batch's all-gather
                tp.start_gather(step.shard.starts, out, a)
            for msg in step.shard.sends:
                tp.send(msg, out, a)
            for key in step.shard.keeps:
                local[key] = out
        if a.kind is Kind.F and a.stage == ns - 1 and not self.head_split:
            result.outputs[a.microbatch] = _loss_output(out, self.rank, a)
        elif a.output_stage(ns) is not None:
            if step.send is not None:
                tp.send(step.send, out, a)
            else:
                local[local_output_key(a, ns)] = out
        if last and self.on_last_backward is not None and a.rule.side is None:  # a stage's, not a shard's
            self.on_last_backward(a.stage)

    def _run_pair(self, i: int, first, second, low: LoweredPlan, tp: Transport, local: dict, batches: StepData,
                  result: StepResult) -> None:
        """An overlapped pair (steps i, i + 1; docs/formats.md, "Overlapped pairs"): both halves' receives posted
        and awaited first, then the runner's `pair` (or, without one, the halves one after the other), then the
        first half's output handed on, then the second's. A pair runs in training steps only (lowered.forward_plan
        runs every forward alone)."""
        ns = self.plan.num_stages
        tp.post_upto(first.post_upto)  # it covers the second half's receives (program.build_program)
        tp.post_upto(second.post_upto)
        a, b = first.action, second.action
        inp_a = self._input(first, tp, local, ns)
        inp_b = self._input(second, tp, local, ns)
        last_a, last_b = low.is_last_backward(i, a), low.is_last_backward(i + 1, b)
        start = time.time()
        if self.binding.runs_pairs:
            kw = {LAST_BACKWARD: last_b} if PAIR_METHOD in self.binding.takes_last_backward else {}
            batch = batches.get(a.stage, a.microbatch) if a.kind is Kind.F else None
            got = self.runner.pair(a, inp_a, b, inp_b, batch=batch, **kw)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise ExecutorError(f"rank {self.rank}: pair {a}+{b}: the runner's pair() returned "
                                    f"{type(got).__name__}: expected (first's output, second's output)",
                                    rank=self.rank, action=f"{a}+{b}")
            out_a, out_b = got
            end = time.time()
            result.timeline.append((a, start, end))
            result.timeline.append((b, start, end))
        else:
            out_a = self._run(a, inp_a, batches, False, last_a)
            mid = time.time()
            result.timeline.append((a, start, mid))
            out_b = self._run(b, inp_b, batches, False, last_b)
            result.timeline.append((b, mid, time.time()))
        self._hand_on(first, out_a, last_a, tp, local, result, ns)
        self._hand_on(second, out_b, last_b, tp, local, result, ns)
        tp.end_sends()
        tp.reap()

    def _run(self, a: Action, inp, batches: StepData, forward_only: bool, last: bool):
        r, s, mb = self.runner, a.stage, a.microbatch
        if a.kind is Kind.F:
            return r.forward(s, mb, inp, batch=batches.get(s, mb), forward_only=forward_only)
        name = RUNNER_METHODS[a.kind]
        kw = {LAST_BACKWARD: last} if name in self.binding.takes_last_backward else {}
        if a.kind in SHARD_METHODS:
            if forward_only:  # an evaluation step: H, J and E keep nothing (J gives no partial)
                kw = {FORWARD_ONLY: True}
            return getattr(r, name)(s, mb, *(() if a.kind in (Kind.K, Kind.E) else (inp,)), **kw)
        if a.kind is Kind.W:
            return r.backward_weight(s, mb, **kw)
        return getattr(r, name)(s, mb, inp, **kw)


def taken(action: Action, values: list):
    """What an action gets from a split layer's hand-overs (in shard-device order): a J the other shards'
    statistics, an owner stage's F (embedding) or B/I (head) the sum of the partials, any other the one value."""
    if action.kind is Kind.J:
        return tuple(values)
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _loss_output(out, rank: int, action: Action) -> LossOutput:
    if isinstance(out, LossOutput):
        return out
    if isinstance(out, torch.Tensor):
        return LossOutput(loss=out.detach())
    raise ExecutorError(f"rank {rank}: {action} (last stage) returned {type(out).__name__}: expected the loss "
                        f"tensor or a LossOutput", rank=rank, action=str(action))
