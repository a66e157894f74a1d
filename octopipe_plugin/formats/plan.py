"""`octopipe-plan/1`: stage boundaries, stage->device map and per-device action lists."""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field

from .fields import check_format, check_value, field, load_json, objects, write_json
from .. import limits as L
from ..errors import FormatError, PlanError
from ..actions import RULES, Action, Kind, format_schedule, forms
from .ranges import stage_range_problem

PLAN_FORMAT = "octopipe-plan/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """A pipeline stage: the half-open layer range [start, end) and its device."""

    start: int
    end: int
    device: int

    @property
    def num_layers(self) -> int:
        """Layers owned by the stage (may be 0 for an empty stage)."""
        return self.end - self.start


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What the tuner decides and the executor runs (docs/formats.md)."""

    model: str
    num_devices: int
    num_microbatches: int
    stages: tuple[Stage, ...]
    schedule: tuple[tuple[Action, ...], ...]
    predicted: dict = dc_field(default_factory=dict)
    meta: dict = dc_field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.stages)

    def stages_of(self, device: int) -> list[int]:
        """Stages a device runs, in model order."""
        return [s for s, st in enumerate(self.stages) if st.device == device]

    def boundaries(self) -> list[int]:
        """Stage start indices plus the end of the last stage."""
        return [st.start for st in self.stages] + [self.stages[-1].end]


def plan_from_dict(data: dict, src: str = "<dict>", num_layers: int | None = None) -> Plan:
    """Build a Plan from a parsed document, refusing bad input (coverage checked when num_layers is given)."""
    check_format(data, src, "octopipe-plan")
    num_devices = field(data, "num_devices", src, "$", int, minimum=1, maximum=L.MAX_DEVICES)
    m = field(data, "num_microbatches", src, "$", int, minimum=1, maximum=L.MAX_MICROBATCHES)
    stages = []
    for path, raw in objects(data, "stages", src, maximum=L.MAX_DEVICES * L.MAX_STAGES_PER_DEVICE):
        rng = field(raw, "layers", src, path, list)
        if len(rng) != 2:
            raise FormatError(src, f"{path}.layers", "[start, end] (two integers)", rng)
        start = check_value(rng[0], src, f"{path}.layers[0]", int, minimum=0, maximum=L.MAX_LAYERS)
        end = check_value(rng[1], src, f"{path}.layers[1]", int, minimum=start, maximum=L.MAX_LAYERS)
        dev = field(raw, "device", src, path, int, minimum=0)
        if dev >= num_devices:
            raise FormatError(src, f"{path}.device", f"a device in 0..{num_devices - 1}", dev)
        stages.append(Stage(start=start, end=end, device=dev))
    _check_coverage(stages, src, num_layers)
    schedule = _read_schedule(data, src, num_devices)
    plan = Plan(
        model=field(data, "model", src, "$", str, default=""),
        num_devices=num_devices,
        num_microbatches=m,
        stages=tuple(stages),
        schedule=schedule,
        predicted=field(data, "predicted", src, "$", dict, default={}),
        meta=field(data, "meta", src, "$", dict, default={}),
    )
    try:
        validate_plan(plan)
    except PlanError as exc:
        raise FormatError(src, "$.schedule", "a complete schedule", str(exc)) from None
    return plan


def _check_coverage(stages: list[Stage], src: str, num_layers: int | None) -> None:
    problem = stage_range_problem([(st.start, st.end) for st in stages], num_layers)
    if problem is not None:
        raise FormatError(src, problem.path, problem.expected, problem.got)


def _read_schedule(data: dict, src: str, num_devices: int) -> tuple[tuple[Action, ...], ...]:
    rows = field(data, "schedule", src, "$", list)
    if len(rows) != num_devices:
        raise FormatError(src, "$.schedule", f"one action list per device ({num_devices})", f"{len(rows)} lists")
    out = []
    for d, row in enumerate(rows):
        check_value(row, src, f"$.schedule[{d}]", list)
        acts = []
        for j, text in enumerate(row):
            try:
                acts.append(Action.parse(text))
            except ValueError as exc:
                raise FormatError(src, f"$.schedule[{d}][{j}]", "an action like '3F12'", text) from exc
        out.append(tuple(acts))
    return tuple(out)


