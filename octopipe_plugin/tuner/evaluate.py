"""Turning a (layout, policy) or an explicit plan into a simulated, memory-checked outcome.

The simulator is the judge: every step time the tuner compares comes from `simulate`.
An `Evaluator` belongs to one tuning run; it caches stage costs per layout and counts
the work spent (actions scheduled plus actions simulated), which is what the search's
deterministic budget is measured in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import DeadlockError
from ..formats import Plan
from ..simulator import SimOptions, simulate, stage_costs
from ..simulator.memory import least_live
from .layout import Layout, device_work, make_job
from .listsched import Policy, build_schedule
from .periodic import action_count


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """A simulated plan: step time, bubble, per-device peak memory and whether it fits."""

    plan: Plan | None  # None in a cache hit: the candidate was judged before (search skips it)
    step_ms: float
    bubble: float
    peak: tuple[int, ...]
    fits: bool

    @property
    def max_peak(self) -> int:
        """The fullest device's peak bytes."""
        return max(self.peak)


@dataclass(kw_only=True)
class Meter:
    """Work and simulations of one tuning run, shared by its evaluators at different micro-batch counts."""

    work: float = 0.0  # actions scheduled + simulated so far
    evaluations: int = 0


class Evaluator:
    """Simulates candidates of one tuning problem, with caches and a work counter."""

    def __init__(self, model, cluster, num_microbatches: int, meter: Meter | None = None,
                 options: SimOptions | None = None):
        self.model, self.cluster, self.m = model, cluster, num_microbatches
        self.meter = meter or Meter()
        self.options = options or SimOptions()  # the judge's switches; the list scheduler prices hops alike
        self._jobs: dict[Layout, tuple] = {}
        # judged candidates; outcomes are kept without their plans, so long runs hold no schedules here
        self._seen: dict[tuple, Outcome | None] = {}

    @property
    def work(self) -> float:
        """Work units spent so far by every evaluator sharing this one's meter."""
        return self.meter.work

    @work.setter
    def work(self, value: float) -> None:
        self.meter.work = value

    @property
    def evaluations(self) -> int:
        """Simulations run so far by every evaluator sharing this one's meter."""
        return self.meter.evaluations

    def at(self, num_microbatches: int) -> "Evaluator":
        """An evaluator of the same problem at another micro-batch count, sharing the work meter."""
        if num_microbatches == self.m:
            return self
        return Evaluator(self.model, self.cluster, num_microbatches, meter=self.meter, options=self.options)

    def job(self, layout: Layout):
        """(Job, StageCosts, static bytes) of a layout, cached."""
        got = self._jobs.get(layout)
        if got is None:
            got = make_job(self.model, self.cluster, self.m, layout, self.options.launch_ms)
            self._jobs[layout] = got
        return got

    def work_floor(self, layout: Layout) -> float:
        """The busiest device's compute time: no schedule of this layout is faster."""
        _, sc, _ = self.job(layout)
        return max(device_work(sc, layout.devices, self.cluster.num_devices, self.m))

    def static_fits(self, layout: Layout) -> bool:
        """Whether every device can hold its stages' state and one activation of each."""
        job, _, static = self.job(layout)
        nd = self.cluster.num_devices
        live = least_live(layout.devices, job.activation, nd)
        return max(static[d] + live[d] for d in range(nd)) <= self.cluster.memory_bytes

    def scheduled(self, layout: Layout, policy: Policy) -> Outcome | None:
        """List-schedule a layout under a policy and simulate it; None when the policy starves."""
        key = (layout, policy)
        if key in self._seen:
            return self._seen[key]
        out = self.schedule_and_simulate(layout, policy)
        self._seen[key] = None if out is None else replace(out, plan=None)
        return out

    def schedule_and_simulate(self, layout: Layout, policy: Policy) -> Outcome | None:
        """List-schedule and simulate without the cache (for a final, full-count plan)."""
        job, sc, _ = self.job(layout)
        self.work += 6 * 3 * len(layout.devices) * self.m  # list scheduling costs ~6x a simulated action
        schedule = build_schedule(job, policy)
        out = None
        if schedule is not None:
            meta = {"schedule": "octopipe", "policy": policy.describe()}
            out = self.simulated(self.plan_of(layout, schedule, meta), costs=sc)
        return out

    def ordered(self, layout: Layout, schedule) -> Outcome | None:
        """Simulate a layout with an explicit per-device order; None when it deadlocks."""
        key = (layout, schedule)
        if key in self._seen:
            return self._seen[key]
        _, sc, _ = self.job(layout)
        self.work += action_count(schedule)  # hashing the order for the cache
        out = self.simulated(self.plan_of(layout, schedule, {"schedule": "octopipe"}), costs=sc)
        self._seen[key] = None if out is None else replace(out, plan=None)
        return out

    def plan_of(self, layout: Layout, schedule, meta: dict | None = None) -> Plan:
        """The Plan of a layout run in the given per-device order."""
        return Plan(model=self.model.name, num_devices=self.cluster.num_devices, num_microbatches=self.m,
                    stages=layout.stages(), schedule=schedule, meta=meta or {})

    def run(self, layout: Layout, spec) -> Outcome | None:
        """Evaluate a candidate whose spec is a Policy (list-scheduled) or an explicit order."""
        if isinstance(spec, Policy):
            return self.scheduled(layout, spec)
        return self.ordered(layout, spec)

    def simulated(self, plan: Plan, costs=None) -> Outcome | None:
        """Simulate an explicit plan; None when it deadlocks."""
        sc = costs if costs is not None else stage_costs(self.model, plan.stages)
        self.work += action_count(plan.schedule)
        self.meter.evaluations += 1
        try:
            res = simulate(self.model, self.cluster, plan, self.options, costs=sc, detail=False)
        except DeadlockError:
            return None
        peak = tuple(res.peak_memory_bytes)
        return Outcome(plan=plan, step_ms=res.step_time_ms, bubble=res.bubble_ratio, peak=peak,
                       fits=max(peak) <= self.cluster.memory_bytes)
