"""A plan checked against the DeepSpeed run it is meant for, before anything is built.

Pure Python (no DeepSpeed import): the layer count of the plan against the PipelineModule's
layer list (through `layer_of_spec` where the list differs from the model's layers), the
micro-batch count against DeepSpeed's gradient_accumulation_steps, the plan's device count
against the pipeline size and the world, and each overlapped pair against the list entries that
are DeepSpeed MoE layers (`RunShape.moe_entries`, read from the specs by moe_pairs.moe_entries): a
pair needs one on one of its halves' stages. Every refusal is one line naming the config field
(`ds_config: field $.octopipe.plan: expected ...`); `plan_startup` broadcasts it from rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import FormatError
from .config import CONFIG_KEY, check_microbatches

_SRC = "ds_config"


@dataclass(frozen=True)
class RunShape:
    """What a DeepSpeed run offers a plan: list entries, their layer map, pipeline size, world, GAS."""

    num_specs: int
    layer_of_spec: tuple[int, ...] | None
    pipe_size: int | None  # None: the module's topology is derived from the plan
    world_size: int
    gradient_accumulation_steps: int | None  # None: not checked (a plan given in code, checked by the engine)
    moe_entries: frozenset[int] | None = None  # list entries that are deepspeed.moe.layer.MoE (None: none known)


def gradient_accumulation_steps(ds_config: dict, world_size: int, pipe_size: int) -> int:
    """gradient_accumulation_steps as DeepSpeed derives it from the batch-size fields of a config."""
    gas = ds_config.get("gradient_accumulation_steps")
    if gas is not None:
        return int(gas)
    dp = max(1, world_size // max(1, pipe_size))
    total, mbs = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    if total is None or mbs is None:
        return 1  # DeepSpeed's default when only one of the two sizes is given
    return int(total) // (int(mbs) * dp)


def plan_layers(run: RunShape) -> int:
    """The number of OctoPipe layers the run's layer list holds (the list length, or via layer_of_spec)."""
    owners = run.layer_of_spec
    if owners is None:
        return run.num_specs
    if len(owners) != run.num_specs:
        raise FormatError(_SRC, f"$.{CONFIG_KEY}.layer_of_spec",
                          f"one OctoPipe layer index per PipelineModule list entry ({run.num_specs} entries)",
                          f"{len(owners)} indices")
    for j, owner in enumerate(owners):
        if owner < 0 or (j and owner < owners[j - 1]):
            raise FormatError(_SRC, f"$.{CONFIG_KEY}.layer_of_spec[{j}]",
                              "a non-decreasing layer index >= 0 (list entries run in model order)", owner)
    return (max(owners) + 1) if owners else 0


def check_plan(plan, run: RunShape, source: str = "") -> None:
    """Refuse (one line, naming the field) a plan that does not fit the run."""
    where = f" ({source})" if source else ""
    layers = plan_layers(run)
    planned = plan.stages[-1].end
    if planned != layers:
        hint = ("regenerate or tune the plan for this model" if run.layer_of_spec is not None else
                "give a plan for this model, or layer_of_spec to map list entries onto the plan's layers")
        listed = (f"the {layers} layers layer_of_spec maps the {run.num_specs} list entries onto"
                  if run.layer_of_spec is not None else f"the PipelineModule's {run.num_specs} list entries")
        raise FormatError(_SRC, f"$.{CONFIG_KEY}.plan",
                          f"a plan for {listed}; the plan{where} has {planned} layers ({hint})")
    if run.pipe_size is not None and plan.num_devices != run.pipe_size:
        raise FormatError(_SRC, f"$.{CONFIG_KEY}.plan",
                          f"a plan for the pipeline's {run.pipe_size} ranks; the plan{where} has {plan.num_devices} "
                          f"devices (build the PipelineModule with num_stages={plan.num_devices}, or give a plan for "
                          f"{run.pipe_size} devices)")
    pipe = run.pipe_size if run.pipe_size is not None else plan.num_devices
    if run.world_size % pipe:
        raise FormatError(_SRC, f"$.{CONFIG_KEY}.plan",
                          f"a pipeline size that divides the world of {run.world_size} ranks (one pipeline per "
                          f"data-parallel replica); the plan{where} has {plan.num_devices} devices")
    if run.gradient_accumulation_steps is not None:
        check_microbatches(plan.num_microbatches, run.gradient_accumulation_steps)
    pair_problem = unexposed_pair(plan, run)
    if pair_problem is not None:
        pair, stages, entries = pair_problem
        raise FormatError(_SRC, f"$.{CONFIG_KEY}.plan",
                          f"overlapped pairs whose stages hold a deepspeed.moe.layer.MoE list entry (LayerSpec(MoE, "
                          f"...): OctoPipeEngine runs its all-to-alls as phases the other half's compute hides); the "
                          f"plan{where} pairs {pair} on stages {stages}, whose list entries {entries} hold none (a MoE "
                          f"inside another module runs its all-to-alls inside that module's forward); give each MoE "
                          f"layer its own LayerSpec(MoE, ...) entry, re-plan for this model (`octopipe plan "
                          f"--deepspeed-config`), or drop the plan's \"pairs\" entry to run the same order unpaired")


def stage_entries(plan, run: RunShape, stage: int) -> range | list[int]:
    """The list entries of a plan's stage (through layer_of_spec where given)."""
    st = plan.stages[stage]
    if run.layer_of_spec is None:
        return range(st.start, st.end)
    return [j for j, owner in enumerate(run.layer_of_spec) if st.start <= owner < st.end]


def unexposed_pair(plan, run: RunShape):
    """The first pair neither of whose halves' stages holds a MoE list entry, as (pair, stages, entries) text; None
    where every pair has one (a pair of stages without all-to-alls would run half after half, priced as
    overlapped)."""
    moe = run.moe_entries or frozenset()
    for first, second in getattr(plan, "pairs", ()):
        stages = sorted({first.stage, second.stage})
        per_stage = [list(stage_entries(plan, run, s)) for s in stages]
        if not any(moe.intersection(e) for e in per_stage):
            shown = " and ".join(f"{e[0]}-{e[-1]}" if e else "(none)" for e in per_stage)
            return f"{first}+{second}", " and ".join(str(s) for s in stages), shown
    return None
