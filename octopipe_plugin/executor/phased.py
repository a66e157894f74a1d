"""Phased stages: a stage as a list of compute and communication phases, and the runtime that overlaps two of them.

An overlapped pair `3F12+5B7` (docs/formats.md, "Overlapped pairs") hides one half's
communication (a MoE layer's dispatch and combine all-to-alls) behind the other half's
compute. That needs a stage the runtime can run phase by phase, which is this module's
protocol: a `PhasedModule` gives its forward as a list of phases, each either
- `Compute`: a function of the value (a tuple of tensors) to the next value, on the device; or
- `AllToAll`: an exchange of the value's last tensor over an expert-parallel process group,
  started asynchronously (`torch.distributed.all_to_all_single(..., async_op=True)`: gloo's
  async collectives on CPU; on CUDA issued on a communication stream, ordered by events), the
  other tensors passed on; its `Pending` handle is waited on by the next phase that needs it.

Every phase's input is cut from the graph (detached, requires_grad where it needs a gradient),
so the backward runs phase by phase too, in reverse: a compute phase's backward is autograd from
its output with the incoming gradient (the detached input's `.grad` feeds the phase before); a
communication phase's backward is the reverse all-to-all of the exchanged tensor's gradient,
asynchronous as well (with equal splits an all-to-all is its own transpose). The input-gradient
backward I and its weight pass W split each compute phase as the executor's split backward does
(split_backward.py).

The pair rule is the simulator's (simulator/pairs.overlap_ms): each half runs its phases in order,
compute phases share the device, communication phases the link, the phase that can start first
goes first, the first half on a tie. `simulator.pairs.overlap_order` replays that list schedule on the phases' nominal
durations (`ms`) and gives the order in which the host starts them: a communication phase is
started and left in flight while the other half computes, and waited on only when its own half's
next phase needs its result. The order is a pure function of the two phase lists, so every rank of
an expert-parallel group, running the same plan, issues its collectives in the same order.

`PhasedStages` is the StageRunner of such modules (F, B, I, W and the optional `pair`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ..actions import Action, Kind
from ..simulator.pairs import overlap_order
from .interface import LossOutput
from .split_backward import backward_input, backward_weight

Value = tuple  # the value between phases: a tuple of tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute:
    """A compute phase: `fn(*tensors)` -> a tuple of tensors (or one tensor); `params` those it reads (W's)."""

    fn: Callable
    params: tuple = ()
    ms: float = 1.0  # nominal duration: the weight of `simulator.pairs.overlap_order` (the same on every rank)
    name: str = "compute"
    comm = False


class Pending:
    """An asynchronous exchange in flight: `wait()` gives the value it makes (waiting on the work handle)."""

    __slots__ = ("_work", "_make", "_event", "_value")

    def __init__(self, work, make: Callable[[], Value], event=None):
        self._work, self._make, self._event, self._value = work, make, event, None

    def wait(self) -> Value:
        """The exchanged value; on CUDA the current stream waits for the communication stream's event."""
        if self._make is not None:
            if self._work is not None:
                self._work.wait()
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            self._value, self._make, self._work = self._make(), None, None
        return self._value


_streams: dict = {}


def comm_stream(device: torch.device):
    """The communication stream of a CUDA device (one per device and process)."""
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s


@dataclass(frozen=True, kw_only=True, slots=True)
class AllToAll:
    """A communication phase: the value's last tensor exchanged by an equal-split all-to-all over `group` along
    its first dimension (chunk j to rank j of the group), the other tensors passed on unchanged."""

    group: object = None
    ms: float = 1.0
    name: str = "all-to-all"
    comm = True

    def start(self, value: Value) -> Pending:
        """Start the exchange of `value[-1]` (asynchronous); the rest of `value` rides along."""
        return self._exchange(value[:-1], value[-1])

    def start_backward(self, grads: Value) -> Pending:
        """Start the reverse exchange of the last tensor's gradient (None stays None, sent nowhere)."""
        if grads[-1] is None:
            return Pending(None, lambda: tuple(grads))
        return self._exchange(grads[:-1], grads[-1])

    def _exchange(self, rest: Value, t: torch.Tensor) -> Pending:
        t = t.detach().contiguous()
        out = torch.empty_like(t)
        if t.is_cuda:  # a communication stream, ordered after the compute that made `t` and before its consumer
            stream = comm_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                work = dist.all_to_all_single(out, t, group=self.group, async_op=True)
                event = torch.cuda.Event()
                event.record(stream)
            t.record_stream(stream)
            out.record_stream(stream)
            return Pending(work, lambda: tuple(rest) + (out,), event)
        work = dist.all_to_all_single(out, t, group=self.group, async_op=True)
        return Pending(work, lambda: tuple(rest) + (out,))


Phase = Compute | AllToAll


@runtime_checkable
class PhasedModule(Protocol):
    """A stage whose forward is a list of phases (module docstring); `parameters()` its weights."""

    def phases(self) -> Sequence[Phase]:
        """The forward's phases in order; the first takes the stage input as a tuple of tensors."""

    def parameters(self):
        """Every weight of the stage (those that get a gradient)."""


def hidden_exchanges(trace: list) -> int:
    """Exchanges of a `PhasedStages` trace during which another action computed (started, then that action's
    compute phase run, then waited on): what an overlapped pair hides."""
    count, open_ = 0, {}
    for what, action, name in trace:
        if what == "start":
            open_[action] = False
        elif what == "run":
            for other in open_:
                if other != action:
                    open_[other] = True
        elif what == "wait" and action in open_:
            count += open_.pop(action)
    return count


def _add(dx: dict, t: torch.Tensor, g) -> None:
    if g is not None:
        prev = dx.get(id(t))
        dx[id(t)] = g if prev is None else prev + g


def _tuple(v) -> Value:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _leaves(value: Value, grad: bool) -> Value:
    """The value cut from the graph: float tensors as fresh leaves that require grad when `grad`."""
    return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                 for t in value)


