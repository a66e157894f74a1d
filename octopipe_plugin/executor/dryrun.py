"""Dry run: the real executor over gloo, one local process per device, layers replaced by sleeps.

The plan's mechanics (message matching, ordering, deadlock-freedom, overlap) are exercised
for real; only the compute is a stand-in. Predicted and measured step times use the same
scaled costs: predicted by the simulator (reference semantics), measured as the wall-clock
span from a common start instant to the moment the last rank's step returns. Transfers are
priced by the cluster (the consumer does not use a payload before send time + transfer
time) or free when no cluster is given. Every boundary carries one payload per model output
live across it, as the model graph says (a branched model's cut carries several).
An overlapped pair sleeps its halves' phases on two threads, compute and link (SleepStages.pair),
so what it hides is measured. See SleepStages for the 'device' and 'wall' clocks. On the wall
clock the model's bytes really travel over gloo and only compute is scaled: the prediction
prices transfers unscaled by `links` (this host's, from `octopipe cluster --measure`), else by
the cluster's links.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..errors import OctoPipeError
from ..formats import Cluster, Link, plan_from_dict, plan_to_dict
from ..simulator import simulate, stage_costs
from ..simulator.costs import memory_costs
from ..simulator.pairs import stage_phases
from ..simulator.split import without_split_layers
from .engine import ExecutorOptions, PipelineExecutor
from .launch import init_gloo, spawn
from .standin import SleepStages, StandInCosts, stage_live_outputs, standin_costs, standin_shards
from .standin_memory import HeldMemory, standin_memory


# bytes one stand-in message carries (standin.py's 5 float64 numbers per live output): what the host really sends
STANDIN_PAYLOAD_BYTES = 40
# the most activation bytes one rank's stand-in holds at its peak (a plan's memory choices; the plan's bytes scaled
# down to it, as time is): small enough for 16 ranks on a laptop, large enough that buffers are really allocated
MEMORY_DRYRUN_BYTES = 32 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRunReport:
    """Measured against predicted step time, per-device idle time, and how many messages were checked."""

    time_scale: float
    predicted_ms: float
    measured_ms: float
    predicted_idle_ms: tuple[float, ...]
    measured_idle_ms: tuple[float, ...]
    messages_checked: int
    transfers_priced: bool
    clock: str
    # memory choices (executor/standin_memory.py): per device the predicted and measured activation peak, in the
    # dry run's scaled bytes (`byte_scale` of the plan's); empty for a plan without `memory`
    predicted_peak_bytes: tuple[int, ...] = ()
    measured_peak_bytes: tuple[int, ...] = ()
    byte_scale: float = 1.0

    @property
    def peak_error(self) -> float:
        """The largest |measured - predicted| / predicted activation peak over the devices (0 without memory)."""
        return max((abs(m - p) / p for p, m in zip(self.predicted_peak_bytes, self.measured_peak_bytes) if p),
                   default=0.0)

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_ms - self.predicted_ms) / self.predicted_ms if self.predicted_ms else 0.0


def zero_cost_cluster(num_devices: int) -> Cluster:
    """A cluster whose transfers are free (used when no cluster is given)."""
    link = Link(bandwidth_gb_per_s=1e30, latency_us=0.0)
    return Cluster(num_devices=num_devices, devices_per_node=num_devices, memory_bytes=1 << 62, intra_node=link,
                   inter_node=link, name="zero-cost")


def scaled_cluster(cluster: Cluster, scale: float) -> Cluster:
    """The same cluster with every transfer `scale` times as long."""
    def sl(lk: Link) -> Link:
        return Link(bandwidth_gb_per_s=lk.bandwidth_gb_per_s / scale, latency_us=lk.latency_us * scale)

    return replace(cluster, intra_node=sl(cluster.intra_node), inter_node=sl(cluster.inter_node))


def scaled_model(model, scale: float):
    """The model with every layer's durations multiplied by `scale`."""
    return replace(model, layers=tuple(lay.scaled(scale) for lay in model.layers))


