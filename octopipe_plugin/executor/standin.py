"""Sleeping stand-in stages: each action sleeps its (scaled) cost, each message says what it is.

A payload is [micro-batch, producing stage, direction (0 act, 1 grad), send time]; the
consumer checks the first three against what it expects and, to charge the link, does not
use the payload before `send time + transfer time` (processes share the host clock), which
is the simulator's model of a transfer with full overlap. Sleeping costs no CPU, so many
ranks fit on a laptop's few cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..simulator.costs import hop_times
from .errors import ExecutorError
from .interface import TensorMeta

_PAYLOAD = TensorMeta(shape=(4,), dtype=torch.float64)
_LOSS = TensorMeta(shape=(), dtype=torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class StandInCosts:
    """Per-stage scaled durations (ms) and per-boundary transfer time (ms, 0 on the same device)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    hop: tuple[float, ...]  # hop[s]: stage s -> s+1 (and the gradient back)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


class SleepStages:
    """StageRunner whose actions sleep; records busy time and every message it checked.

    clock='device' (default) models an accelerator that runs its queue back to back while
    the host dispatches ahead (asynchronous kernels and NCCL): each action ends at
    max(device free, input arrival) + cost, so host overhead hides behind the previous
    action unless it exceeds it, and then the lateness shows. clock='wall' charges every
    host delay: each action sleeps its full cost from the moment the host reaches it.
    """

    def __init__(self, *, costs: StandInCosts, rank: int, clock: str = "device"):
        if clock not in ("device", "wall"):
            raise ValueError(f"clock {clock!r}: expected 'device' or 'wall'")
        self.costs = costs
        self.rank = rank
        self.clock = clock
        self.num_stages = len(costs.fwd)
        self.busy_s = 0.0
        self.checked = 0
        self.free = 0.0  # when the modelled device finishes its last action (device clock)

    def start(self, t0: float) -> None:
        """Start the device clock at the shared start instant."""
        self.free = t0

    def boundary_meta(self, stage: int) -> TensorMeta:
        """Every boundary carries the 4-number payload; the last stage yields a scalar loss."""
        return _LOSS if stage == self.num_stages - 1 else _PAYLOAD

    def _expect(self, payload: torch.Tensor, action: str, mb: int, stage: int, grad: bool) -> float:
        got = (int(payload[0]), int(payload[1]), int(payload[2]))
        want = (mb, stage, int(grad))
        if got != want:
            raise ExecutorError(
                f"rank {self.rank}: {action} received the {'gradient' if grad else 'activation'} of micro-batch "
                f"{got[0]} from stage {got[1]} (direction {got[2]}), expected micro-batch {mb} from stage {stage}",
                rank=self.rank, action=action)
        self.checked += 1
        hop = self.costs.hop[stage - 1 if grad else stage]
        return float(payload[3]) + hop / 1000.0  # when the input lands on this device

    def _work(self, ms: float, ready_at: float = 0.0) -> float:
        """Sleep one action; returns its end time (which the payload carries on)."""
        if self.clock == "wall":
            _sleep_until(ready_at)
            start = time.time()
            _sleep_until(start + ms / 1000.0)
            end = time.time()
            self.busy_s += end - start
            return end
        start = max(self.free, ready_at)
        _sleep_until(start + ms / 1000.0)
        end = max(start + ms / 1000.0, time.time())  # a host later than the deadline delays the device
        self.free = end
        self.busy_s += ms / 1000.0
        return end

    def _payload(self, mb: int, stage: int, grad: bool, sent: float) -> torch.Tensor:
        return torch.tensor([mb, stage, float(grad), sent], dtype=torch.float64)

    def forward(self, stage: int, mb: int, inputs: torch.Tensor | None) -> torch.Tensor:
        """Check the incoming activation, sleep F."""
        ready = self._expect(inputs, f"{stage}F{mb}", mb, stage - 1, grad=False) if stage > 0 else 0.0
        end = self._work(self.costs.fwd[stage], ready)
        if stage == self.num_stages - 1:
            return torch.zeros((), dtype=torch.float64)
        return self._payload(mb, stage, False, end)

    def _backward(self, stage: int, mb: int, grad_output, ms: float, kind: str) -> torch.Tensor | None:
        ready = 0.0
        if stage < self.num_stages - 1:
            ready = self._expect(grad_output, f"{stage}{kind}{mb}", mb, stage + 1, grad=True)
        end = self._work(ms, ready)
        return self._payload(mb, stage, True, end) if stage > 0 else None

    def backward_input(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Check the output gradient, sleep I."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage], "I")

    def backward_weight(self, stage: int, mb: int) -> None:
        """Sleep W."""
        self._work(self.costs.wgrad[stage])

    def backward(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Check the output gradient, sleep I + W."""
        return self._backward(stage, mb, grad_output, self.costs.bwd[stage] + self.costs.wgrad[stage], "B")


def standin_costs(stage_costs, stage_devices: Sequence[int], cluster) -> StandInCosts:
    """Stand-in costs from simulator StageCosts; hops priced by the simulator's own `hop_times` (0 on one device)."""
    hop = tuple(0.0 if h is None else h for h in hop_times(cluster, stage_devices, stage_costs.output)) + (0.0,)
    return StandInCosts(fwd=tuple(stage_costs.fwd), bwd=tuple(stage_costs.bwd), wgrad=tuple(stage_costs.wgrad),
                        hop=hop)
