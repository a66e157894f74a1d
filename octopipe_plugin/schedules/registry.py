"""The registry of built-in schedules and `build_plan`, which turns a name into a validated Plan."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import OctoPipeError, PlanError
from ..formats import Plan, Stage, validate_plan
from ..formats.ranges import stage_range_problem
from ..partition import balanced_split, megatron_split
from . import generators as gen
from .placement import Placement, place

Generator = Callable[[Sequence[int], int, int], tuple]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """A named generator, the placement it expects and what it needs of the configuration."""

    name: str
    generate: Generator
    placement: Placement
    stages_per_device: int | None  # None: any v >= 1; otherwise exactly this many
    min_microbatches: Callable[[int, int], int]  # (devices, stages per device) -> smallest m served
    requirements: str
    uses_split_backward: bool = False
    overlapped_pairs: bool = False  # the generator returns an actions.PairedSchedule (F&B run overlapped)
    extra_check: Callable[[int, int, int], object] | None = None  # (devices, m, v); raises PlanError to refuse

    def check(self, num_devices: int, num_microbatches: int, stages_per_device: int) -> None:
        """Refuse, with the reason, a configuration this schedule cannot serve."""
        if num_devices < 1:
            raise PlanError(f"{self.name}: needs at least one device, got {num_devices}")
        fixed = self.stages_per_device
        if fixed is not None and stages_per_device != fixed:
            raise PlanError(f"{self.name}: needs exactly {fixed} stage(s) per device, got {stages_per_device} "
                            f"({self.requirements})")
        if stages_per_device < 1:
            raise PlanError(f"{self.name}: stages per device must be >= 1, got {stages_per_device}")
        least = self.min_microbatches(num_devices, stages_per_device)
        if num_microbatches < least:
            raise PlanError(f"{self.name}: needs at least {least} micro-batches on {num_devices} devices, "
                            f"got {num_microbatches} ({self.requirements})")
        if self.extra_check is not None:
            self.extra_check(num_devices, num_microbatches, stages_per_device)

    def stages_for(self, stages_per_device: int | None) -> int:
        """The stage count per device to use: the fixed one, or the caller's (1 when unset)."""
        if stages_per_device is None:
            return self.stages_per_device or 1
        return stages_per_device


def _interleaved_min(p: int, v: int) -> int:
    return p if v > 1 else 1


def _zb_rounds_check(p: int, m: int, v: int) -> None:
    """Interleaved ZB's rounds must divide m when v > 1 (the generator's own refusal, stated up front)."""
    gen.zb_round_size(p, m, v)  # check() has already refused p < 1 and m < 1


def _combined_check(p: int, m: int, v: int) -> None:
    """Combined 1F1B with one device is Megatron's no-pipelining schedule: one stage (the generator's refusal)."""
    if p == 1 and v > 1:
        raise PlanError(f"combined-1f1b: Megatron runs no pipeline schedule with one device; use 1 stage, got {v}")


SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({
    spec.name: spec
    for spec in (
        ScheduleSpec(name="gpipe", generate=gen.gpipe, placement=Placement.LOOPED, stages_per_device=1,
                     min_microbatches=lambda p, v: 1,
                     requirements="one stage per device; any m >= 1; holds all m activations"),
        ScheduleSpec(name="1f1b", generate=gen.one_f_one_b, placement=Placement.LOOPED, stages_per_device=1,
                     min_microbatches=lambda p, v: 1,
                     requirements="one stage per device; any m >= 1; device r holds min(p-r, m) activations"),
        ScheduleSpec(name="interleaved-1f1b", generate=gen.interleaved_1f1b, placement=Placement.LOOPED,
                     stages_per_device=None, min_microbatches=_interleaved_min,
                     requirements="v >= 1 stages per device looped (stage s on device s % p); "
                                  "m >= p when v > 1 (Megatron's micro-batch groups); v = 1 is plain 1F1B"),
        ScheduleSpec(name="combined-1f1b", generate=gen.combined_1f1b, placement=Placement.LOOPED,
                     stages_per_device=None, min_microbatches=lambda p, v: p, overlapped_pairs=True,
                     extra_check=_combined_check,
                     requirements="Megatron's 1F1B under --overlap-moe-expert-parallel-comm: v >= 1 stages "
                                  "per device looped; m >= p (Megatron's micro-batch groups); one warm-up forward "
                                  "more than interleaved-1f1b, each steady-state F&B an overlapped pair (hides the "
                                  "MoE all-to-all); one device: v = 1, any m"),
        ScheduleSpec(name="zb-h1", generate=gen.zb_h1, placement=Placement.LOOPED, stages_per_device=1,
                     min_microbatches=lambda p, v: 1, uses_split_backward=True,
                     requirements="one stage per device; any m >= 1; split backward (I, W); 1F1B's peak memory"),
        ScheduleSpec(name="interleaved-zb", generate=gen.interleaved_zb, placement=Placement.LOOPED,
                     stages_per_device=None, min_microbatches=lambda p, v: 1, uses_split_backward=True,
                     extra_check=_zb_rounds_check,
                     requirements="v >= 1 stages per device looped; split backward (I, W); v = 1 is zb-h1 (any m); "
                                  "v > 1: m < 2p or m divisible by m // p (torch's rounds of g = m // max(1, m // p)"
                                  "); torch's ZB1P order; each device peaks at (v-1)g + p activations"),
        ScheduleSpec(name="zb-v", generate=gen.zb_v, placement=Placement.V, stages_per_device=2,
                     min_microbatches=lambda p, v: 1, uses_split_backward=True,
                     requirements="exactly 2 stages per device in a V (stage s and 2p-1-s on device s); "
                                  "any m >= 1; split backward (I, W)"),
        ScheduleSpec(name="dualpipev", generate=gen.dualpipev, placement=Placement.V, stages_per_device=2,
                     min_microbatches=lambda p, v: 2 * p, uses_split_backward=True,
                     overlapped_pairs=True,
                     requirements="exactly 2 stages per device in a V; m >= 2p; the main phase's "
                                  "overlapped F&B steps as pairs"),
    )
})


