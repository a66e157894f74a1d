"""Turning a (layout, policy) or an explicit plan into a simulated, memory-checked outcome.

The simulator is the judge: every step time the tuner compares comes from `simulate`.
An `Evaluator` belongs to one tuning run; it caches stage costs per layout and counts
the work spent (actions scheduled plus actions simulated), which is what the search's
deterministic budget is measured in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..errors import DeadlockError
from ..formats import Plan
from ..simulator import SimOptions, simulate, stage_costs
from ..simulator.memory import least_live
from ..simulator.pairs import communicates
from .pairing import with_adjacent_pairs
from .memory_choices import NONE, MemoryLevers, full_job, full_recompute, repair as memory_repair
from .layout import Layout, comm_prefix, device_link, device_work, make_job
from .listsched import Policy, build_schedule, schedule_units
from .encoded import action_count


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """A simulated plan: step time, bubble, per-device peak memory and whether it fits."""

    plan: Plan | None  # None in a cache hit: the candidate was judged before (search skips it)
    step_ms: float
    bubble: float
    peak: tuple[int, ...]
    fits: bool
    judged: bool = True  # False: figures from the list scheduler's own clock, not yet replayed by the simulator

    @property
    def max_peak(self) -> int:
        """The fullest device's peak bytes."""
        return max(self.peak)


@dataclass(kw_only=True)
class Meter:
    """Work and simulations of one tuning run, shared by its evaluators at different micro-batch counts."""

    work: float = 0.0  # actions scheduled + simulated so far
    evaluations: int = 0


log = logging.getLogger(__name__)