@dataclass(kw_only=True, slots=True)
class _Saved:
    """What a compute phase keeps for its backward: its (detached) input leaves and its output."""

    inputs: Value
    outputs: Value


@dataclass(kw_only=True, slots=True)
class _Forwarded:
    """After F: per phase, what its backward needs (None for a communication phase)."""

    phases: list
    saved: list
    input_grad: bool  # whether the stage input takes a gradient (not on the first stage)


@dataclass(kw_only=True, slots=True)
class _InputDone:
    """After I: per compute phase, the weight work W finishes (split_backward.WeightWork, or (outs, gs) to run
    whole where the phase's input takes no gradient)."""

    work: list = field(default_factory=list)


class _Half:
    """One action's phases, run one at a time (`step`); a communication phase is left in flight until the next
    phase of the same half needs its value."""

    def __init__(self, tasks: list, value: Value, log: list | None = None, label: str = ""):
        self.tasks, self.value, self.k, self.pending = tasks, value, 0, None
        self.log, self.label = log, label

    def seq(self) -> list[tuple[bool, float]]:
        return [(t.comm, t.ms) for t in self.tasks]

    def _wait(self) -> None:
        self.value, self.pending = self.pending.wait(), None
        if self.log is not None:
            self.log.append(("wait", self.label, self.tasks[self.k - 1].name))

    def step(self) -> None:
        if self.pending is not None:
            self._wait()
        t = self.tasks[self.k]
        self.k += 1
        if self.log is not None:
            self.log.append(("start" if t.comm else "run", self.label, t.name))
        if t.comm:
            self.pending = t.start(self.value)
        else:
            self.value = t.run(self.value)

    def finish(self) -> Value:
        while self.k < len(self.tasks):
            self.step()
        if self.pending is not None:
            self._wait()
        return self.value


