"""How the executor's host overheads are charged: the one rule the simulator and the tuner share.

An action of kind k on stage s costs its layers' time plus, on its own device's timeline:
- the per-action cost of its kind (`Overheads.action`),
- the sender's cost of the message it sends, when the stage it sends to sits on another device
  (F: the activation to s+1; B/I: the gradient to s-1; the boundary's bytes),
- the receiver's cost of the message it consumes, when the stage it receives from sits on
  another device (F: from s-1; B/I: from s+1).
The executor issues a send right after its producer and waits on a receive right before its
consumer (executor/engine.py), so both host costs sit next to those actions. The fixed
in-flight cost `launch_ms` is the transfer's (`costs.hop_times`), not a device's. Shard kinds of
split layers pay their kind's action cost; their own messages are not charged here.
"""

from __future__ import annotations

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
