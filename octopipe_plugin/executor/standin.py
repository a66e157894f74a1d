"""Sleeping stand-in stages: each action sleeps its (scaled) cost, each message says what it is.

A boundary carries one payload per model output live across it (a branched model's cut,
e.g. a vision encoder's and the text embedding's outputs, carries several: graph.py), each
[micro-batch, producing stage, direction (0 act, 1 grad), send time, producing layer]; the
consumer checks all but the send time against what it expects and, to charge the link, does
not use the payload before `send time + transfer time` (processes share the host clock),
which is the simulator's model of a transfer with full overlap. Sleeping costs no CPU, so
many ranks fit on a laptop's few cores.

A split layer's shard actions (docs/formats.md, "Split layers") sleep the device's share of the
layer's costs, and its hand-overs travel as messages too. The executor sums the partials an
owner takes, so a split payload is summable: [micro-batch, what, count, 0, 0, then one slot per
device holding the send time of the device that made it]; the consumer checks micro-batch and
kind (divided by the count) and waits for the latest slot plus that sender's transfer time.
The shard half is `SleepShards`, one object any runner takes as its `shards=` (the dry run's
SleepStages, and the Megatron and DeepSpeed stand-in benchmarks beside their framework's own
stage runner), so every stand-in shard pass and hand-over follows one rule. A framework's
hand-over has the framework's shape (its hidden state, `hand_over=`): the same summable layout
sits in its first elements (`split_stamp`, `split_ready`); a producer that does not know the
micro-batch (a framework layer) writes -1 there and the consumer checks the kind only.

On the 'wall' clock nothing is stamped from the model: the first payload of a boundary
between devices is as large as the model's bytes across that cut (`payload_bytes`; the header
in its first five elements) and really travels, and the consumer uses it when its receive has
completed (a split layer's hand-overs keep their small summable payloads).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from ..actions import Kind
from ..simulator.costs import hop_times
from ..simulator.pairs import StagePhases
from ..schedules.split_messages import SIDE_OF, WHATS
from .clock import DeviceClock, wall_numel
from .errors import ExecutorError
from .interface import LossOutput, TensorMeta
from ..simulator.pairs import overlap_order

_HEADER = 5  # [micro-batch, producing stage, direction, send time, producing layer]
_PAYLOAD = TensorMeta(shape=(_HEADER,), dtype=torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class StandInCosts:
    """Per-stage scaled durations (ms) and per-boundary transfer time (ms, 0 on the same device)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    hop: tuple[float, ...]  # hop[s]: stage s -> s+1 (and the gradient back)
    # payload_bytes[s]: what boundary s's first payload carries on the wall clock (empty: headers only)
    payload_bytes: tuple[int, ...] = ()
    shards: tuple["ShardCosts", ...] = ()  # the plan's split layers
    # per stage, the (scaled) phase sequences of its F, I and B (simulator/pairs.stage_phases): what an overlapped
    # pair sleeps phase by phase; None: no layer communicates (a pair sleeps its two costs back to back)
    phases: StagePhases | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardCosts:
    """One split layer's scaled costs (ms, the whole layer: a shard sleeps its share) and hand-over times."""

    side: str  # "output" (LM head) or "input" (embedding)
    owner: int
    devices: tuple[int, ...]
    shares: tuple[float, ...]
    fwd: float
    bwd: float
    wgrad: float
    link_ms: tuple[tuple[float, ...], ...]  # [src][dst]: the owner <-> shard hand-over (0 on one device)
    stats_ms: tuple[tuple[float, ...], ...]  # [src][dst]: one head shard's statistics to another (their all-gather)
    # [src][dst]: the head's input with its loss terms (simulator.split.message_bytes); empty: link_ms
    input_ms: tuple[tuple[float, ...], ...] = ()

    def share(self, device: int) -> float:
        """The device's share of the layer."""
        return self.shares[self.devices.index(device)]


_SPLIT_HEADER = 5  # [micro-batch (-1: not known to the producer), kind, count, 0, 0], then one slot per device


def split_numel(num_devices: int) -> int:
    """Elements a summable hand-over needs: the header and one send-time slot per device."""
    return _SPLIT_HEADER + num_devices