def validate_plan(plan: Plan, num_layers: int | None = None, *, forward_only: bool = False) -> None:
    """Check coverage and ownership: each (stage, mb) runs every phase once in one form, on the stage's device.

    The phases and their forms come from the kind table (`actions.RULES`): today one F, and
    either B or both I and W. A `forward_only` plan (evaluation) runs the forward phase only.
    """
    problem = stage_range_problem([(st.start, st.end) for st in plan.stages], num_layers)
    if problem is not None:
        raise PlanError(problem.message)
    if len(plan.schedule) != plan.num_devices:
        raise PlanError(f"schedule has {len(plan.schedule)} device lists, plan has {plan.num_devices} devices")
    ns, m = plan.num_stages, plan.num_microbatches
    seen: set[Action] = set()
    for d, row in enumerate(plan.schedule):
        for a in row:
            if not 0 <= a.stage < ns:
                raise PlanError(f"device {d}: action {a} names stage {a.stage}, plan has stages 0..{ns - 1}")
            if not 0 <= a.microbatch < m:
                raise PlanError(f"device {d}: action {a} names micro-batch {a.microbatch}, plan has 0..{m - 1}")
            owner = plan.stages[a.stage].device
            if owner != d:
                raise PlanError(f"device {d}: action {a} belongs to stage {a.stage} on device {owner}")
            if a in seen:
                raise PlanError(f"device {d}: action {a} appears twice")
            seen.add(a)
    phases = forms()
    if forward_only:
        phases = {"forward": phases["forward"]}
        extra = next((a for a in sorted(seen) if RULES[a.kind].phase not in phases), None)
        if extra is not None:
            raise PlanError(f"a forward-only plan runs forwards only, it has {extra}")
    for s in range(ns):
        for mb in range(m):
            for phase, options in phases.items():
                _check_phase(seen, s, mb, phase, options)


def _check_phase(seen: set[Action], s: int, mb: int, phase: str, options: dict[str, tuple[Kind, ...]]) -> None:
    """Exactly one form of `phase` runs, completely, for (s, mb)."""
    def named(kinds) -> str:
        acts = [str(Action(s, k, mb)) for k in kinds]
        return acts[0] if len(acts) == 1 else "both " + " and ".join(acts)

    started = [form for form, kinds in options.items() if any(Action(s, k, mb) in seen for k in kinds)]
    if len(started) > 1:
        ran = ", ".join(str(Action(s, k, mb)) for k in options[started[0]] if Action(s, k, mb) in seen)
        raise PlanError(f"stage {s} micro-batch {mb}: both {ran} and a {started[1]} {phase}")
    if started and all(Action(s, k, mb) in seen for k in options[started[0]]):
        return
    if len(options) == 1:
        (kinds,) = options.values()
        raise PlanError(f"stage {s} micro-batch {mb}: no {phase} {named(kinds)}")
    raise PlanError(f"stage {s} micro-batch {mb}: needs " + " or ".join(named(k) for k in options.values()))


def plan_to_dict(plan: Plan) -> dict:
    """Serialise a Plan as an `octopipe-plan/1` document."""
    doc = {
        "format": PLAN_FORMAT,
        "model": plan.model,
        "num_devices": plan.num_devices,
        "num_microbatches": plan.num_microbatches,
        "stages": [{"layers": [st.start, st.end], "device": st.device} for st in plan.stages],
        "schedule": format_schedule(plan.schedule),
    }
    if plan.predicted:
        doc["predicted"] = plan.predicted
    if plan.meta:
        doc["meta"] = plan.meta
    return doc


def read_plan(source, num_layers: int | None = None) -> Plan:
    """Read an `octopipe-plan/1` file or dict."""
    data, src = load_json(source)
    return plan_from_dict(data, src, num_layers)


def write_plan(plan: Plan, path) -> None:
    """Write a Plan as `octopipe-plan/1` JSON."""
    write_json(plan_to_dict(plan), path)