@dataclass(kw_only=True, slots=True)
class _Task:
    comm: bool
    ms: float
    name: str
    run: Callable | None = None
    start: Callable | None = None


def run_pair(first: _Half, second: _Half) -> tuple[Value, Value]:
    """Run two halves interleaved in `simulator.pairs.overlap_order`'s order; both values once both halves are done."""
    order, _ = overlap_order(first.seq(), second.seq())
    halves = (first, second)
    for k in order:
        halves[k].step()
    return first.finish(), second.finish()


class PhasedStages:
    """StageRunner of `PhasedModule` stages (module docstring): F, B, I, W run phase by phase, and `pair` runs an
    overlapped pair's two halves interleaved, each half's all-to-alls in flight while the other computes.

    - `modules[s]`: the module of each stage this rank owns; `metas[s]` the TensorMeta of stage s's output;
    - `load_input(mb)`: stage 0's input (a tensor or tuple); `loss_fn(output, mb)`: the last stage's loss of
      its output value (a tuple), divided by `num_microbatches` (the step's loss is the sum);
    - `trace`: a list that gets ("run" | "start" | "wait", action, phase name) for every compute phase run,
      exchange started and exchange waited on (None: nothing recorded).
    """

    def __init__(self, *, modules: Mapping[int, PhasedModule], num_stages: int, num_microbatches: int,
                 metas: Sequence, load_input: Callable[[int], object], loss_fn: Callable, loss_ms: float = 0.0,
                 trace: list | None = None):
        self.modules = dict(modules)
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.metas = tuple(metas)
        self.load_input = load_input
        self.loss_fn = loss_fn
        self.loss_ms = loss_ms
        self.state: dict[tuple[int, int], object] = {}
        self.pairs_run = 0  # overlapped pairs run through `pair` (tests read it)
        self.trace = trace

    def boundary_meta(self, stage: int):
        """Meta of stage `stage`'s output."""
        return self.metas[stage]

    def pending(self) -> int:
        """(stage, micro-batch) states still held (0 after a complete step)."""
        return len(self.state)

    # ----- the phases of one action

    def _phases(self, stage: int, mb: int) -> list:
        phases = list(self.modules[stage].phases())
        if stage == self.num_stages - 1:  # the loss: one more compute phase, of this micro-batch
            phases.append(Compute(fn=lambda *out: self.loss_fn(out, mb) / self.num_microbatches, ms=self.loss_ms,
                                  name="loss"))
        return phases

    def _forward_half(self, stage: int, mb: int, inputs, forward_only: bool) -> tuple[_Half, Callable]:
        phases = self._phases(stage, mb)
        keep = not forward_only
        first_grad = keep and stage > 0
        value = _tuple(self.load_input(mb) if stage == 0 else inputs)
        saved: list = [None] * len(phases)
        tasks = []
        for k, ph in enumerate(phases):
            if ph.comm:
                tasks.append(_Task(comm=True, ms=ph.ms, name=ph.name, start=ph.start))
                continue

            def run(v, k=k, ph=ph):
                x = _leaves(v, keep and (k > 0 or first_grad))
                with torch.enable_grad() if keep else torch.no_grad():
                    y = _tuple(ph.fn(*x))
                if keep:
                    saved[k] = _Saved(inputs=x, outputs=y)
                return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in y)

            tasks.append(_Task(comm=False, ms=ph.ms, name=ph.name, run=run))

        def done(out: Value):
            if keep:
                self.state[(stage, mb)] = _Forwarded(phases=phases, saved=saved, input_grad=first_grad)
            if stage == self.num_stages - 1:
                return LossOutput(loss=out[0].detach())
            return out[0] if len(out) == 1 else out

        return _Half(tasks, value, self.trace, f"{stage}F{mb}"), done

    def _backward_half(self, stage: int, mb: int, grad_output, kind: Kind) -> tuple[_Half, Callable]:
        fwd: _Forwarded = self.state[(stage, mb)]
        split = kind is Kind.I
        work = _InputDone()
        if stage == self.num_stages - 1:
            loss = fwd.saved[-1].outputs[0]
            grads: Value = (torch.ones_like(loss),)
        else:
            grads = _tuple(grad_output)
        tasks = []
        for k in reversed(range(len(fwd.phases))):
            ph = fwd.phases[k]
            if ph.comm:
                tasks.append(_Task(comm=True, ms=ph.ms, name=ph.name, start=ph.start_backward))
                continue

            def run(g, k=k, ph=ph):
                s: _Saved = fwd.saved[k]
                fwd.saved[k] = None
                ins = [t for t in s.inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                in_ids = {id(t) for t in ins}
                dx: dict[int, torch.Tensor] = {}
                outs, gs = [], []
                for o, gi in zip(s.outputs, g, strict=True):
                    if gi is None or not isinstance(o, torch.Tensor) or not o.requires_grad:
                        continue
                    if id(o) in in_ids:  # an input passed on unchanged (a residual): its gradient goes back as is
                        _add(dx, o, gi)
                    else:
                        outs.append(o)
                        gs.append(gi)
                if outs and split and ins:
                    dins, w = backward_input(outs, gs, ins, [p for p in ph.params if p.requires_grad])
                    work.work.append(w)
                    for t, d in zip(ins, dins):
                        _add(dx, t, d)
                elif outs and split:  # nothing to give the phase before: the whole phase is W's
                    work.work.append((outs, gs))
                elif outs:
                    for t in ins:
                        t.grad = None
                    torch.autograd.backward(outs, gs)
                    for t in ins:
                        _add(dx, t, t.grad)
                        t.grad = None
                return tuple(dx.get(id(t)) if isinstance(t, torch.Tensor) else None for t in s.inputs)

            tasks.append(_Task(comm=False, ms=ph.ms, name=ph.name, run=run))

        def done(dx: Value):
            if split:
                self.state[(stage, mb)] = work
            else:
                del self.state[(stage, mb)]
            if stage == 0:
                return None
            return dx[0] if len(dx) == 1 else dx

        return _Half(tasks, grads, self.trace, f"{stage}{kind.value}{mb}"), done

    # ----- StageRunner

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """F: every phase in order (each all-to-all waited on by the phase after it)."""
        half, done = self._forward_half(stage, mb, inputs, forward_only)
        return done(half.finish())

    def backward(self, stage: int, mb: int, grad_output):
        """B: every phase's backward in reverse order, input and weight gradients together."""
        half, done = self._backward_half(stage, mb, grad_output, Kind.B)
        return done(half.finish())

    def backward_input(self, stage: int, mb: int, grad_output):
        """I: every phase's input gradient in reverse order; the weight work kept for W."""
        half, done = self._backward_half(stage, mb, grad_output, Kind.I)
        return done(half.finish())

    def backward_weight(self, stage: int, mb: int) -> None:
        """W: the weight work I deferred, phase by phase."""
        work = self.state.pop((stage, mb))
        for w in work.work:
            if isinstance(w, tuple):
                torch.autograd.backward(w[0], w[1])
            else:
                backward_weight(w, "autograd")

    def pair(self, first: Action, first_input, second: Action, second_input, *, batch=None,
             last_backward: bool = False):
        """An overlapped pair: `first`'s F and `second`'s B or I interleaved phase by phase (pairs.overlap_order)."""
        if first.kind is not Kind.F or second.kind not in (Kind.B, Kind.I):
            raise ValueError(f"pair {first}+{second}: PhasedStages pairs an F with a B or I")
        fh, fdone = self._forward_half(first.stage, first.microbatch, first_input, False)
        bh, bdone = self._backward_half(second.stage, second.microbatch, second_input, second.kind)
        out_f, out_b = run_pair(fh, bh)
        self.pairs_run += 1
        return fdone(out_f), bdone(out_b)