class Evaluator:
    """Simulates candidates of one tuning problem, with caches and a work counter."""

    def __init__(self, model, cluster, num_microbatches: int, meter: Meter | None = None,
                 options: SimOptions | None = None, levers: MemoryLevers = NONE):
        self.model, self.cluster, self.m = model, cluster, num_microbatches
        self.levers = levers  # the memory choices the tuner may make (tuner/memory_choices.py)
        # choices only add time: a plan over memory no faster than this without them is not repaired (the search
        # sets it to the best it holds at this count)
        self.repair_below = float("inf")
        self.meter = meter or Meter()
        self.options = options or SimOptions()  # the judge's switches; the list scheduler prices hops alike
        self._jobs: dict[Layout, tuple] = {}
        # judged candidates; outcomes are kept without their plans, so long runs hold no schedules here
        self._seen: dict[tuple, Outcome | None] = {}
        # pairs can hide a layer's communication (tuner/pairing.py)
        self.pairing = communicates(model)
        self._floors: dict[Layout, float] = {}  # work_floor per layout (the search asks again for most it meets)
        self._comm = comm_prefix(model) if self.pairing else None
        # explicit orders judged with their adjacent F and B paired too: set by the search once it has run as it
        # does without pairs (tuner/search.py `_pair_elite`)
        self.pair_orders = False

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
        out = Evaluator(self.model, self.cluster, num_microbatches, meter=self.meter, options=self.options,
                        levers=self.levers)
        out.pair_orders = self.pair_orders
        return out

    def job(self, layout: Layout):
        """(Job, StageCosts, static bytes) of a layout, cached."""
        got = self._jobs.get(layout)
        if got is None:
            got = make_job(self.model, self.cluster, self.m, layout, self.options.launch_ms, self.options.overheads)
            if self.levers.full:  # the scheduler plans with what every layer recomputed keeps
                got = (full_job(self.model, got[0], layout), *got[1:])
            self._jobs[layout] = got
        return got

    def work_floor(self, layout: Layout) -> float:
        """The busiest device's compute time (where pairs pay: its compute or link time): no schedule is faster."""
        got = self._floors.get(layout)
        if got is None:
            got = self._floors[layout] = self._work_floor(layout)
        return got

    def _work_floor(self, layout: Layout) -> float:
        _, sc, _ = self.job(layout)
        work = device_work(sc, layout.devices, self.cluster.num_devices, self.m)
        if not self.pairing:
            return max(work)
        # a pair hides communication behind the other half's compute: the floor is each device's compute, or its
        # link time where that is longer (with the all-to-alls counted, layouts that pair well were never tried)
        link = device_link(self._comm, layout, self.cluster.num_devices, self.m)
        return max(max(w - c, c) for w, c in zip(work, link))

    def static_fits(self, layout: Layout) -> bool:
        """Whether every device can hold its stages' state and one activation of each."""
        job, _, static = self.job(layout)
        nd = self.cluster.num_devices
        if self.levers.recompute == "auto":  # one micro-batch of each stage with every layer recomputed
            key = ("least", layout)
            if key not in self._jobs:
                self._jobs[key] = full_job(self.model, job, layout)
            job = self._jobs[key]
        live = least_live(layout.devices, job.activation, nd)
        return max(static[d] + live[d] for d in range(nd)) <= self.cluster.usable_memory_bytes

    def scheduled(self, layout: Layout, policy: Policy) -> Outcome | None:
        """List-schedule a layout under a policy and simulate it; None when the policy starves."""
        key = (layout, policy)
        if key in self._seen:
            return self._seen[key]
        out = self.schedule_and_simulate(layout, policy)
        self._seen[key] = None if out is None else replace(out, plan=None)
        return out

    def schedule_and_simulate(self, layout: Layout, policy: Policy) -> Outcome | None:
        """List-schedule without the cache (for a final, full-count plan); simulated unless the scheduler timed it.

        The compiled scheduler keeps the reference clock itself (each action starts at max(device
        free, inputs ready), as the simulator does) and its peak live activations, so its outcome
        comes unjudged: `judge` replays it in the simulator before anything keeps it.
        """
        job, sc, static = self.job(layout)
        self.work += schedule_units(job)
        schedule = build_schedule(job, policy)
        if schedule is None:
            return None
        plan = self.plan_of(layout, schedule, {"schedule": "octopipe", "policy": policy.describe()})
        clock = getattr(schedule, "clock", None)
        # its clock is the reference one (pairs included: it pairs by the simulator's rule, tuner/listsched.py)
        if clock is None or self.options.contention or not self.options.overlap or self.levers.full:
            return self.simulated(plan, costs=sc, pair=False)  # the policy chose its pairs
        self.meter.evaluations += 1
        step, live = clock
        busy = self.m * sum(sc.fwd) + self.m * sum(sc.bwd) + self.m * sum(sc.wgrad)
        peak = tuple(static[d] + live[d] for d in range(self.cluster.num_devices))
        bubble = 1.0 - busy / (step * self.cluster.num_devices) if step > 0 else 0.0
        return Outcome(plan=plan, step_ms=step, bubble=bubble, peak=peak,
                       fits=max(peak) <= self.cluster.usable_memory_bytes, judged=False)

    def judge(self, out: Outcome | None) -> Outcome | None:
        """The outcome replayed by the simulator (the judge); as it is when it already was."""
        if out is None or out.judged or out.plan is None:
            return out
        sim = self.simulated(out.plan, costs=self.job(Layout.of_stages(out.plan.stages))[1])
        if sim is not None and abs(sim.step_ms - out.step_ms) > 1e-6 * max(1.0, out.step_ms):
            log.warning("list scheduler clock %.6f ms != simulator %.6f ms; keeping the simulator's",
                        out.step_ms, sim.step_ms)
        return sim

    def ordered(self, layout: Layout, schedule) -> Outcome | None:
        """Simulate a layout with an explicit per-device order; None when it deadlocks."""
        key = (layout, schedule)
        key = key + (self.pair_orders,)
        if key in self._seen:
            return self._seen[key]
        _, sc, _ = self.job(layout)
        self.work += action_count(schedule)  # hashing the order for the cache
        # an explicit order (a built-in's, a reordered one) keeps no pairs of its own: judged paired too (`simulated`)
        out = self.simulated(self.plan_of(layout, schedule, {"schedule": "octopipe"}), costs=sc)
        self._seen[key] = None if out is None else replace(out, plan=None)
        return out

    def plan_of(self, layout: Layout, schedule, meta: dict | None = None) -> Plan:
        """The Plan of a layout run in the given per-device order (with the pairs a pairing policy made)."""
        return Plan(model=self.model.name, num_devices=self.cluster.num_devices, num_microbatches=self.m,
                    stages=layout.stages(), schedule=schedule, meta=meta or {},
                    pairs=getattr(schedule, "pairs", ()))

    def run(self, layout: Layout, spec) -> Outcome | None:
        """Evaluate a candidate whose spec is a Policy (list-scheduled) or an explicit order."""
        if isinstance(spec, Policy):
            return self.scheduled(layout, spec)
        return self.ordered(layout, spec)

    def simulated(self, plan: Plan, costs=None, *, pair: bool = True, repair: bool = True) -> Outcome | None:
        """Simulate an explicit plan; None when it deadlocks. Where pairs can pay (`pairing`, `pair_orders`) and
        `pair`, a plan without pairs is also judged with its adjacent F and B paired (tuner/pairing.py), and the
        better kept. A plan over memory is first repaired by memory choices where the levers allow (`repair`)."""
        sc = costs if costs is not None else stage_costs(self.model, plan.stages)
        if self.levers.full and not plan.memory and not getattr(plan, "splits", ()):
            plan = full_recompute(self.model, plan)
        out = self._simulated(plan, sc, repair)
        if not (self.pairing and self.pair_orders and pair) or plan.pairs:
            return out
        paired = with_adjacent_pairs(plan)
        if paired is plan:
            return out
        other = self._simulated(paired, sc, repair)
        if other is None:
            return out
        if out is None or (other.fits, -other.step_ms) > (out.fits, -out.step_ms):
            return other
        return out

    def _simulated(self, plan: Plan, sc, repair: bool = False) -> Outcome | None:
        out = self._judged(plan, sc)
        if repair and self.levers.auto and out is not None and not out.fits and out.step_ms < self.repair_below:
            return memory_repair(self, plan, sc, out, self._judged) or out
        return out

    def _judged(self, plan: Plan, sc) -> Outcome | None:
        self.work += action_count(plan.schedule)
        self.meter.evaluations += 1
        try:
            res = simulate(self.model, self.cluster, plan, self.options, costs=sc, detail=False)
        except DeadlockError:
            return None
        peak = tuple(res.peak_memory_bytes)
        return Outcome(plan=plan, step_ms=res.step_time_ms, bubble=res.bubble_ratio, peak=peak,
                       fits=max(peak) <= self.cluster.usable_memory_bytes)
