"""A layout is a partition plus a placement: stage layer ranges and the device of every stage."""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import Stage
from ..simulator import StageCosts, stage_costs
from ..simulator.costs import hop_times
from ..simulator.overheads import delivery_of, overhead_ms
from ..actions import RULES, Action, Kind
from ..simulator.pairs import hidden_ms, stage_phases
from .listsched import Job


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Half-open layer ranges per stage (consecutive, covering the model) and the device of each stage."""

    bounds: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.bounds)

    def stages(self) -> tuple[Stage, ...]:
        """The plan's Stage records."""
        return tuple(Stage(start=a, end=b, device=d) for (a, b), d in zip(self.bounds, self.devices))

    def cuts(self) -> tuple[int, ...]:
        """Interior boundaries: the start of every stage after the first."""
        return tuple(a for a, _ in self.bounds[1:])

    @staticmethod
    def of_stages(stages) -> "Layout":
        """Layout of a plan's Stage records (the inverse of `stages`)."""
        return Layout(bounds=tuple((st.start, st.end) for st in stages), devices=tuple(st.device for st in stages))

    @staticmethod
    def from_cuts(cuts, num_layers: int, devices) -> "Layout":
        """Layout from interior boundaries (non-decreasing) and a device per stage."""
        edges = (0, *cuts, num_layers)
        return Layout(bounds=tuple(zip(edges[:-1], edges[1:])), devices=tuple(devices))


def make_job(model, cluster, num_microbatches: int, layout: Layout,
             launch_ms: float = 0.0, overheads=None) -> tuple[Job, StageCosts, list[int]]:
    """The list scheduler's view of a layout, its stage costs and each device's static bytes.

    Transfers are priced by the simulator's own `hop_times` and host overheads by its `overhead_ms`,
    so plans are made with the costs they are judged by.
    """
    stages = layout.stages()
    sc = stage_costs(model, stages)
    nd = cluster.num_devices
    static = sc.device_state(stages, nd)
    devs = layout.devices
    hop = hop_times(cluster, devs, sc.output, launch_ms, delivery_of(overheads))
    cap = tuple(float(cluster.usable_memory_bytes - static[d]) for d in range(nd))
    job = Job(devices=devs, num_devices=nd, num_microbatches=num_microbatches, fwd=sc.fwd, bwd=sc.bwd,
              wgrad=sc.wgrad, activation=sc.activation, hop=hop, act_cap=cap,
              extra=overhead_ms(overheads, devs, sc.output), fused=sc.fused, hidden=pair_savings(model, stages))
    return job, sc, static


def pair_savings(model, stages) -> dict | None:
    """{(Kind.B | Kind.I, a, b): ms} that pairing F of stage a with B / I of stage b on their device saves, where > 0
    (simulator/pairs.py); None when the model does not communicate."""
    phases = stage_phases(model, stages)
    if phases is None:
        return None
    out = {}
    for a, sa in enumerate(stages):
        for b, sb in enumerate(stages):
            if sa.device != sb.device:
                continue
            for kind in RULES[Kind.F].pairs_with:
                ms = hidden_ms(phases, Action(a, Kind.F, 0), Action(b, kind, 1))
                if ms > 0.0:
                    out[(kind, a, b)] = ms
    return out


def device_work(sc: StageCosts, devices, num_devices: int, num_microbatches: int) -> list[float]:
    """Compute time each device must spend in a step: a floor on any schedule of the layout."""
    out = [0.0] * num_devices
    for s, d in enumerate(devices):
        out[d] += (sc.fwd[s] + sc.bwd[s] + sc.wgrad[s]) * num_microbatches
    return out


def comm_prefix(model) -> tuple[float, ...]:
    """prefix[i]: the F + I communication phases of layers [0, i) for one micro-batch."""
    acc = [0.0]
    for layer in model.layers:
        acc.append(acc[-1] + sum(layer.comm_ms))
    return tuple(acc)


def device_link(prefix, layout: Layout, num_devices: int, num_microbatches: int) -> list[float]:
    """Communication time each device's stages put on its link in a step (`prefix`: comm_prefix of the model)."""
    out = [0.0] * num_devices
    for (a, b), d in zip(layout.bounds, layout.devices):
        out[d] += (prefix[b] - prefix[a]) * num_microbatches
    return out
