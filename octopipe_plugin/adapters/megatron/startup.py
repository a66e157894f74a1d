"""Start-up of a Megatron run under `--pipeline-schedule octopipe`: find the plan, check it, give it to Megatron.

Runs right after Megatron parses its arguments and before it validates them, so every
setting Megatron derives (the virtual pipeline size, the layout in TransformerConfig, the
hybrid pattern's segments) comes from the plan's stages. The plan is, in this order: the
`--octopipe-plan` file; the plan saved next to the checkpoint being loaded; or a plan tuned
on rank 0 for `--octopipe-cluster` and broadcast (the process group is then opened here,
as Megatron would open it, and Megatron reuses it). Rank 0 saves the plan next to the
checkpoint (`--save`). A plan that does not match the run stops start-up with one message.
A plan whose stage->rank map is not looped also installs the model-construction hooks
(pretrain_hooks.py) so Megatron builds the plan's chunks.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import replace

from ...errors import OctoPipeError
from ...formats import plan_from_dict, plan_to_dict, read_plan, write_plan
from .arguments import PLAN_FILE, RunFacts, load_measured_costs, run_facts
from .graph import LayerSpec, hybrid_pattern, layer_specs, model_from_megatron
from .layout import GPT_SYMBOLS, HYBRID_SYMBOLS
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
    if getattr(args, "pipeline_schedule", "default") != "octopipe":
        return args
    _refuse_stage_args(args)
    specs = layer_specs(args)
    facts = run_facts(args)
    plan, source = _find_plan(args, specs, facts)
    check_plan_matches_run(plan, specs, facts, source=source, hybrid=bool(hybrid_pattern(args)))
    _apply_stages(args, plan, specs)
    args.octopipe_plan = plan_to_dict(plan)  # kept in args, so checkpoints record the plan they ran under
    if not is_looped(plan):
        # Megatron's model construction is round-robin: let the plan's map decide it (patch route included)
        from .launch import install_model_hooks

        install_model_hooks()
    _save_next_to_checkpoint(args, plan)
    return args


def plan_of_args(args):
    """The Plan resolved at start-up (None under Megatron's default schedule)."""
    doc = getattr(args, "octopipe_plan", None)
    return plan_from_dict(doc, "<args.octopipe_plan>") if doc else None


def check_plan_matches_run(plan, specs: list[LayerSpec], facts: RunFacts, *, source: str = "plan",
                           hybrid: bool = False) -> None:
    """Refuse, in one message, a plan whose model, pipeline size or micro-batch count differ from the run's."""
    problems = []
    if plan.stages[-1].end != len(specs):
        counts = {k: sum(s.kind == k for s in specs) for k in ("mtp",)}
        problems.append(f"it covers {plan.stages[-1].end} layers but this run's model has {len(specs)} (embedding, "
                        f"{len(specs) - 2 - counts['mtp']} decoder layers, {counts['mtp']} MTP layers, output layer)")
    kinds = (plan.meta or {}).get("layer_kinds")
    if kinds and plan.stages[-1].end == len(specs) and list(kinds) != [s.kind for s in specs]:
        first = next(i for i, (a, s) in enumerate(zip(kinds, specs)) if a != s.kind)
        problems.append(f"it was made for another model: layer {first} is {kinds[first]!r} there and "
                        f"{specs[first].kind!r} ({specs[first].name}) here")
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
    if not is_looped(plan) and hybrid:
        # GPT chunks follow any map (pretrain_hooks); a HybridModel's chunks come from its '|' segments round-robin
        problems.append(f"it places stages on ranks {[st.device for st in plan.stages]} (not looped: stage i on rank "
                        f"i % {plan.num_devices}); a hybrid (Mamba) model's chunks follow the looped map only "
                        "(non-uniform stages and any per-rank order are fine)")
    if problems:
        raise OctoPipeError(f"--pipeline-schedule octopipe: {source} does not match this run: "
                            + "; ".join(problems))


def stage_layout_args(plan, specs: list[LayerSpec], args) -> dict:
    """The Megatron arguments that build the plan's stages, in stage order (the plan's map places them)."""
    if hybrid_pattern(args):
        pieces = ["".join(_hybrid_symbol(s) for s in specs[st.start:st.end] if s.kind not in
                          ("embedding", "lm_head", "mtp")) for st in plan.stages]
        mtp = hybrid_pattern(args).split("/", 1)
        return {"hybrid_layer_pattern": "|".join(pieces) + ("/" + mtp[1] if len(mtp) > 1 else ""),
                "hybrid_override_pattern": None}
    layout = "|".join("".join(GPT_SYMBOLS[s.kind] for s in specs[st.start:st.end]) for st in plan.stages)
    return {"pipeline_model_parallel_layout": layout}


def _hybrid_symbol(spec: LayerSpec) -> str:
    return HYBRID_SYMBOLS[spec.kind]


def _refuse_stage_args(args) -> None:
    given = [f"--{a.replace('_', '-')}" for a in _STAGE_ARGS if getattr(args, a, None) is not None]
    given += [f"--{a.replace('_', '-')}" for a in _STAGE_FLAGS if getattr(args, a, False)]
    pattern = hybrid_pattern(args)
    if pattern and "|" in pattern:
        given.append("'|' in --hybrid-layer-pattern")
    if given:
        raise OctoPipeError(f"--pipeline-schedule octopipe: the plan sets the pipeline stages; drop {', '.join(given)}")


def _find_plan(args, specs, facts):
    """(plan, where it came from): the given file, the one saved with the checkpoint, or a tuned one."""
    if args.octopipe_plan:
        return read_plan(args.octopipe_plan), f"plan {args.octopipe_plan}"
    saved = os.path.join(args.load, PLAN_FILE) if getattr(args, "load", None) else None
    if saved and os.path.exists(saved):
        return read_plan(saved), f"plan {saved} (saved with the checkpoint)"
    if not args.octopipe_cluster:
        raise OctoPipeError("--pipeline-schedule octopipe needs --octopipe-plan PATH, or --octopipe-cluster NAME|PATH "
                            "to tune a plan at start-up")
    return _tune_on_rank0(args, specs, facts), f"the plan tuned for {args.octopipe_cluster}"


def tune_for_run(args, facts: RunFacts, profiled: dict | None = None):
    """Tune a plan for this run's model and pipeline on the given cluster (what rank 0 does at start-up).

    `profiled`: kind -> measured cost fields (--octopipe-profile); the --octopipe-costs file goes on top.
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
    result = tune(model, cluster, facts.num_microbatches, time_budget_s=args.octopipe_tune_seconds,
                  seed=args.octopipe_seed, iterations=args.octopipe_tune_iterations)
    plan = result.plan
    if hybrid_pattern(args) and not is_looped(plan):
        plan = _fastest_looped(result, model, facts)
    meta = {**(plan.meta or {}), "layer_kinds": [layer.kind for layer in model.layers],
            "tuned_for": {"cluster": str(args.octopipe_cluster), "gpu": gpu,
                          **({"profiled_kinds": sorted(profiled)} if profiled else {})}}
    return replace(plan, meta=meta)


def tuning_cluster(args):
    """--octopipe-cluster with --octopipe-memory-headroom kept free on every rank."""
    from ...costs import resolve_cluster
    from ...headroom import DEFAULT, parse_headroom, with_headroom

    where = "--octopipe-memory-headroom"
    return with_headroom(resolve_cluster(args.octopipe_cluster),
                         parse_headroom(getattr(args, "octopipe_memory_headroom", DEFAULT), where), where)


def is_looped(plan) -> bool:
    """Whether stage i runs on rank i % P (the placement megatron.training's model builders make)."""
    return all(st.device == s % plan.num_devices for s, st in enumerate(plan.stages))


def _fastest_looped(result, model, facts):
    """The fastest fitting looped built-in of a tuning run (its tuned plan used another stage->rank map)."""
    from ...schedules.registry import build_plan

    looped = [b for b in result.baselines if b.outcome is not None and b.outcome.fits
              and b.name in ("interleaved-zb", "interleaved-1f1b", "zb-h1", "1f1b", "gpipe")]
    if not looped:
        raise OctoPipeError("the tuned plan places stages off the looped map and no looped schedule fits memory; "
                            "a hybrid (Mamba) model's chunks follow the looped map only")
    best = min(looped, key=lambda b: b.outcome.step_ms)
    log.warning("octopipe: the tuned plan (%.1f ms) uses a stage->rank map a hybrid model cannot be built on; "
                "running the fastest looped plan instead: %s on the %s split, %d stages per rank (%.1f ms)",
                result.step_ms, best.name, best.split, best.stages_per_device, best.outcome.step_ms)
    return build_plan(model, best.name, facts.pipeline_size, facts.num_microbatches,
                      stages_per_device=best.stages_per_device, split=best.split)


def _model_name(args) -> str:
    return "megatron-hybrid" if hybrid_pattern(args) else "megatron-gpt"


def _tune_on_rank0(args, specs, facts):
    """Rank 0 tunes, every rank receives the plan (or rank 0's error) over the default process group."""
    import torch.distributed as dist

    profiled, failure = None, None
    if getattr(args, "octopipe_profile", False) and int(getattr(args, "rank", 0) or 0) == 0:
        # before the run's group opens: the profiler's one-rank group and parallel state are gone after it
        try:
            profiled = profiled_costs(args, name=_model_name(args))
        except OctoPipeError as exc:
            failure = str(exc)
    if facts.pipeline_size * facts.data_parallel_size == 1 and not dist.is_initialized():
        if failure:
            raise OctoPipeError(failure)
        return tune_for_run(args, facts, profiled)
    _open_process_group(args)
    box = [None]
    if dist.get_rank() == 0:
        try:
            if failure:
                raise OctoPipeError(failure)
            box[0] = {"plan": plan_to_dict(tune_for_run(args, facts, profiled))}
        except OctoPipeError as exc:
            box[0] = {"error": str(exc)}
    dist.broadcast_object_list(box, src=0)
    if "error" in box[0]:
        raise OctoPipeError(box[0]["error"])
    return plan_from_dict(box[0]["plan"], "<plan broadcast from rank 0>")


def _open_process_group(args) -> None:
    """Open the default process group as megatron.training.initialize would; Megatron then reuses it."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
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


def _save_next_to_checkpoint(args, plan) -> None:
    save = getattr(args, "save", None)
    if not save or args.rank != 0:
        return
    os.makedirs(save, exist_ok=True)
    write_plan(plan, os.path.join(save, PLAN_FILE))
    log.info("octopipe: plan saved to %s", os.path.join(save, PLAN_FILE))
