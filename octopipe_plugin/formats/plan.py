"""`octopipe-plan/1`: stage boundaries, stage->device map and per-device action lists."""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field

from ._fields import check_format, check_value, field, load_json, objects, write_json
from ..errors import FormatError, PlanError
from ..schedules.actions import Action, Kind, format_schedule

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
    """What the tuner decides and the executor runs (FORMATS.md)."""

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

    def stage_device(self, stage: int) -> int:
        """Device that runs `stage`."""
        return self.stages[stage].device

    def stages_of(self, device: int) -> list[int]:
        """Stages a device runs, in model order."""
        return [s for s, st in enumerate(self.stages) if st.device == device]

    def boundaries(self) -> list[int]:
        """Stage start indices plus the end of the last stage."""
        return [st.start for st in self.stages] + [self.stages[-1].end]


def plan_from_dict(data: dict, src: str = "<dict>", num_layers: int | None = None) -> Plan:
    """Build a Plan from a parsed document, refusing bad input (coverage checked when num_layers is given)."""
    check_format(data, src, "octopipe-plan")
    num_devices = field(data, "num_devices", src, "$", int, minimum=1)
    m = field(data, "num_microbatches", src, "$", int, minimum=1)
    stages = []
    for path, raw in objects(data, "stages", src):
        rng = field(raw, "layers", src, path, list)
        if len(rng) != 2:
            raise FormatError(src, f"{path}.layers", "[start, end] (two integers)", rng)
        start = check_value(rng[0], src, f"{path}.layers[0]", int, minimum=0)
        end = check_value(rng[1], src, f"{path}.layers[1]", int, minimum=start)
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
    if stages[0].start != 0:
        raise FormatError(src, "$.stages[0].layers[0]", "0 (stages must cover the layers from the first)", stages[0].start)
    for i in range(1, len(stages)):
        if stages[i].start != stages[i - 1].end:
            raise FormatError(
                src, f"$.stages[{i}].layers[0]", f"{stages[i - 1].end} (the end of stage {i - 1}: ranges are consecutive)",
                stages[i].start,
            )
    if num_layers is not None and stages[-1].end != num_layers:
        raise FormatError(
            src, f"$.stages[{len(stages) - 1}].layers[1]", f"{num_layers} (the model's layer count)", stages[-1].end
        )


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
    """Check coverage and ownership: each (stage, mb) has F once and B or I+W once, on the stage's device.

    `forward_only` (an evaluation plan) wants every F once and no backward at all.
    """
    if plan.stages[0].start != 0:
        raise PlanError(f"stage 0 starts at layer {plan.stages[0].start}: stages must cover the layers from 0")
    for s in range(1, plan.num_stages):
        if plan.stages[s].start != plan.stages[s - 1].end:
            raise PlanError(f"stage {s} starts at layer {plan.stages[s].start}, stage {s - 1} ends at "
                            f"{plan.stages[s - 1].end}: stage ranges must be consecutive")
    for s, st in enumerate(plan.stages):
        if st.end < st.start:
            raise PlanError(f"stage {s} ends at layer {st.end} before it starts at {st.start}: expected end >= start")
    if num_layers is not None and plan.stages[-1].end != num_layers:
        raise PlanError(f"stages cover layers [0, {plan.stages[-1].end}) but the model has {num_layers}")
    if len(plan.schedule) != plan.num_devices:
        raise PlanError(f"schedule has {len(plan.schedule)} device lists, plan has {plan.num_devices} devices")
    ns, m = plan.num_stages, plan.num_microbatches
    seen: dict[tuple[int, Kind, int], int] = {}
    for d, row in enumerate(plan.schedule):
        for a in row:
            if not 0 <= a.stage < ns:
                raise PlanError(f"device {d}: action {a} names stage {a.stage}, plan has stages 0..{ns - 1}")
            if not 0 <= a.microbatch < m:
                raise PlanError(f"device {d}: action {a} names micro-batch {a.microbatch}, plan has 0..{m - 1}")
            owner = plan.stages[a.stage].device
            if owner != d:
                raise PlanError(f"device {d}: action {a} belongs to stage {a.stage} on device {owner}")
            key = (a.stage, a.kind, a.microbatch)
            if key in seen:
                raise PlanError(f"device {d}: action {a} appears twice")
            seen[key] = d
    for s in range(ns):
        for mb in range(m):
            if (s, Kind.F, mb) not in seen:
                raise PlanError(f"stage {s} micro-batch {mb}: no forward {s}F{mb}")
            if forward_only:
                extra = [k for k in (Kind.B, Kind.I, Kind.W) if (s, k, mb) in seen]
                if extra:
                    raise PlanError(f"stage {s} micro-batch {mb}: a forward-only plan has no {s}{extra[0].value}{mb}")
                continue
            has_b = (s, Kind.B, mb) in seen
            has_i, has_w = (s, Kind.I, mb) in seen, (s, Kind.W, mb) in seen
            if has_b and (has_i or has_w):
                raise PlanError(f"stage {s} micro-batch {mb}: both {s}B{mb} and a split backward")
            if not has_b and not (has_i and has_w):
                raise PlanError(f"stage {s} micro-batch {mb}: needs {s}B{mb} or both {s}I{mb} and {s}W{mb}")


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
