"""`octopipe-plan/1`: stage boundaries, stage->device map and per-device action lists."""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field

from .fields import check_format, check_value, field, load_json, objects, write_json
from .. import limits as L
from ..errors import FormatError, PlanError
from ..actions import PAIR_SEP, RULES, Action, Kind, format_schedule, forms, pair_problem, parse_entry, shard_kinds
from .memory import MemoryChoice, memory_from_dict, memory_problem, memory_to_dict
from .ranges import stage_range_problem
from .splits import (
    FORWARD_SHARD_KINDS, SplitLayer, owner_stage, side_of, split_problem, splits_from_list, splits_to_list,
)

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
    # Layers split over several devices by vocabulary rows (formats/splits.py); empty: every layer is whole.
    splits: tuple[SplitLayer, ...] = ()
    # Overlapped pairs (first, second), sorted: the second half right after the first in their device's list, both
    # run as one overlapped unit (docs/formats.md, "Overlapped pairs"); empty: every action runs alone.
    pairs: tuple[tuple[Action, Action], ...] = ()
    # Per-layer memory choices (layer index, choice), sorted (formats/memory.py; docs/formats.md "Memory choices");
    # empty: every layer keeps its activation on the device until its backward frees it.
    memory: tuple[tuple[int, MemoryChoice], ...] = ()

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.stages)

    @property
    def first_device(self) -> int:
        """The device that runs the first stage (it loads the inputs)."""
        return self.stages[0].device

    @property
    def loss_device(self) -> int:
        """The device that runs the last stage (it computes the loss)."""
        return self.stages[-1].device

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
    schedule, pairs = _read_schedule(data, src, num_devices)
    memory = memory_from_dict(data["memory"], src, num_layers) if data.get("memory") else ()
    raw_splits = data.get("splits") or []
    splits = splits_from_list(raw_splits, src) if raw_splits else ()
    problem = split_problem(splits, stages, num_devices)
    if problem is not None:
        raise FormatError(src, "$.splits", "split layers that fit the plan's stages and devices", problem)
    plan = Plan(
        model=field(data, "model", src, "$", str, default=""),
        num_devices=num_devices,
        num_microbatches=m,
        stages=tuple(stages),
        schedule=schedule,
        predicted=field(data, "predicted", src, "$", dict, default={}),
        meta=field(data, "meta", src, "$", dict, default={}),
        splits=splits,
        pairs=pairs,
        memory=memory,
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


def _read_schedule(data: dict, src: str, num_devices: int):
    """(schedule, pairs) of the document's `schedule`: each entry one action `3F12` or an overlapped pair `3F12+5B7`."""
    rows = field(data, "schedule", src, "$", list)
    if len(rows) != num_devices:
        raise FormatError(src, "$.schedule", f"one action list per device ({num_devices})", f"{len(rows)} lists")
    out, pairs = [], []
    for d, row in enumerate(rows):
        check_value(row, src, f"$.schedule[{d}]", list)
        acts = []
        for j, text in enumerate(row):
            try:
                got = parse_entry(text)
            except ValueError as exc:
                paired = isinstance(text, str) and PAIR_SEP in text
                expected = (f"an overlapped pair like '3F12+5B7' ({exc})" if paired else "an action like '3F12'")
                raise FormatError(src, f"$.schedule[{d}][{j}]", expected, text) from exc
            acts.extend(got)
            if len(got) == 2:
                pairs.append(got)
        out.append(tuple(acts))
    return tuple(out), tuple(sorted(pairs))


def validate_plan(plan: Plan, num_layers: int | None = None, *, forward_only: bool = False) -> None:
    """Check coverage and ownership: each (stage, mb) runs every phase once in one form, on the stage's device.

    The phases and their forms come from the kind table (`actions.RULES`): today one F, and
    either B or both I and W. A `forward_only` plan (evaluation) runs the forward phase only.
    """
    problem = stage_range_problem([(st.start, st.end) for st in plan.stages], num_layers)
    if problem is not None:
        raise PlanError(problem.message)
    memory = getattr(plan, "memory", ())
    if memory:
        problem = memory_problem(memory, num_layers if num_layers is not None else plan.stages[-1].end)
        if problem is not None:
            raise PlanError(problem)
    if len(plan.schedule) != plan.num_devices:
        raise PlanError(f"schedule has {len(plan.schedule)} device lists, plan has {plan.num_devices} devices")
    ns, m = plan.num_stages, plan.num_microbatches
    problem = split_problem(plan.splits, plan.stages, plan.num_devices)
    if problem is not None:
        raise PlanError(problem)
    shard_of = _shard_owners(plan)
    seen: set[Action] = set()
    shard_seen: set[tuple[int, Action]] = set()
    for d, row in enumerate(plan.schedule):
        for a in row:
            if not 0 <= a.stage < ns:
                raise PlanError(f"device {d}: action {a} names stage {a.stage}, plan has stages 0..{ns - 1}")
            if not 0 <= a.microbatch < m:
                raise PlanError(f"device {d}: action {a} names micro-batch {a.microbatch}, plan has 0..{m - 1}")
            if RULES[a.kind].side is not None:
                _check_shard_action(shard_of, shard_seen, d, a)
                continue
            owner = plan.stages[a.stage].device
            if owner != d:
                raise PlanError(f"device {d}: action {a} belongs to stage {a.stage} on device {owner}")
            if a in seen:
                raise PlanError(f"device {d}: action {a} appears twice")
            seen.add(a)
    _check_pairs(plan)
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
    if forward_only:
        extra = next((a for _, a in sorted(shard_seen) if a.kind not in FORWARD_SHARD_KINDS), None)
        if extra is not None:
            raise PlanError(f"a forward-only plan runs forwards only (of split layers H, J and E), it has {extra}")
    _check_shards_complete(plan, shard_seen, FORWARD_SHARD_KINDS if forward_only else None)


def _check_pairs(plan: Plan) -> None:
    """Each overlapped pair: two halves the kind table lets pair, of two micro-batches, adjacent on one device, each
    action in at most one pair. A pair whose halves wait on each other through other devices is a deadlock, which
    the simulator (executor.validate.check_runnable) finds and names."""
    if not plan.pairs:
        return
    device_of = {a: (d, i) for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}
    used: set[Action] = set()
    for first, second in plan.pairs:
        name = f"{first}{PAIR_SEP}{second}"
        problem = pair_problem(first, second)
        if problem is not None:
            raise PlanError(problem)
        for a in (first, second):
            if a not in device_of:
                raise PlanError(f"pair {name}: {a} is in no device's list")
            if a in used:
                raise PlanError(f"pair {name}: {a} is already in another pair (an action runs in at most one)")
            used.add(a)
        (d1, i1), (d2, i2) = device_of[first], device_of[second]
        if d1 != d2:
            raise PlanError(f"pair {name}: its halves sit on devices {d1} and {d2}; a pair runs on one device "
                            f"(pair actions of stages on the same device)")
        if i2 != i1 + 1:
            raise PlanError(f"pair {name}: on device {d1} its halves are actions {i1} and {i2}; the second half "
                            f"must come right after the first")


def _shard_owners(plan: Plan) -> dict[str, tuple[int, SplitLayer]]:
    """side ('output' / 'input') -> (owner stage, split record) of the plan's split layers."""
    num_layers = plan.stages[-1].end if plan.stages else 0
    return {side_of(sp, num_layers): (owner_stage(sp, plan.stages), sp) for sp in plan.splits}


def _check_shard_action(shard_of, shard_seen, d: int, a: Action) -> None:
    """A shard action names its split layer's owner stage and runs on one of the layer's shard devices, once."""
    side = RULES[a.kind].side
    got = shard_of.get(side)
    what = "LM head" if side == "output" else "embedding"
    if got is None:
        raise PlanError(f"device {d}: action {a} is a {RULES[a.kind].noun}, but the plan splits no {what} "
                        f"(add it to `splits` or drop the action)")
    owner, sp = got
    if a.stage != owner:
        raise PlanError(f"device {d}: action {a} names stage {a.stage}; the split {what} belongs to stage {owner}")
    if d not in sp.devices:
        raise PlanError(f"device {d}: action {a} runs on a device without a shard of layer {sp.layer} "
                        f"(its shards are on devices {list(sp.devices)})")
    if (d, a) in shard_seen:
        raise PlanError(f"device {d}: action {a} appears twice")
    shard_seen.add((d, a))


def _check_shards_complete(plan: Plan, shard_seen, only=None) -> None:
    """Every shard device runs each of its side's shard kinds (of `only`, when given) once for every micro-batch."""
    for side, (owner, sp) in _shard_owners(plan).items():
        kinds = [k for k in shard_kinds(side) if only is None or k in only]
        for d in sp.devices:
            for k in kinds:
                for mb in range(plan.num_microbatches):
                    a = Action(owner, k, mb)
                    if (d, a) not in shard_seen:
                        raise PlanError(f"device {d}: no {RULES[k].noun} {a} (device {d} holds a shard of layer "
                                        f"{sp.layer}, so it runs {'/'.join(x.value for x in kinds)} "
                                        f"of every micro-batch)")


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
        "schedule": format_schedule(plan.schedule, plan.pairs),
    }
    if plan.predicted:
        doc["predicted"] = plan.predicted
    if plan.meta:
        doc["meta"] = plan.meta
    if plan.splits:
        doc["splits"] = splits_to_list(plan.splits)
    if plan.memory:
        doc["memory"] = memory_to_dict(plan.memory)
    return doc


def read_plan(source, num_layers: int | None = None) -> Plan:
    """Read an `octopipe-plan/1` file or dict."""
    data, src = load_json(source)
    return plan_from_dict(data, src, num_layers)


def write_plan(plan: Plan, path) -> None:
    """Write a Plan as `octopipe-plan/1` JSON."""
    write_json(plan_to_dict(plan), path)
