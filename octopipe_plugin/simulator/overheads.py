"""How the executor's host overheads are charged: the one rule the simulator and the tuner share.

An action of kind k on stage s costs its layers' time plus, on its own device's timeline:
- the per-action cost of its kind (`Overheads.action`),
- the sender's cost of the message it sends, when the stage it sends to sits on another device
  (F: the activation to s+1; B/I: the gradient to s-1; the boundary's bytes),
- the receiver's cost of the message it consumes, when the stage it receives from sits on
  another device (F: from s-1; B/I: from s+1).
The executor issues a send right after its producer and waits on a receive right before its
consumer (executor/engine.py), so both host costs sit next to those actions. The in-flight
costs — the fixed `launch_ms` and the busy sender's delivery delay (`delivery_of`) — are the
transfer's (`costs.hop_times`), not a device's. A split layer's hand-overs (schedules/split_messages.py: the
head's input to every shard, the partials back) are messages too (`split_message_ms`): each costs its
sender's send cost on the action that makes it and its receiver's on the action that takes it. The head
shards' statistics are one all-gather per micro-batch (`stats_gathers`): each shard's H pays one send
cost (posting it) and its J one receive cost of the n - 1 peers' bytes (waiting for it), where n - 1
messages each way had cost 80% of a 16-rank shard's messages (issue 36).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import RULES, Kind
from ..formats.overheads import Overheads


def overhead_ms(overheads: Overheads | None, devices, output) -> dict[Kind, tuple[float, ...]] | None:
    """Per kind, each stage's host overhead in ms (None when nothing is charged).

    `devices[s]` is stage s's device and `output[s]` the bytes crossing boundary s -> s+1.
    """
    if overheads is None or overheads.is_zero:
        return None
    ns = len(devices)
    out = {}
    for kind, rule in RULES.items():
        base = overheads.action(kind)
        per_stage = []
        for s in range(ns):
            ms = base
            if rule.sends is not None:
                t = s + rule.sends.step
                if 0 <= t < ns and devices[t] != devices[s]:
                    ms += overheads.send.ms(output[min(s, t)])
            if rule.receives is not None:
                src = s - rule.receives.step
                if 0 <= src < ns and devices[src] != devices[s]:
                    ms += overheads.recv.ms(output[min(s, src)])
            per_stage.append(ms)
        out[kind] = tuple(per_stage)
    return out


def split_message_ms(overheads: Overheads | None, plan, nbytes) -> dict:
    """(device, action) -> host ms of the split hand-overs it sends and receives (empty when nothing is charged).

    The plan's cross-device split messages (`schedules.split_messages.split_messages`) and its statistics'
    all-gathers (`stats_gathers`: a post on each H, a wait for the n - 1 peers' bytes on each J); `nbytes(msg)`
    the bytes one message carries (of a gather: one shard's part)."""
    if overheads is None or overheads.is_zero or not plan.splits:
        return {}
    from ..schedules.split_messages import split_messages, stats_gathers

    out: dict = {}
    for _, msg in split_messages(plan):
        b = nbytes(msg)
        out[(msg.src, msg.producer)] = out.get((msg.src, msg.producer), 0.0) + overheads.send.ms(b)
        out[(msg.dst, msg.consumer)] = out.get((msg.dst, msg.consumer), 0.0) + overheads.recv.ms(b)
    for g in stats_gathers(plan):
        b = nbytes(g)
        for d in g.devices:
            out[(d, g.producer)] = out.get((d, g.producer), 0.0) + overheads.send.ms(b)
            out[(d, g.consumer)] = out.get((d, g.consumer), 0.0) + overheads.recv.ms((len(g.devices) - 1) * b)
    return out


def delivery_of(overheads: Overheads | None):
    """The busy-sender delivery cost `costs.hop_times` adds in flight (None: no overheads charged)."""
    return None if overheads is None else overheads.delivery


HOST_SHARE_LIMIT = 0.05  # stand-in runs: the host's own cost may take at most this share of the modelled step


@dataclass(frozen=True, kw_only=True, slots=True)
class HostShare:
    """The busiest device's host overhead in one step against the modelled step it runs under."""

    host_ms: float  # the most any device spends on the executor's own costs in one step (not scaled)
    device: int
    step_ms: float  # the modelled (scaled) step
    limit: float

    @property
    def share(self) -> float:
        """host_ms / step_ms."""
        return self.host_ms / self.step_ms if self.step_ms > 0 else float("inf")

    @property
    def too_high(self) -> bool:
        """Whether the host's cost exceeds the limit's share of the step."""
        return self.share > self.limit

    def least_step_ms(self) -> float:
        """The shortest modelled step at which the host's cost stays within the limit."""
        return self.host_ms / self.limit

    def message(self, flag: str, scale_of: float = 1.0) -> str:
        """One line: the share, the limit and the `flag` value that would do (`scale_of` converts ms to its unit)."""
        need = self.least_step_ms() * scale_of
        return (f"the executor's host overhead, {self.host_ms:.1f} ms per step on device {self.device} (measured, "
                f"not scaled), is {100 * self.share:.1f}% of the modelled {self.step_ms:.1f} ms step, above the "
                f"{100 * self.limit:g}% at which host costs start to decide the measured figures: use {flag} "
                f"{need:.4g} or more")


def host_share(plan, overheads: Overheads, step_ms: float, output=None, limit: float = HOST_SHARE_LIMIT) -> HostShare:
    """The host overhead of `plan`'s busiest device per step (the rule of `overhead_ms`) against a modelled step.

    `output[s]` is the bytes the run really sends over boundary s (default: none, fixed costs only) —
    stand-ins send small payloads, not the modelled activations. The one check behind the dry run's
    and both stand-in benchmarks' warning (`--target-ms` / `--target-s` too short).
    """
    devices = [st.device for st in plan.stages]
    extra = overhead_ms(overheads, devices, output if output is not None else [0] * len(devices))
    per_device = [0.0] * plan.num_devices
    if extra is not None:
        for d, row in enumerate(plan.schedule):
            per_device[d] = sum(extra[a.kind][a.stage] for a in row)
    # a split layer's hand-overs and statistics' gathers (stamps: fixed costs only)
    for (d, _), ms in split_message_ms(overheads, plan, lambda msg: 0).items():
        per_device[d] += ms
    worst = max(range(plan.num_devices), key=lambda d: per_device[d])
    return HostShare(host_ms=per_device[worst], device=worst, step_ms=step_ms, limit=limit)


def scale_warnings(runs, overheads: Overheads, flag: str, target: float, limit: float = HOST_SHARE_LIMIT,
                   output=None) -> list[str]:
    """One line per run whose host share is too high at the chosen scale, each naming the `flag` value that would do.

    `runs` are (label, plan, modelled step ms at the scale `target` of `flag` gives); the value
    that would do scales `target` in proportion (the modelled steps grow with it).
    """
    lines = []
    for label, plan, step_ms in runs:
        got = host_share(plan, overheads, step_ms, output, limit)
        if got.too_high:
            lines.append((f"{label}: " if label else "") + got.message(flag, scale_of=target / step_ms))
    return lines