def split_stamp(what: str, mb: int, device: int, sent: float, num_devices: int, shape=None,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A summable hand-over of `what` made by `device` at `sent` (in the first elements of a tensor of `shape`)."""
    t = torch.zeros(shape if shape is not None else (split_numel(num_devices),), dtype=dtype)
    flat = t.view(-1)
    if flat.numel() < split_numel(num_devices):
        raise ValueError(f"a split hand-over over {num_devices} devices needs {split_numel(num_devices)} elements, "
                         f"shape {tuple(t.shape)} has {flat.numel()}")
    flat[0], flat[1], flat[2], flat[_SPLIT_HEADER + device] = mb, WHATS.index(what), 1.0, sent
    return t


def split_ready(value, what: str, mb: int, link_ms, *, rank: int, action: str) -> float:
    """Check a (possibly summed) hand-over of `what`; when its last part lands (`link_ms(j)`: ms from device j).

    `mb` < 0 (the consumer does not know it) or a producer's -1 leaves the micro-batch unchecked."""
    flat = _tensor_of(value).detach().reshape(-1).to(torch.float64)
    n = float(flat[2]) if flat.numel() > 2 else 0.0
    got = (round(float(flat[0]) / n), round(float(flat[1]) / n)) if n > 0 else None
    unknown = got is not None and (mb < 0 or got[0] < 0)
    if got is None or got[1] != WHATS.index(what) or (not unknown and got[0] != mb):
        raise ExecutorError(f"rank {rank}: {action} received split payload {got} (micro-batch, kind), "
                            f"expected micro-batch {mb} of {what!r}", rank=rank, action=action)
    slots = flat[_SPLIT_HEADER:].tolist()
    return max((t + link_ms(j) / 1000.0 for j, t in enumerate(slots) if t > 0), default=0.0)


def _coef_of(value) -> torch.Tensor | None:
    """The loss coefficients a HeadInput-like hand-over carries (its third field), None when it has none."""
    coef = getattr(value, "coef", None)
    if coef is None and isinstance(value, (tuple, list)) and len(value) > 2:
        coef = value[2]
    return coef.detach() if isinstance(coef, torch.Tensor) else None


def _tensor_of(value) -> torch.Tensor:
    """The hand-over tensor of a value: itself, or the first field of a HeadInput-like tuple / object (hidden)."""
    if isinstance(value, torch.Tensor):
        return value
    hidden = getattr(value, "hidden", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(f"a split hand-over: expected a tensor or a (hidden, ...) value, got {type(value).__name__}")


class SleepShards:
    """The shard actions of a split plan's stand-ins (H, J, K, E, G): each sleeps the device's share of its
    layer's cost on the rank's DeviceClock, every hand-over is a summable stamp (`split_stamp`).

    Any runner takes it as `shards=` (executor/interface.py SHARD_METHODS): the dry run's SleepStages,
    and the framework benchmarks' runners beside their stand-in stages (the owner's stand-in layers
    make the head's input and read the summed partials with the same `split_stamp` / `split_ready`).
    `hand_over`: the meta of the hand-overs that meet a framework's tensors (the head's input, its
    partial input gradient, the embedding's partials: the framework's activation, float64, at least
    `split_numel` elements); default the bare summable payload; `learn_head_input`: the head's input
    is the framework owner's (hidden, targets, coef), its meta learned by the transport's handshake
    (the stamp in `hidden`). `report(mb, per_token_losses, coef)`:
    the runner's loss report a J makes (SHARD_API item 2; the owner's, which gives the framework its
    loss dict), here on zero per-token losses, one per token of the head's input (`coef`'s length, as
    the owner handed it on, else 1); default a zero loss (the stand-ins' loss value is not measured).
    """

    def __init__(self, *, shards: Sequence[ShardCosts], rank: int, device: DeviceClock, num_devices: int,
                 hand_over: TensorMeta | None = None, learn_head_input: bool = False, report=None):
        self.split = {c.side: c for c in shards}
        # what StageCore reads to start the owner's backward from the partials and give stage 0's their gradient
        self.head_split = "output" in self.split
        self.embedding_split = "input" in self.split
        # a framework owner hands on (hidden, targets, coef) in its own dtypes, or (hidden, None, None): its meta is
        # then learned by the transport's handshake (executor/comm.py), the hidden states carrying the stamp
        self.learn_head_input = learn_head_input
        self.rank = rank
        self.device = device
        self.num_devices = num_devices
        self.hand_over = hand_over
        self.report = report
        self.checked = 0
        self._owed: dict[tuple[str, int, int], object] = {}  # (kind, stage, mb) of an H / E whose J / G is due

    def split_meta(self, what: str):
        """The statistics are the bare summable payload; the other hand-overs have `hand_over`'s shape (the head's
        input: None, learned by handshake, under `learn_head_input`)."""
        if what == "head-input" and self.learn_head_input:
            return None
        if what == "stats" or self.hand_over is None:
            return TensorMeta(shape=(split_numel(self.num_devices),), dtype=torch.float64, requires_grad=False)
        return TensorMeta(shape=tuple(self.hand_over.shape), dtype=self.hand_over.dtype, requires_grad=False)

    def _stamp(self, what: str, mb: int, sent: float) -> torch.Tensor:
        meta = self.split_meta(what) if what != "head-input" else self.hand_over  # the hidden states carry the stamp
        meta = meta or TensorMeta(shape=(split_numel(self.num_devices),), dtype=torch.float64)
        return split_stamp(what, mb, self.rank, sent, self.num_devices, meta.shape, meta.dtype)

    def ready_at(self, value, action: str, mb: int, what: str) -> float:
        """When `value`, a hand-over of `what` to this rank, has landed (checked: micro-batch and kind)."""
        c = self.split[SIDE_OF[what]]
        table = c.stats_ms if what == "stats" else c.input_ms if what == "head-input" and c.input_ms else c.link_ms
        ready = split_ready(value, what, mb, lambda j: table[j][self.rank], rank=self.rank, action=action)
        self.checked += 1
        return ready

    def stamp(self, what: str, mb: int, sent: float) -> torch.Tensor:
        """The hand-over of `what` this rank sends at `sent` (the owner's head input, stage 0's embedding grad)."""
        return self._stamp(what, mb, sent)

    def pending(self) -> int:
        """H / E whose J / G has not run yet (0 after a complete step)."""
        return len(self._owed)

    def head_forward(self, stage: int, mb: int, hidden, *, forward_only: bool = False) -> torch.Tensor:
        """H: wait for the head's input, sleep the share of F; the statistics go to every other shard."""
        c = self.split["output"]
        end = self.device.work(c.share(self.rank) * c.fwd, self.ready_at(hidden, f"{stage}H{mb}", mb, "head-input"))
        self._owed[("H", stage, mb)] = _coef_of(hidden)  # the owner's loss coefficients, for J's report
        return self._stamp("stats", mb, end)

    def head_backward_input(self, stage: int, mb: int, peer_stats, *, forward_only: bool = False):
        """J: wait for every other shard's statistics, sleep the share of I (an evaluation step: of nothing, the
        loss only); the partial goes to the owner."""
        c = self.split["output"]
        ready = max([self.ready_at(p, f"{stage}J{mb}", mb, "stats") for p in peer_stats], default=0.0)
        end = self.device.work(0.0 if forward_only else c.share(self.rank) * c.bwd, ready)
        coef = self._owed.pop(("H", stage, mb), None)
        partial = None if forward_only else self._stamp("head-partial", mb, end)
        if self.report is None:
            return partial, LossOutput(loss=torch.zeros((), dtype=torch.float64))
        if coef is None:
            coef = torch.zeros(1, dtype=torch.float32)
        return partial, self.report(mb, torch.zeros_like(coef), coef)

    def head_backward_weight(self, stage: int, mb: int, **_) -> None:
        """K: sleep the share of W."""
        c = self.split["output"]
        self.device.work(c.share(self.rank) * c.wgrad)

    def embedding_forward(self, stage: int, mb: int, *, forward_only: bool = False) -> torch.Tensor:
        """E: sleep the share of F; the partial goes to stage 0."""
        c = self.split["input"]
        if not forward_only:  # an evaluation step runs no G
            self._owed[("E", stage, mb)] = None
        return self._stamp("embedding-partial", mb, self.device.work(c.share(self.rank) * c.fwd))

    def embedding_backward(self, stage: int, mb: int, grad_output, **_) -> None:
        """G: wait for stage 0's input gradient, sleep the share of I + W."""
        c = self.split["input"]
        self.device.work(c.share(self.rank) * (c.bwd + c.wgrad),
                         self.ready_at(grad_output, f"{stage}G{mb}", mb, "embedding-grad"))
        self._owed.pop(("E", stage, mb), None)


class SleepStages:
    """StageRunner whose actions sleep; records busy time and every message it checked.

    clock='device' (default) models an accelerator that runs its queue back to back while
    the host dispatches ahead (asynchronous kernels and NCCL): each action ends at
    max(device free, input arrival) + cost, so host overhead hides behind the previous
    action unless it exceeds it, and then the lateness shows. clock='wall' charges every
    host delay: each action sleeps its full cost from the moment the host reaches it, and
    boundaries carry payloads of the modelled size that really travel (no stamped arrival).
    A split plan's shard actions are its `SleepShards` (`self.shards`, on the same clock).

    An overlapped pair (`pair`) starts once both halves' inputs have landed and sleeps each
    half's phases (`costs.phases`) on their resource: compute phases on the calling thread,
    communication phases on the rank's one link thread, each half's in order, in the order
    simulator/pairs.overlap_ms starts them (overlap_order); its real span is what the device
    clock charges, so the hiding is measured. Both halves' outputs carry the pair's end.
    Unpaired actions sleep their whole cost, as before.
    """

    def __init__(self, *, costs: StandInCosts, rank: int, clock: str = "device",
                 live: tuple[tuple[int, ...], ...] | None = None, memory=None):
        if clock not in ("device", "wall"):
            raise ValueError(f"clock {clock!r}: expected 'device' or 'wall'")
        self.costs = costs
        self.rank = rank
        self.clock = clock
        self.device = DeviceClock(clock)  # the timing rule every stand-in shares (executor/clock.py)
        self.num_stages = len(costs.fwd)
        # live[s]: the layers whose outputs cross the boundary after stage s (one payload each)
        self.live = live if live is not None else tuple((s,) for s in range(self.num_stages))
        self._checked = 0
        self.split = {c.side: c for c in costs.shards}
        self.num_devices = len(costs.shards[0].link_ms) if costs.shards else 0
        self.shards = SleepShards(shards=costs.shards, rank=rank, device=self.device,
                                  num_devices=self.num_devices) if costs.shards else None
        self._pairs = PairSleeper(rank)  # an overlapped pair's phases on this thread and the link's
        self.pairs_run = 0
        self.memory = memory  # the plan's memory choices held and copied (executor/standin_memory.py HeldMemory)

    @property
    def checked(self) -> int:
        """Messages checked so far (stage boundaries and split hand-overs)."""
        return self._checked + (self.shards.checked if self.shards is not None else 0)

    @checked.setter
    def checked(self, value: int) -> None:
        self._checked = value
        if self.shards is not None:
            self.shards.checked = 0

    @property
    def busy_s(self) -> float:
        """Seconds of modelled work so far."""
        return self.device.busy_s

    @property
    def free(self) -> float:
        """When the modelled device finishes its last action (device clock)."""
        return self.device.free

    def start(self, t0: float) -> None:
        """Start the device clock at the shared start instant."""
        self.device.start(t0)

    def _numel(self, boundary: int) -> int:
        """Elements of the boundary's first payload: the header, or on the wall clock the cut's modelled bytes."""
        sized = self.clock == "wall" and boundary < len(self.costs.payload_bytes)
        return wall_numel(self.costs.payload_bytes[boundary], _HEADER) if sized else _HEADER

    def boundary_meta(self, stage: int) -> tuple[TensorMeta, ...]:
        """One payload per output live across the boundary (the first of the wall clock's modelled size)."""
        first = TensorMeta(shape=(self._numel(stage),), dtype=torch.float64)
        return tuple(first if k == 0 else _PAYLOAD for k in range(len(self.live[stage])))

    def _expect(self, value, action: str, mb: int, stage: int, grad: bool) -> float:
        boundary = stage - 1 if grad else stage
        if not isinstance(value, tuple) or len(value) != len(self.live[boundary]):
            raise ExecutorError(f"rank {self.rank}: {action} received {_count(value)} payloads across boundary "
                                f"{boundary}, the model graph has {len(self.live[boundary])} live outputs there",
                                rank=self.rank, action=action)
        arrival = 0.0
        for payload, layer in zip(value, self.live[boundary]):
            head = payload.detach()[:_HEADER].tolist()  # the header only: a wall-clock payload is much longer
            got = (int(head[0]), int(head[1]), int(head[2]), int(head[4]))
            want = (mb, stage, int(grad), layer)
            if got != want:
                raise ExecutorError(
                    f"rank {self.rank}: {action} received the {'gradient' if grad else 'activation'} of micro-batch "
                    f"{got[0]} from stage {got[1]} (direction {got[2]}, layer {got[3]}), expected micro-batch {mb} "
                    f"from stage {stage} (layer {layer})", rank=self.rank, action=action)
            arrival = max(arrival, float(head[3]))
        self._checked += 1
        return arrival + self.costs.hop[boundary] / 1000.0  # when the input lands on this device

    def _work(self, ms: float, ready_at: float = 0.0) -> float:
        """Sleep one action; returns its end time (which the payload carries on)."""
        return self.device.work(ms, ready_at)

    def _payload(self, mb: int, stage: int, grad: bool, sent: float) -> tuple[torch.Tensor, ...]:
        boundary = stage - 1 if grad else stage
        out = []
        for k, layer in enumerate(self.live[boundary]):
            # empty, not zeros: only the header is read, and filling a wall-clock payload is not the model's work
            t = torch.empty(self._numel(boundary) if k == 0 else _HEADER, dtype=torch.float64)
            t[:_HEADER] = torch.tensor([mb, stage, float(grad), sent, layer], dtype=torch.float64)
            out.append(t)
        return tuple(out)

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """Check the incoming activation (stage 0 of a split embedding: the partials), sleep F."""
        ready = self._forward_ready(stage, mb, inputs)
        if self.memory is not None:
            self.memory.starting(max(self.device.free, ready))
        end = self._work(self.costs.fwd[stage], ready)
        if self.memory is not None:
            self.memory.forward(stage, mb, end - self.costs.fwd[stage] / 1000.0, end)
        return self._forward_output(stage, mb, end)

    def _forward_ready(self, stage: int, mb: int, inputs) -> float:
        """When F's input has landed (checked)."""
        if stage > 0:
            return self._expect(inputs, f"{stage}F{mb}", mb, stage - 1, grad=False)
        if "input" in self.split:
            return self.shards.ready_at(inputs, f"{stage}F{mb}", mb, "embedding-partial")
        return 0.0

    def _forward_output(self, stage: int, mb: int, end: float):
        if stage == self.num_stages - 1:
            if "output" in self.split:
                return self.shards.stamp("head-input", mb, end)
            return torch.zeros((), dtype=torch.float64)
        return self._payload(mb, stage, False, end)

    def _backward(self, stage: int, mb: int, grad_output, ms: float, kind: str):
        ready = self._backward_ready(stage, mb, grad_output, kind)
        if self.memory is not None:  # the copy-in (issued an action earlier) lands before the backward starts
            self.memory.starting(max(self.device.free, ready))
            ready = max(ready, self.memory.backward_ready(stage, mb))
        end = self._work(ms, ready)
        if self.memory is not None:
            self.memory.backward(Kind(kind), stage, mb, end - ms / 1000.0, end)
        return self._backward_output(stage, mb, end)

    def _backward_ready(self, stage: int, mb: int, grad_output, kind: str) -> float:
        """When a backward's output gradient has landed (checked)."""
        if stage < self.num_stages - 1:
            return self._expect(grad_output, f"{stage}{kind}{mb}", mb, stage + 1, grad=True)
        if "output" in self.split:
            return self.shards.ready_at(grad_output, f"{stage}{kind}{mb}", mb, "head-partial")
        return 0.0

    def _backward_output(self, stage: int, mb: int, end: float):
        if stage > 0:
            return self._payload(mb, stage, True, end)
        return self.shards.stamp("embedding-grad", mb, end) if "input" in self.split else None

    # ----- overlapped pairs

    def pair(self, first, first_input, second, second_input, *, batch=None, last_backward: bool = False):
        """An overlapped pair: F `first` with B or I `second` (class docstring); both outputs carry its end."""
        if first.kind is not Kind.F or second.kind not in (Kind.B, Kind.I):
            raise ExecutorError(f"rank {self.rank}: pair {first}+{second}: the stand-ins pair an F with a B or I",
                                rank=self.rank, action=f"{first}+{second}")
        f, b = first, second
        ready = max(self._forward_ready(f.stage, f.microbatch, first_input),
                    self._backward_ready(b.stage, b.microbatch, second_input, b.kind.value))
        dur_f = self.costs.fwd[f.stage]
        dur_b = self.costs.bwd[b.stage] + (self.costs.wgrad[b.stage] if b.kind is Kind.B else 0.0)
        phases = self.costs.phases
        if phases is None:  # nothing communicates: the pair is its two costs back to back (as the simulator's)
            end = self._work(dur_f + dur_b, ready)
        else:
            seq_f, seq_b = phases.of(f.kind, f.stage), phases.of(b.kind, b.stage)
            rest = pair_rest_ms(dur_f, dur_b, seq_f, seq_b)
            end = self.device.overlapped(lambda: self._pairs.sleep(seq_f, seq_b, rest), ready)
        self.pairs_run += 1
        return self._forward_output(f.stage, f.microbatch, end), self._backward_output(b.stage, b.microbatch, end)

    def close(self) -> None:
        """Stop the link thread (if a pair made one) and the host link's (memory choices)."""
        if self.memory is not None:
            self.memory.close()
        self._pairs.close()

    # ----- split layers' shards: SleepShards' (the one stand-in of shard passes and their hand-overs)

    def split_meta(self, what: str) -> TensorMeta:
        """Every split hand-over is one summable payload (module docstring)."""
        return self.shards.split_meta(what)

    def head_forward(self, stage: int, mb: int, hidden, *, forward_only: bool = False) -> torch.Tensor:
        """H: SleepShards'."""
        return self.shards.head_forward(stage, mb, hidden, forward_only=forward_only)

    def head_backward_input(self, stage: int, mb: int, peer_stats, *, forward_only: bool = False):
        """J: SleepShards'."""
        return self.shards.head_backward_input(stage, mb, peer_stats, forward_only=forward_only)

    def head_backward_weight(self, stage: int, mb: int) -> None:
        """K: SleepShards'."""
        self.shards.head_backward_weight(stage, mb)

    def embedding_forward(self, stage: int, mb: int, *, forward_only: bool = False) -> torch.Tensor:
        """E: SleepShards'."""
        return self.shards.embedding_forward(stage, mb, forward_only=forward_only)

    def embedding_backward(self, stage: int, mb: int, grad_output) -> None:
        """G: SleepShards'."""
        self.shards.embedding_backward(stage, mb, grad_output)

    def backward_input(self, stage: int, mb: int, grad_output):
        """Check the output gradient, sleep I."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage], "I")

    def backward_weight(self, stage: int, mb: int) -> None:
        """Sleep W."""
        if self.memory is not None:
            self.memory.starting(self.device.free)
        end = self._work(self.costs.wgrad[stage])
        if self.memory is not None:
            self.memory.weight(stage, mb, end)

    def backward(self, stage: int, mb: int, grad_output):
        """Check the output gradient, sleep I + W."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage] + self.costs.wgrad[stage], "B")


class PairSleeper:
    """One rank's overlapped-pair sleeps (the one stand-in of a pair: the dry run's SleepStages and the Megatron
    benchmark's stand-in schedule plans): compute phases on the calling thread, communication phases on the rank's
    one link thread (made at the first pair), in the order simulator/pairs.overlap_order starts them."""

    def __init__(self, rank: int):
        self.rank = rank
        self._link: ThreadPoolExecutor | None = None
        self._host = _Sleeper()
        self._link_sleep: _Sleeper | None = None

    def sleep(self, seq_f, seq_b, rest_ms: float) -> None:
        """Sleep two phase sequences overlapped: compute on this thread, communication on the link's, each
        sequence in order; compute phases run, and exchanges queue on the link, in the order `overlap_order` starts
        them, and an exchange is handed to the link as soon as its half's phase before it has finished (before
        this thread sleeps its next compute phase); then `rest_ms` of compute."""
        if self._link is None:
            self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"link{self.rank}")
            self._link_sleep = _Sleeper()
        self._host.owed = self._link_sleep.owed = 0.0  # the last pair's oversleep is in its measured span
        seqs = (seq_f, seq_b)
        order, _ = overlap_order(seq_f, seq_b)
        seen = [0, 0]
        steps = []
        for k in order:
            steps.append((k, seen[k]))
            seen[k] += 1
        link = [(k, j) for k, j in steps if seqs[k][j][0]]
        compute = [(k, j) for k, j in steps if not seqs[k][j][0]]
        done, pending = [0, 0], [None, None]  # phases of each half finished; its exchange in flight

        def settle(k: int) -> None:
            if pending[k] is not None:
                pending[k].result()
                pending[k] = None
                done[k] += 1

        li = ci = 0
        while li < len(link) or ci < len(compute):
            while li < len(link):  # every exchange whose turn on the link has come and whose half is at it
                k, j = link[li]
                if done[k] != j or pending[k] is not None:
                    break
                pending[k] = self._link.submit(self._link_sleep.sleep, seqs[k][j][1])
                li += 1
            if ci < len(compute):
                k, j = compute[ci]
                settle(k)  # its half's exchange before it
                self._host.sleep(seqs[k][j][1])
                done[k] += 1
                ci += 1
            elif li < len(link):
                settle(link[li][0])  # only exchanges left: the one the next waits behind
        settle(0)
        settle(1)
        if rest_ms > 0.0:
            self._host.sleep(rest_ms)

    def close(self) -> None:
        """Stop the link thread (if a pair made one)."""
        if self._link is not None:
            self._link.shutdown(wait=True)
            self._link = None


def pair_rest_ms(dur_f: float, dur_b: float, seq_f, seq_b) -> float:
    """What two halves' costs hold beyond their phases (the simulator charges it whole, outside the overlap)."""
    return max(0.0, dur_f - sum(ms for _, ms in seq_f)) + max(0.0, dur_b - sum(ms for _, ms in seq_b))


class _Sleeper:
    """One thread's phase sleeps: each lasts its ms from the moment it starts (so what one thread waits on the
    other is measured), less what the thread's previous sleep overslept (time.sleep's wake-up lateness is not the
    device's, as in clock.DeviceClock)."""

    def __init__(self):
        self.owed = 0.0

    def sleep(self, ms: float) -> None:
        """Sleep `ms` from now, less the oversleep owed."""
        if ms <= 0.0:
            return
        deadline = time.time() + ms / 1000.0 - self.owed
        delay = deadline - time.time()
        if delay > 0:
            time.sleep(delay)
        self.owed = max(0.0, time.time() - deadline)


def _count(value) -> str:
    return str(len(value)) if isinstance(value, tuple) else type(value).__name__


def stage_live_outputs(model, stages) -> tuple[tuple[int, ...], ...]:
    """Per stage: the layers whose outputs cross the boundary after it (the model graph's cut; none after the last)."""
    from ..graph import live_outputs

    return tuple(live_outputs(model, st.end) for st in stages[:-1]) + ((),)


def standin_shards(model, plan, cluster) -> tuple[ShardCosts, ...]:
    """The stand-in figures of `plan`'s split layers from the (scaled) model and cluster, as the simulator's."""
    from ..simulator.split import gather_ms, message_bytes, split_costs

    nd = plan.num_devices

    def times(nbytes: int, ms=None) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(0.0 if a == b else ms if ms is not None else cluster.transfer_ms(a, b, nbytes)
                           for b in range(nd)) for a in range(nd))

    # the statistics: one all-gather after the last shard's H, as the simulator prices it
    return tuple(ShardCosts(side=c.side, owner=c.owner, devices=c.split.devices, shares=c.split.shares, fwd=c.fwd,
                            bwd=c.bwd, wgrad=c.wgrad, link_ms=times(message_bytes(c, "head-partial")),
                            stats_ms=times(0, gather_ms(cluster, c.split.devices, message_bytes(c, "stats"))),
                            input_ms=times(message_bytes(c, "head-input")))
                 for c in split_costs(model, plan))


def standin_costs(stage_costs, stage_devices: Sequence[int], cluster, phases: StagePhases | None = None
                  ) -> StandInCosts:
    """Stand-in costs from simulator StageCosts; hops priced by the simulator's own `hop_times` (0 on one device).

    `payload_bytes`: the cut's bytes where the boundary crosses devices (0 where the tensor stays in memory);
    `phases`: the stages' phase sequences an overlapped pair sleeps (simulator/pairs.stage_phases of the scaled
    model), None where the plan has no pairs or no layer communicates."""
    hops = hop_times(cluster, stage_devices, stage_costs.output)
    hop = tuple(0.0 if h is None else h for h in hops) + (0.0,)
    sent = tuple(0 if h is None else int(n) for h, n in zip(hops, stage_costs.output)) + (0,)
    return StandInCosts(fwd=tuple(stage_costs.fwd), bwd=tuple(stage_costs.bwd), wgrad=tuple(stage_costs.wgrad),
                        hop=hop, payload_bytes=sent, phases=phases)
