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

On the 'wall' clock nothing is stamped from the model: the first payload of a boundary
between devices is as large as the model's bytes across that cut (`payload_bytes`; the header
in its first five elements) and really travels, and the consumer uses it when its receive has
completed (a split layer's hand-overs keep their small summable payloads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..simulator.costs import hop_times
from ..schedules.split_messages import WHATS
from .clock import DeviceClock, wall_numel
from .errors import ExecutorError
from .interface import LossOutput, TensorMeta

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
    stats_ms: tuple[tuple[float, ...], ...]  # [src][dst]: one head shard's statistics to another

    def share(self, device: int) -> float:
        """The device's share of the layer."""
        return self.shares[self.devices.index(device)]


_SIDE = {"head-input": "output", "stats": "output", "head-partial": "output", "embedding-partial": "input",
         "embedding-grad": "input"}


class SleepStages:
    """StageRunner whose actions sleep; records busy time and every message it checked.

    clock='device' (default) models an accelerator that runs its queue back to back while
    the host dispatches ahead (asynchronous kernels and NCCL): each action ends at
    max(device free, input arrival) + cost, so host overhead hides behind the previous
    action unless it exceeds it, and then the lateness shows. clock='wall' charges every
    host delay: each action sleeps its full cost from the moment the host reaches it, and
    boundaries carry payloads of the modelled size that really travel (no stamped arrival).
    """

    def __init__(self, *, costs: StandInCosts, rank: int, clock: str = "device",
                 live: tuple[tuple[int, ...], ...] | None = None):
        if clock not in ("device", "wall"):
            raise ValueError(f"clock {clock!r}: expected 'device' or 'wall'")
        self.costs = costs
        self.rank = rank
        self.clock = clock
        self.device = DeviceClock(clock)  # the timing rule every stand-in shares (executor/clock.py)
        self.num_stages = len(costs.fwd)
        # live[s]: the layers whose outputs cross the boundary after stage s (one payload each)
        self.live = live if live is not None else tuple((s,) for s in range(self.num_stages))
        self.checked = 0
        self.split = {c.side: c for c in costs.shards}
        self.num_devices = len(costs.shards[0].link_ms) if costs.shards else 0

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
        self.checked += 1
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
        if stage > 0:
            ready = self._expect(inputs, f"{stage}F{mb}", mb, stage - 1, grad=False)
        else:
            ready = self._arrival(inputs, f"{stage}F{mb}", mb, "embedding-partial") if "input" in self.split else 0.0
        end = self._work(self.costs.fwd[stage], ready)
        if stage == self.num_stages - 1:
            if "output" in self.split:
                return self._split_payload("head-input", mb, end)
            return torch.zeros((), dtype=torch.float64)
        return self._payload(mb, stage, False, end)

    def _backward(self, stage: int, mb: int, grad_output, ms: float, kind: str):
        ready = 0.0
        if stage < self.num_stages - 1:
            ready = self._expect(grad_output, f"{stage}{kind}{mb}", mb, stage + 1, grad=True)
        elif "output" in self.split:
            ready = self._arrival(grad_output, f"{stage}{kind}{mb}", mb, "head-partial")
        end = self._work(ms, ready)
        if stage > 0:
            return self._payload(mb, stage, True, end)
        return self._split_payload("embedding-grad", mb, end) if "input" in self.split else None

    # ----- split layers' shards

    def split_meta(self, what: str) -> TensorMeta:
        """Every split hand-over is one summable payload (module docstring)."""
        return TensorMeta(shape=(5 + self.num_devices,), dtype=torch.float64, requires_grad=False)

    def _split_payload(self, what: str, mb: int, sent: float) -> torch.Tensor:
        t = torch.zeros(5 + self.num_devices, dtype=torch.float64)
        t[0], t[1], t[2], t[5 + self.rank] = mb, WHATS.index(what), 1.0, sent
        return t

    def _arrival(self, value, action: str, mb: int, what: str) -> float:
        """Check a (possibly summed) split payload; when its last part lands on this device."""
        n = float(value[2])
        got = (round(float(value[0]) / n), round(float(value[1]) / n)) if n > 0 else None
        if got != (mb, WHATS.index(what)):
            raise ExecutorError(f"rank {self.rank}: {action} received split payload {got} (micro-batch, kind), "
                                f"expected micro-batch {mb} of {what!r}", rank=self.rank, action=action)
        c = self.split[_SIDE[what]]
        table = c.stats_ms if what == "stats" else c.link_ms
        self.checked += 1
        return max(float(value[5 + j]) + table[j][self.rank] / 1000.0
                   for j in range(self.num_devices) if float(value[5 + j]) > 0)

    def head_forward(self, stage: int, mb: int, hidden) -> torch.Tensor:
        """H: wait for the head's input, sleep the share of F; the statistics go to every other shard."""
        c = self.split["output"]
        end = self._work(c.share(self.rank) * c.fwd, self._arrival(hidden, f"{stage}H{mb}", mb, "head-input"))
        return self._split_payload("stats", mb, end)

    def head_backward_input(self, stage: int, mb: int, peer_stats):
        """J: wait for every other shard's statistics, sleep the share of I; the partial goes to the owner."""
        c = self.split["output"]
        ready = max([self._arrival(p, f"{stage}J{mb}", mb, "stats") for p in peer_stats], default=0.0)
        end = self._work(c.share(self.rank) * c.bwd, ready)
        return self._split_payload("head-partial", mb, end), LossOutput(loss=torch.zeros((), dtype=torch.float64))

    def head_backward_weight(self, stage: int, mb: int) -> None:
        """K: sleep the share of W."""
        c = self.split["output"]
        self._work(c.share(self.rank) * c.wgrad)

    def embedding_forward(self, stage: int, mb: int) -> torch.Tensor:
        """E: sleep the share of F; the partial goes to stage 0."""
        c = self.split["input"]
        return self._split_payload("embedding-partial", mb, self._work(c.share(self.rank) * c.fwd))

    def embedding_backward(self, stage: int, mb: int, grad_output) -> None:
        """G: wait for stage 0's input gradient, sleep the share of I + W."""
        c = self.split["input"]
        self._work(c.share(self.rank) * (c.bwd + c.wgrad),
                   self._arrival(grad_output, f"{stage}G{mb}", mb, "embedding-grad"))

    def backward_input(self, stage: int, mb: int, grad_output):
        """Check the output gradient, sleep I."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage], "I")

    def backward_weight(self, stage: int, mb: int) -> None:
        """Sleep W."""
        self._work(self.costs.wgrad[stage])

    def backward(self, stage: int, mb: int, grad_output):
        """Check the output gradient, sleep I + W."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage] + self.costs.wgrad[stage], "B")


def _count(value) -> str:
    return str(len(value)) if isinstance(value, tuple) else type(value).__name__


def stage_live_outputs(model, stages) -> tuple[tuple[int, ...], ...]:
    """Per stage: the layers whose outputs cross the boundary after it (the model graph's cut; none after the last)."""
    from ..graph import live_outputs

    return tuple(live_outputs(model, st.end) for st in stages[:-1]) + ((),)


def standin_shards(model, plan, cluster) -> tuple[ShardCosts, ...]:
    """The stand-in figures of `plan`'s split layers from the (scaled) model and cluster, as the simulator's."""
    from ..simulator.split import split_costs

    nd = plan.num_devices

    def times(nbytes: int) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(0.0 if a == b else cluster.transfer_ms(a, b, nbytes) for b in range(nd))
                     for a in range(nd))

    return tuple(ShardCosts(side=c.side, owner=c.owner, devices=c.split.devices, shares=c.split.shares, fwd=c.fwd,
                            bwd=c.bwd, wgrad=c.wgrad, link_ms=times(c.link_bytes), stats_ms=times(c.split.stats_bytes))
                 for c in split_costs(model, plan))


def standin_costs(stage_costs, stage_devices: Sequence[int], cluster) -> StandInCosts:
    """Stand-in costs from simulator StageCosts; hops priced by the simulator's own `hop_times` (0 on one device).

    `payload_bytes`: the cut's bytes where the boundary crosses devices (0 where the tensor stays in memory)."""
    hops = hop_times(cluster, stage_devices, stage_costs.output)
    hop = tuple(0.0 if h is None else h for h in hops) + (0.0,)
    sent = tuple(0 if h is None else int(n) for h, n in zip(hops, stage_costs.output)) + (0,)
    return StandInCosts(fwd=tuple(stage_costs.fwd), bwd=tuple(stage_costs.bwd), wgrad=tuple(stage_costs.wgrad),
                        hop=hop, payload_bytes=sent)