def host_links(cluster: Cluster, links: Cluster | None) -> Cluster:
    """`cluster` with the links (and node size) of `links`, the host's measured file: what wall-clock payloads
    really cross while the plan keeps its own cluster's devices and memory (None: `cluster` as it is)."""
    if links is None:
        return cluster
    return replace(cluster, devices_per_node=min(links.devices_per_node, cluster.num_devices),
                   intra_node=links.intra_node, inter_node=links.inter_node)


def scaled_costs(model, plan, scale: float):
    """Simulator stage costs of `plan` with every duration multiplied by `scale` (split layers left to shards)."""
    sc = stage_costs(without_split_layers(model, plan.splits), plan.stages)
    mul = lambda xs: tuple(x * scale for x in xs)  # noqa: E731
    return replace(sc, fwd=mul(sc.fwd), bwd=mul(sc.bwd), wgrad=mul(sc.wgrad))


def auto_scale(model, plan, cluster: Cluster, target_ms: float) -> float:
    """The time scale that makes the simulated step last `target_ms`."""
    base = simulate(model, cluster, plan, detail=False).step_time_ms
    return target_ms / base if base > 0 else 1.0


def dry_run(model, plan, cluster: Cluster | None = None, *, time_scale: float | None = None,
            target_ms: float = 2000.0, timeout_s: float = 60.0, clock: str = "device",
            max_step_ms: float | None = None, links: Cluster | None = None) -> DryRunReport:
    """Run `plan` with sleeping stand-ins on local processes and compare with the simulator.

    `links` (wall clock): the cluster whose links price the payloads that really travel (this host's,
    measured by `octopipe cluster --measure`); default `cluster`'s own.

    Refused before any process starts (OctoPipeError): a scale, target or timeout that is not a
    positive finite number, a scaled step longer than `max_step_ms`, or one longer than the
    timeout (a rank may wait that long for one message, and would report a false deadlock).
    """
    for name, value in (("time_scale", time_scale), ("target_ms", target_ms), ("timeout_s", timeout_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise OctoPipeError(f"dry run: {name} must be a finite number > 0, got {value}")
    memory = bool(getattr(plan, "memory", ()))
    if memory and (getattr(plan, "pairs", ()) or plan.splits):
        raise OctoPipeError("dry run: plan $.memory: the stand-ins run memory choices on plans without overlapped "
                            "pairs or split layers; fix: dry-run the plan without `pairs` / `splits` or `memory`")
    if any(c.kind == "offload_w" for _, c in getattr(plan, "memory", ())):
        raise OctoPipeError("dry run: plan $.memory: the stand-ins do not hold offload_w's I->W copies yet; fix: "
                            "dry-run the plan with those layers kept or offloaded (offload)")
    links = links if clock == "wall" else None
    priced = cluster is not None or links is not None
    cluster = cluster or zero_cost_cluster(plan.num_devices)
    scale = time_scale if time_scale is not None else auto_scale(model, plan, cluster, target_ms)
    sc = scaled_costs(model, plan, scale)
    # wall clock: real bytes over the host's real links, so transfers keep the cluster's own times
    fast = host_links(cluster, links) if clock == "wall" else scaled_cluster(cluster, scale)
    if memory:  # the host link's copies are scaled as compute is
        fast = replace(fast, host_link_gb_per_s=cluster.host_rate(model.host_link_gb_per_s) / scale)
    # a split plan's shard costs come from the (scaled) model, its stages' from `sc`; so do an overlapped pair's
    # phases (what it hides: simulator/pairs.py)
    pairs = bool(getattr(plan, "pairs", ()))
    sim = simulate(scaled_model(model, scale) if plan.splits or pairs or memory else None, fast, plan, costs=sc,
                   detail=False)
    step_s = sim.step_time_ms / 1000.0
    if max_step_ms is not None and sim.step_time_ms > max_step_ms:
        raise OctoPipeError(f"time scale {scale:.4g} makes the step last {step_s:.4g} s, more than the "
                            f"{max_step_ms / 1000:g} s a dry run allows; use a smaller --time-scale or --target-s")
    if step_s > timeout_s:
        raise OctoPipeError(f"the scaled step lasts {step_s:.4g} s, longer than the {timeout_s:g} s timeout a rank "
                            f"waits for one message: raise --timeout above {step_s:.4g} or lower the time scale")
    # the stages' phases without their split layers (priced as shards), as the split simulator takes them
    phases = stage_phases(scaled_model(without_split_layers(model, plan.splits), scale), plan.stages) if pairs else None
    costs = standin_costs(sc, [st.device for st in plan.stages], fast, phases)
    if plan.splits:
        costs = replace(costs, shards=standin_shards(scaled_model(model, scale), plan, fast))
    held, predicted_peak, byte_scale = None, (), 1.0
    if memory:  # the recomputed forwards in I and B; the bytes held scaled to fit this host
        mc = memory_costs(scaled_model(model, scale), plan, fast)
        costs = replace(costs, bwd=tuple(b + x for b, x in zip(costs.bwd, mc.extra_ms)))
        static = sc.device_state(plan.stages, plan.num_devices)
        act_peak = [p - st for p, st in zip(sim.peak_memory_bytes, static)]
        byte_scale = min(1.0, MEMORY_DRYRUN_BYTES / max(1, max(act_peak)))
        held = standin_memory(mc, byte_scale)
        predicted_peak = tuple(int(round(p * byte_scale)) for p in act_peak)
    live = stage_live_outputs(model, plan.stages)
    with tempfile.TemporaryDirectory(prefix="octopipe-dryrun-") as out:
        spawn(_worker, plan.num_devices, plan_to_dict(plan), costs, live, timeout_s, clock, out, held)
        ranks = [_read_json(os.path.join(out, f"rank{r}.json")) for r in range(plan.num_devices)]
    start = ranks[0]["start"]
    measured = max(r["end"] for r in ranks) - start
    return DryRunReport(
        time_scale=scale, predicted_ms=sim.step_time_ms, measured_ms=measured * 1000.0,
        predicted_idle_ms=tuple(sim.idle_ms), measured_idle_ms=tuple((measured - r["busy"]) * 1000.0 for r in ranks),
        messages_checked=sum(r["checked"] for r in ranks), transfers_priced=priced, clock=clock,
        predicted_peak_bytes=predicted_peak, measured_peak_bytes=tuple(r["peak"] for r in ranks) if memory else (),
        byte_scale=byte_scale,
    )


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _worker(rank: int, world: int, port: int, plan_doc: dict, costs: StandInCosts, live: tuple, timeout_s: float,
            clock: str, out: str, held=None) -> None:
    init_gloo(rank, world, port, timeout_s)
    plan = plan_from_dict(plan_doc)
    opts = ExecutorOptions(timeout_s=timeout_s)
    # the stand-ins' payloads are CPU tensors: the executor is told so (a device is never implied)
    device = torch.device("cpu")
    memory = HeldMemory(held, plan.schedule[rank]) if held is not None else None
    runner = SleepStages(costs=costs, rank=rank, clock=clock, live=live, memory=memory)
    executor = PipelineExecutor(plan, runner, device=device, options=opts)
    # warm-up step without sleeping, same executor and payload sizes: opens every gloo pair and makes every
    # receive buffer, so the timed step pays no connection setup or first allocation
    runner.device.mode = "off"
    executor.run_step()
    runner.device.mode = clock
    runner.checked = 0
    if memory is not None:
        memory.reset()
        memory.active = True
    start = torch.tensor([time.time() + 0.3], dtype=torch.float64)
    dist.broadcast(start, src=0)  # one shared start instant: the host clock is common to all ranks
    t0 = float(start[0])
    time.sleep(max(0.0, t0 - time.time()))
    runner.start(t0)
    executor.run_step()
    end = time.time()
    runner.close()
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"start": t0, "end": end, "busy": runner.busy_s, "checked": runner.checked,
                   "peak": memory.peak() if memory is not None else 0}, fh)
    dist.destroy_process_group()
