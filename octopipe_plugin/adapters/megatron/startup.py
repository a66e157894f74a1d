"""Start-up of a Megatron run under `--pipeline-schedule octopipe`: find the plan, check it, give it to Megatron.

Runs right after Megatron parses its arguments and before it validates them, so every
setting Megatron derives (the virtual pipeline size, the layout in TransformerConfig, the
hybrid pattern's segments) comes from the plan's stages. The plan is, in this order: the
`--octopipe-plan` file; the plan saved next to the checkpoint being loaded; or a plan tuned
for `--octopipe-cluster`. The framework-neutral `plan_startup.plan_at_startup` runs those steps
on rank 0 and broadcasts the plan or rank 0's one-line error (the process group is opened here
when the launch provides one, as Megatron would open it, and Megatron reuses it). Rank 0 saves
the plan next to the checkpoint (`--save`). A plan that does not match the run stops start-up
with one message on every rank. A plan and flags whose checkpoints megatron-core 0.19.2 saves but cannot
load (MoE, a pipeline rank without a MoE layer: `moe_checkpoint_warning`) are warned about once, on rank 0.
A plan whose stage->rank map is not looped, or that splits the LM head, also installs the
model-construction hooks (pretrain_hooks.py) so Megatron builds the plan's chunks (and the head's shards).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from dataclasses import replace
from typing import Callable, Collection

from ...errors import OctoPipeError
from ...formats import Model, bind_plan, plan_to_dict
from ...formats.fingerprint import FINGERPRINT_KEY, cost_difference, layer_kinds_of, layer_kinds_text
from ...plan_startup import PlanSteps, plan_at_startup
from ...tuner.constraints import Constraints
from .arguments import PLAN_FILE, RunFacts, load_measured_costs, run_facts
from .compat import require_supported_megatron
from .graph import LayerSpec, hybrid_pattern, layer_specs, model_from_megatron
from .hooks import install_model_hooks
from .mapping import head_split, is_looped, side_split_blocker, split_problem, stage_layout_args
from .memory import uniform_memory_refusal
from .pretrain_hooks import MODEL_HOOKS
from .te import TeBackward, fuse_te_stages, fused_backward_model, te_backward
from .startup_profile import merge_costs, profiled_costs

log = logging.getLogger("octopipe.megatron")

# Megatron arguments that also set stages or virtual stages: the plan decides those.
_STAGE_ARGS = ("pipeline_model_parallel_layout", "num_virtual_stages_per_pipeline_rank",
               "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers")
_STAGE_FLAGS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def resolve_octopipe_plan(args):
    """Under `--pipeline-schedule octopipe`: find, check and apply the plan (args.octopipe_plan); returns args."""
    if getattr(args, "octopipe_profile", False):
        if getattr(args, "pipeline_schedule", "default") != "octopipe":
            raise OctoPipeError("--octopipe-profile measures costs to tune an OctoPipe plan; it needs "
                                "--pipeline-schedule octopipe and --octopipe-cluster")
        if args.octopipe_plan:
            raise OctoPipeError(f"--octopipe-profile measures costs to tune a plan at start-up, but --octopipe-plan "
                                f"{args.octopipe_plan} gives the plan; drop one of them")
    if getattr(args, "pipeline_schedule", "default") != "octopipe" or isinstance(args.octopipe_plan, dict):
        return args  # Megatron's own schedule; or resolved already (a patched parse_args under the launcher)
    require_supported_megatron()  # the patch route reaches here first: refuse another version before anything
    _refuse_stage_args(args)
    specs = layer_specs(args)
    facts = run_facts(args)
    plan, _ = plan_at_startup(_plan_steps(args, specs, facts))
    _apply_stages(args, plan, specs)
    _refuse_splits(args, plan)
    problem = uniform_memory_refusal(args, plan)  # before any model is built, on every rank
    if problem is None:
        from .pairs import launch_refusal

        problem = launch_refusal(args, plan)  # what megatron-core's combined step cannot run
    if problem is not None:
        raise OctoPipeError(f"--pipeline-schedule octopipe: {problem}")
    warning = moe_checkpoint_warning(args, plan, moe_layers(args, specs))
    if warning is not None and int(getattr(args, "rank", 0) or 0) == 0:  # once per launch, not once per rank
        log.warning("octopipe: %s", warning)
    args.octopipe_plan = plan_to_dict(plan)  # kept in args, so checkpoints record the plan they ran under
    if not is_looped(plan) or plan.splits:
        # Megatron's model construction is round-robin: let the plan's map decide it (patch route included); a
        # split LM head's shards are built there too
        install_model_hooks(MODEL_HOOKS)
    return args


def _refuse_splits(args, plan) -> None:
    """Split layers this run cannot run: one line naming the plan field, on every rank, before any model is built."""
    problem = split_refusal(args, plan)
    if problem is not None:
        raise OctoPipeError(f"--pipeline-schedule octopipe: {problem}")


def moe_layers(args, specs: list[LayerSpec]) -> set[int]:
    """Indices (the plan's layer numbers) of the layers that hold expert parameters: the MoE decoder layers, and the
    MTP layers where Megatron builds them as MoE (a hybrid pattern's MTP part with 'E'; a GPT model's MTP layer takes
    the last decoder layer's spec, megatron/training/models/gpt.py `mtp_block_spec`)."""
    found = {i for i, s in enumerate(specs) if s.kind == "moe"}
    pattern = hybrid_pattern(args)
    if pattern:
        from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

        mtp_moe = "E" in (parse_hybrid_pattern(pattern).mtp_pattern or "")
    else:
        decoder = [s for s in specs if s.name.startswith("decoder.layers.")]
        mtp_moe = bool(decoder) and decoder[-1].kind == "moe"
    if mtp_moe:
        found |= {i for i, s in enumerate(specs) if s.kind == "mtp"}
    return found


def moe_checkpoint_warning(args, plan, moe: Collection[int]) -> str | None:
    """Why the checkpoints this launch saves will not load (megatron-core 0.19.2), one line with the fixes, or None.

    A pure function of the launch's arguments (`save`, `ckpt_format`, `bf16`/`fp16`, `use_distributed_optimizer`,
    `num_experts`, `expert_model_parallel_size`), the plan's stages and `moe`, the plan's layer numbers that hold
    experts. megatron-core gives every rank the expert param group, and a pipeline rank with no MoE layer saves
    it as an empty list in the common state that only rank 0 writes: loading fails to merge the lists
    (docs/megatron-schedule.md, "Overlapped pairs")."""
    experts = int(getattr(args, "num_experts", 0) or 0) > 0 or int(
        getattr(args, "expert_model_parallel_size", 1) or 1) > 1
    dtype = "--bf16" if getattr(args, "bf16", False) else "--fp16" if getattr(args, "fp16", False) else None
    if not (experts and moe and getattr(args, "save", None) and dtype
            and (getattr(args, "ckpt_format", None) or "torch_dist") == "torch_dist"
            and not getattr(args, "use_distributed_optimizer", False)):
        return None
    held = {st.device for st in plan.stages if any(st.start <= i < st.end for i in moe)}
    without = [d for d in range(plan.num_devices) if d not in held]
    if not without:
        return None
    ranks = ", ".join(map(str, without))
    return (f"the plan leaves pipeline rank{'s' if len(without) > 1 else ''} {ranks} with no MoE layer, so the "
            f"--save checkpoints of this run (--ckpt-format torch_dist, {dtype}, no --use-distributed-optimizer) will "
            f"not load in megatron-core 0.19.2: every rank gets the expert param group "
            f"(core/optimizer/__init__.py:359-374), a rank without experts saves it as an empty list "
            f"(core/optimizer/optimizer.py:1162) in the common state (core/dist_checkpointing/dict_utils.py:55-62) "
            f"that only rank 0 writes (serialization.py:439-445), and loading fails at dict_utils.py:230 "
            f"('Cannot merge two lists with different lengths'); fix: a plan that gives every pipeline rank a MoE "
            f"layer, or --ckpt-format torch (measured to resume), or (untested) --use-distributed-optimizer")


def split_settings(args) -> dict:
    """What of a Megatron run's arguments decides which split layers it runs (mapping.side_split_blocker's
    keywords): the MTP depth, the tensor-parallel size, and whether the embedding is tied to the LM head."""
    return {"mtp_layers": int(getattr(args, "mtp_num_layers", 0) or 0),
            "tp_size": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            "tied": not getattr(args, "untie_embeddings_and_output_weights", False)}


def split_refusal(args, plan) -> str | None:
    """Why a Megatron run of `args` cannot run the plan's split layers (one line naming the plan field), or None."""
    if not plan.splits:
        return None
    # a split head tied to the embedding runs (its shards tied by executor.tied_rows); a split embedding tied does not
    problem = split_problem(plan, **split_settings(args))
    if problem is None and hybrid_pattern(args):
        problem = (f"plan splits: a HybridModel's forward gives no hook for its final-norm hidden states "
                   f"(GPTModel's output_processor); drop `splits` for --hybrid-layer-pattern models")
    return problem


def run_splits(args) -> dict:
    """The Constraints fields of what a Megatron run of `args` runs of a split plan: FRAMEWORK_SPLITS' Megatron
    entry, without the split embedding where split_refusal would refuse one (the rule split_problem applies to
    each split, mapping.side_split_blocker: a tied embedding, TP > 1, MTP), so the tuner keeps the head's split
    instead of proposing a plan the run refuses."""
    from ...tuner.constraints import framework_splits

    fields = dict(framework_splits("megatron"))
    if side_split_blocker("input", **split_settings(args)) is not None:
        fields["split_embedding"] = False
    return fields


def check_plan_matches_run(plan, specs: list[LayerSpec], facts: RunFacts, *, source: str = "plan",
                           hybrid: bool = False, run_model: Callable[[str | None], Model] | None = None) -> None:
    """Refuse, in one message, a plan whose model, pipeline size or micro-batch count differ from the run's.

    The model check reads the plan's own record of its layer kinds in order (the fingerprint that
    `bind_plan` writes, or `meta["layer_kinds"]` of plans tuned at start-up), so a plan for another
    model with the same layer count is refused; layer names are not compared (zoo plans name layers
    their own way). `run_model(gpu)` builds this run's cost graph: a fingerprint whose costs differ
    from it is warned about, with the difference (the plan still runs)."""
    problems = []
    if plan.stages[-1].end != len(specs):
        counts = {k: sum(s.kind == k for s in specs) for k in ("mtp",)}
        problems.append(f"it covers {plan.stages[-1].end} layers but this run's model has {len(specs)} (embedding, "
                        f"{len(specs) - 2 - counts['mtp']} decoder layers, {counts['mtp']} MTP layers, output layer)")
    recorded = _recorded_model(plan)
    kinds = [s.kind for s in specs]
    if recorded is not None and recorded[1] != kinds:
        name, theirs = recorded
        first = next((i for i, (a, b) in enumerate(zip(theirs, kinds)) if a != b), min(len(theirs), len(kinds)))
        where = (f"layer {first} is {theirs[first]!r} there and {kinds[first]!r} ({specs[first].name}) here"
                 if first < min(len(theirs), len(kinds)) else "one is longer")
        problems.append(f"it was made for another model: {name} [{layer_kinds_text(theirs)}], not this run's "
                        f"[{layer_kinds_text(kinds)}] ({where})")
    elif run_model is not None:
        _warn_cost_difference(plan, source, run_model)
    if plan.num_devices != facts.pipeline_size:
        problems.append(f"it has {plan.num_devices} devices but --pipeline-model-parallel-size is "
                        f"{facts.pipeline_size}")
    if plan.num_microbatches != facts.num_microbatches:
        problems.append(f"it has {plan.num_microbatches} micro-batches per step but this run has "
                        f"{facts.num_microbatches} (global batch / (micro-batch size x data-parallel size "
                        f"{facts.data_parallel_size}))")
    if facts.rampup:
        problems.append("--rampup-batch-size changes the micro-batch count during training, and a plan is made for "
                        "one count; drop the ramp-up or train the ramp-up phase with --pipeline-schedule default")
    if plan.num_stages % plan.num_devices == 0:
        per_device = {len(plan.stages_of(d)) for d in range(plan.num_devices)}
        if len(per_device) > 1:
            problems.append(f"it gives pipeline ranks different numbers of stages {sorted(per_device)}; Megatron "
                            "builds the same number of model chunks on every rank")
    else:
        problems.append(f"its {plan.num_stages} stages are not a multiple of the {plan.num_devices} pipeline ranks; "
                        "Megatron builds the same number of model chunks on every rank")
    if hybrid:
        # a HybridModel builds its MTP depths (the pattern's '/' part) with the loss, on the last stage
        mtp = [i for i, s in enumerate(specs) if s.kind == "mtp" and i < plan.stages[-1].start]
        if mtp:
            problems.append(f"it puts the MTP layers {mtp} before its last stage ({plan.num_stages - 1}, layers "
                            f"{plan.stages[-1].start}..{plan.stages[-1].end - 1}); a hybrid model builds its MTP "
                            "depths (the pattern's '/' part) with the loss: move them into the last stage")
    if problems:
        raise OctoPipeError(f"--pipeline-schedule octopipe: {source} does not match this run: "
                            + "; ".join(problems))


def _refuse_stage_args(args) -> None:
    given = [f"--{a.replace('_', '-')}" for a in _STAGE_ARGS if getattr(args, a, None) is not None]
    given += [f"--{a.replace('_', '-')}" for a in _STAGE_FLAGS if getattr(args, a, False)]
    pattern = hybrid_pattern(args)
    if pattern and "|" in pattern:
        given.append("'|' in --hybrid-layer-pattern")
    if given:
        raise OctoPipeError(f"--pipeline-schedule octopipe: the plan sets the pipeline stages; drop {', '.join(given)}")


def _recorded_model(plan) -> tuple[str, list[str]] | None:
    """(how the plan names its model, its layer kinds in order) from the plan's own record; None without one."""
    meta = plan.meta if isinstance(plan.meta, dict) else {}
    fp = (meta.get(FINGERPRINT_KEY) or {}).get("model") if isinstance(meta.get(FINGERPRINT_KEY), dict) else None
    if isinstance(fp, dict) and isinstance(fp.get("kinds"), str):
        return f"model {fp.get('name')!r} ({fp.get('num_layers')} layers)", layer_kinds_of(fp["kinds"])
    if meta.get("layer_kinds"):
        return f"model {plan.model or 'of the plan'!r} ({len(meta['layer_kinds'])} layers)", list(meta["layer_kinds"])
    return None


def _warn_cost_difference(plan, source: str, run_model) -> None:
    """One warning line when the plan's fingerprint records other costs than this run's analytic graph."""
    fp = (plan.meta or {}).get(FINGERPRINT_KEY)
    recorded = fp.get("model") if isinstance(fp, dict) else None
    if not isinstance(recorded, dict) or ((plan.meta or {}).get("tuned_for") or {}).get("profiled_kinds"):
        return  # nothing recorded, or costs measured on the device: an analytic graph is no yardstick
    try:
        model = run_model(recorded.get("gpu"))
    except OctoPipeError as exc:
        log.warning("octopipe: %s: its costs could not be compared with this run's (%s)", source, exc)
        return
    diff = cost_difference(recorded, model)
    if diff:
        log.warning("octopipe: %s was made for the same layers with other costs (%s); it runs, but its stage split "
                    "and predictions may not be the best for this run: re-tune with --octopipe-cluster", source, diff)


def _plan_steps(args, specs, facts) -> PlanSteps:
    """Where this run's plan comes from (plan_startup runs the steps on rank 0 and broadcasts the outcome).

    --octopipe-plan; else the plan saved next to --load; else tuned for --octopipe-cluster. The
    process group is opened first wherever a launch gives one (rank 0 decides, every rank hears it);
    --octopipe-profile measures on rank 0 *before* that, since the profiler opens and closes a
    one-rank group of its own. Rank 0 saves the plan next to --save.
    """
    load = getattr(args, "load", None)
    resume = os.path.join(load, PLAN_FILE) if load else None
    plan_file = args.octopipe_plan or None
    rank = int(getattr(args, "rank", 0) or 0)
    names = {plan_file: f"plan {plan_file}", resume: f"plan {resume} (saved with the checkpoint)"}
    profiled, failure = None, None
    if args.octopipe_cluster and getattr(args, "octopipe_profile", False) and rank == 0 and not (
            resume and os.path.exists(resume)):
        try:
            profiled = profiled_costs(args, name=_model_name(args))
        except OctoPipeError as exc:  # reported through plan_at_startup, so every rank stops with it
            failure = exc
    if args.octopipe_cluster or _launched(args):
        _open_process_group(args, facts)

    decision = functools.cache(lambda: te_backward(args))  # rank 0 decides (the GPU check's record is its)

    def tune():
        if not args.octopipe_cluster:
            raise OctoPipeError("--pipeline-schedule octopipe needs --octopipe-plan PATH, or --octopipe-cluster "
                                "NAME|PATH to tune a plan at start-up (no plan is saved next to --load either)")
        if failure is not None:
            raise failure
        return tune_for_run(args, facts, profiled, decision())

    def check(plan, source):
        tuned = source not in names
        check_plan_matches_run(plan, specs, facts, source=names.get(source, f"the plan tuned for "
                                                                            f"{args.octopipe_cluster}"),
                               hybrid=bool(hybrid_pattern(args)),
                               run_model=None if tuned else lambda gpu: _run_graph(args, facts, gpu, decision()))

    def adapt(plan, source):
        return fuse_te_stages(plan, specs, decision(), source=names.get(source, "the tuned plan"))

    save = getattr(args, "save", None)
    return PlanSteps(plan_file=plan_file, resume_file=resume, tune=tune, check=check, adapt=adapt,
                     save_to=(os.path.join(save, PLAN_FILE),) if save and rank == 0 else ())


def _run_graph(args, facts, gpu: str | None, decision: TeBackward) -> Model:
    """This run's analytic cost graph on `gpu` (the plan's recorded one), --octopipe-costs on top, TE fused."""
    return fused_backward_model(model_from_megatron(args, gpu=gpu or "H100", name=_model_name(args),
                                                    measured=load_measured_costs(args.octopipe_costs),
                                                    data_parallel_size=facts.data_parallel_size), decision)


def _launched(args) -> bool:
    """Whether this process belongs to a multi-process launch whose default group can be opened (torchrun's env)."""
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT"))


def tune_for_run(args, facts: RunFacts, profiled: dict | None = None, decision: TeBackward | None = None):
    """Tune a plan for this run's model and pipeline on the given cluster (what rank 0 does at start-up).

    `profiled`: kind -> measured cost fields (--octopipe-profile); the --octopipe-costs file goes on top.
    `decision`: how TE layers take their backward (te_backward(args) when not given): fused ones reach
    the tuner as B.
    """
    from ...costs import cost_gpu
    from ...tuner import tune

    cluster = tuning_cluster(args)
    if cluster.num_devices != facts.pipeline_size:
        raise OctoPipeError(f"--octopipe-cluster {args.octopipe_cluster} has {cluster.num_devices} devices but the "
                            f"pipeline has {facts.pipeline_size} ranks; give one device per pipeline rank "
                            f"(e.g. h100x{facts.pipeline_size})")
    gpu = cost_gpu(cluster, args.octopipe_gpu)
    measured = merge_costs(profiled or {}, load_measured_costs(args.octopipe_costs))
    model = model_from_megatron(args, gpu=gpu, name=_model_name(args), measured=measured,
                                data_parallel_size=facts.data_parallel_size)
    model = fused_backward_model(model, te_backward(args) if decision is None else decision)
    from .pairs import pair_support, runnable_plan, tuning_model

    # pairs only where this launch runs megatron-core's combined step (without its flag they would not overlap)
    pairs = pair_support(args)
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        pairs = replace(pairs, runs=False)
    model = tuning_model(model, pairs, args)
    constraints, notes = run_constraints(args, Constraints())
    if notes:
        log.info("octopipe: tuning for what Megatron builds: %s", "; ".join(notes))
    result = tune(model, cluster, facts.num_microbatches, time_budget_s=args.octopipe_tune_seconds,
                  seed=args.octopipe_seed, iterations=args.octopipe_tune_iterations, constraints=constraints)
    plan = runnable_plan(result.plan, pairs, args)
    meta = {**(plan.meta or {}), "layer_kinds": [layer.kind for layer in model.layers],
            "tuned_for": {"cluster": str(args.octopipe_cluster), "gpu": gpu,
                          **({"profiled_kinds": sorted(profiled)} if profiled else {})}}
    return bind_plan(replace(plan, meta=meta), model, cluster)  # saved next to --save: later runs check it


def run_constraints(args, asked: Constraints) -> tuple[Constraints, list[str]]:
    """The user's constraints plus what Megatron's start-up needs of this run, and a line for each addition.

    Megatron builds the same number of model chunks on every rank. Any stage->rank map is fine, for
    GPT and hybrid (Mamba) models alike (pretrain_hooks builds the plan's chunks).
    """
    notes, cons = [], asked
    if not cons.uniform_stages_per_device:
        cons = replace(cons, uniform_stages_per_device=True)
        notes.append("the same number of stages on every rank (Megatron builds as many model chunks on each)")
    return cons, notes


def tuning_cluster(args):
    """--octopipe-cluster with --octopipe-memory-headroom kept free on every rank."""
    from ...costs import resolve_cluster
    from ...headroom import DEFAULT, parse_headroom, with_headroom

    where = "--octopipe-memory-headroom"
    return with_headroom(resolve_cluster(args.octopipe_cluster),
                         parse_headroom(getattr(args, "octopipe_memory_headroom", DEFAULT), where), where)


def _model_name(args) -> str:
    return "megatron-hybrid" if hybrid_pattern(args) else "megatron-gpt"


def _open_process_group(args, facts) -> None:
    """Open the default process group as megatron.training.initialize would; Megatron then reuses it."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or facts.pipeline_size * facts.data_parallel_size == 1:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        torch.cuda.set_device(int(getattr(args, "local_rank", None) or os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=args.distributed_backend, rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))


def _apply_stages(args, plan, specs) -> None:
    for key, value in stage_layout_args(plan, specs, args).items():
        setattr(args, key, value)
    if not hybrid_pattern(args):
        args.num_layers = sum(s.kind in ("dense", "dense_local", "moe") for s in specs)