def get_schedule(name: str) -> ScheduleSpec:
    """The spec of a built-in schedule; an unknown name is refused with the list of valid ones."""
    spec = SCHEDULES.get(str(name).lower())
    if spec is None:
        raise OctoPipeError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    return spec


def stage_devices_for(name: str, num_devices: int, stages_per_device: int | None = None) -> list[int]:
    """The stage -> device map schedule `name` runs on."""
    spec = get_schedule(name)
    return place(spec.placement, num_devices, spec.stages_for(stages_per_device))


def build_plan(model, name: str, num_devices: int, num_microbatches: int, stages_per_device: int | None = None,
               boundaries=None, split: str = "megatron", validate: bool = True):
    """A validated Plan running built-in schedule `name` on `model`.

    Stage ranges come from `boundaries` (pairs, or cut points [0, ..., L]) when given, else from
    `split`: 'megatron' (even decoder split) or 'balanced' (min-max DP). `stages_per_device`
    None means the schedule's own (2 for the V schedules, else 1). `validate=False` skips the
    plan check for callers that simulate the plan anyway (the tuner, on long schedules).
    """
    spec = get_schedule(name)
    v = spec.stages_for(stages_per_device)
    spec.check(num_devices, num_microbatches, v)
    n_stages = num_devices * v
    if boundaries is not None:
        ranges = _ranges(boundaries, model.num_layers, n_stages)
    elif split == "megatron":
        ranges = megatron_split(model, n_stages)
    elif split == "balanced":
        ranges = balanced_split(model, n_stages)
    else:
        raise OctoPipeError(f"unknown split {split!r}; valid: megatron, balanced (or explicit boundaries)")
    devices = place(spec.placement, num_devices, v)
    schedule = spec.generate(devices, num_devices, num_microbatches)
    pairs = tuple(getattr(schedule, "pairs", ()))  # a PairedSchedule's overlapped pairs (generators.py)
    stages = tuple(Stage(start=a, end=b, device=d) for (a, b), d in zip(ranges, devices))
    plan = Plan(model=model.name, num_devices=num_devices, num_microbatches=num_microbatches, stages=stages,
                schedule=tuple(schedule), pairs=pairs,
                meta={"schedule": spec.name, "split": "explicit" if boundaries else split, "stages_per_device": v})
    if validate:
        validate_plan(plan, model.num_layers)
    return plan


def _ranges(boundaries, num_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Normalise explicit boundaries to consecutive (start, end) pairs covering every layer."""
    items = list(boundaries)
    if items and all(isinstance(b, int) for b in items):
        ranges = list(zip(items[:-1], items[1:]))
    else:
        ranges = [(int(a), int(b)) for a, b in items]
    if len(ranges) != n_stages:
        raise PlanError(f"boundaries give {len(ranges)} stages, the schedule needs {n_stages}")
    problem = stage_range_problem(ranges, num_layers)
    if problem is not None:
        raise PlanError(f"boundaries: {problem.message}")
    return ranges
