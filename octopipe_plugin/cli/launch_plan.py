"""`octopipe plan --megatron-args` / `--deepspeed-config --module`: tune for the job the user runs, compare with it.

The launch's arguments are parsed and validated by Megatron (adapters/megatron/from_args.py,
imported only here); the plan is tuned under the constraints Megatron's start-up needs on top
of the user's own, written with what the start-up checks, and printed with the arguments to
add to the launch and a table against the launch's current stages under Megatron's own schedule.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ..errors import OctoPipeError, PlanError
from ..formats import bind_plan, plan_to_dict, write_model, write_plan
from ..schedules.registry import build_plan
from ..simulator import simulate
from ..tuner.compare import comparison_rows, format_table
from ..tuner.constraints import framework_splits
from ._options import Costs, apply_headroom, check_writable, constraints_of, keep_on_failure, load_cluster

DEFAULT_PLAN = "octopipe-plan.json"
_GIB = 2**30


def _prepare(args, source: str):
    """(plan path, cluster) of a plan from a launch; --model / --microbatches are refused (`source` gives them)."""
    for flag in ("model", "microbatches"):
        if getattr(args, flag) is not None:
            raise OctoPipeError(f"--{flag} comes from {source}; drop --{flag}")
    output = args.output or DEFAULT_PLAN
    check_writable(output, "-o")
    check_writable(args.png, "--png")
    return output, load_cluster(args.cluster)


def run_from_megatron(args) -> int:
    """Plan from a Megatron launch's arguments (see the module docstring)."""
    from ..adapters.megatron.from_args import args_to_add, run_constraints, stamp, view_launch
    from .plan_report import check_size, summary, tuned

    output, bare = _prepare(args, "--megatron-args (the launch's model and batch)")
    # the launch's uniform recompute is the starting point: replaced by per-layer choices where the tuner may make
    # them (left out of the model's costs, to drop from the launch), kept as it is under --recompute/--offload none
    per_layer = getattr(args, "recompute", "none") != "none" or getattr(args, "offload", "none") != "none"
    view = view_launch(args.megatron_args, bare, world_size=args.world_size, gpu=args.gpu, per_layer_memory=per_layer)
    launch_headroom = view.args.octopipe_memory_headroom if "--octopipe-memory-headroom" in " ".join(view.argv) \
        else None  # the launch's own setting, unless --memory-headroom overrides it
    cluster = apply_headroom(args, bare, launch_headroom, "--octopipe-memory-headroom of --megatron-args")
    from ..adapters.megatron.pairs import (OVERLAP_FLAG, pair_support, runnable_plan, tuning_model,
                                          virtual_stage_problem)

    # pairs where the launch can run them (its EP, dispatcher, precision, recompute): megatron-core's combined step
    pairs = pair_support(view.args)
    model, facts = tuning_model(view.model, pairs, view.args), view.facts
    check_size(model, cluster, facts.num_microbatches, args.time_budget)
    cons, added = run_constraints(view.args, constraints_of(args))
    from .plan_split import plain_budget, with_splits

    # the combined step runs no split layer and no memory choice (pairs.overlap_problem): not searched beside pairs
    tune_args = argparse.Namespace(**{**vars(args), "recompute": "none", "offload": "none"}) if pairs.runs else args
    # megatron-core asks for a virtual pipeline size under the flag at PP > 1: two chunks or more on every rank
    pair_cons = replace(cons, min_stages_per_device=2) if pairs.runs and facts.pipeline_size > 1 and \
        model.num_layers >= 2 * facts.pipeline_size else cons
    result = tuned(tune_args, model, cluster, facts.num_microbatches, constraints=pair_cons,
                   time_budget_s=plain_budget(args, model, cluster))
    vp_why = virtual_stage_problem(result.plan, facts.pipeline_size) if pairs.runs else None
    if vp_why is not None:  # the plan megatron cannot run under the flag: tuned again as the launch runs without it
        pairs = replace(pairs, runs=False, why=vp_why, add=())
        model = tuning_model(view.model, pairs, view.args)
        result = tuned(args, model, cluster, facts.num_microbatches, constraints=cons,
                       time_budget_s=plain_budget(args, model, cluster))
    result = replace(result, plan=runnable_plan(result.plan, pairs, view.args))
    split_rows, split_line = None, None
    if args.splits != "off" and not pairs.runs:
        from ..adapters.megatron.startup import run_splits, split_refusal

        result, split_rows, split_line = with_splits(args, model, cluster, facts.num_microbatches, result,
                                                     constraints=replace(cons, **run_splits(view.args)),
                                                     refusal=lambda p: split_refusal(view.args, p))
    plan = bind_plan(stamp(result.plan, view, args.cluster), model, cluster)
    failed = keep_on_failure(lambda: write_plan(plan, output), output, plan)
    model_file = model_path(output)
    failed += keep_on_failure(lambda: write_model(model, model_file), model_file)
    if args.png:
        from ..simulator.gantt import write_png

        failed += keep_on_failure(lambda: write_png(model, cluster, plan, args.png), args.png)
    current = current_setup(view, cluster)
    add, drop = args_to_add(output, view.argv)
    add += list(pairs.add) if plan.pairs else []
    pairs_line = (f"pairs run by    {pairs.why}" if plan.pairs else
                  f"pairs          none: {pairs.why if not pairs.runs else 'none pays in this plan'}")
    # without pairs the flag hides nothing, and it refuses I/W, split layers and memory choices
    pair_drop = [OVERLAP_FLAG] if OVERLAP_FLAG in view.argv and not plan.pairs else []
    pairs_line += f"; drop {OVERLAP_FLAG} from the launch" if pair_drop else ""
    memory_drop = list(view.uniform_memory)  # the plan's per-layer choices (or none needed) replace them
    costs = Costs(gpu=view.gpu, source=str(model.meta.get("cost_model", "analytic")),
                  why="the launch's arguments, as Megatron's start-up costs them")
    rows = split_rows or comparison_rows(result, cluster)
    if args.json:
        print(json.dumps({"plan": plan_to_dict(plan), "costs": costs.as_dict(), "plan_file": output,
                          **({"split_layers": split_line} if split_line else {}),
                          "model_file": model_file,
                          "launch": {"pipeline_size": facts.pipeline_size, "data_parallel_size":
                                     facts.data_parallel_size, "num_microbatches": facts.num_microbatches,
                                     "num_layers": model.num_layers, "current": current},
                          "tuned": {"step_ms": result.step_ms, "bubble": result.bubble,
                                    "peak_bytes": list(result.peak)},
                          "memory_headroom_bytes": cluster.memory_headroom_bytes,
                          "usable_memory_bytes": cluster.usable_memory_bytes,
                          "constraints": result.constraints.as_dict(), "constraints_added": added,
                          "add_arguments": add, "drop_arguments": drop + memory_drop + pair_drop,
                          "memory_choices": len(plan.memory),
                          "pairs": {"count": len(plan.pairs), "launch_runs_them": pairs.runs, "why": pairs.why},
                          "comparison": [r.as_dict() for r in rows]}, indent=1))
    else:
        print(summary(result, model, cluster, costs.line()))
        print("  " + pairs_line)
        if split_line:
            print("  " + split_line)
        print()
        print(launch_report(view, result, current, added, add, drop, output,
                            f"--model {model_file} --cluster {args.cluster}", memory_drop=memory_drop))
        print()
        print(format_table(rows, cluster.memory_bytes, cluster.memory_headroom_bytes))
    if failed:
        raise OctoPipeError("; ".join(failed))
    return 0


def _deepspeed_splits(args, job, cluster, result):
    """The split search for a DeepSpeed job (cli/plan_split.py), its plan kept only where OctoPipeEngine runs its
    splits (adapters/deepspeed/head_split.py: an untied bias-free Linear head, or a head tied to the embedding whose
    forward_fn is the projection x @ W^T, the owner among its shards; an untied plain nn.Embedding, searched only
    where the layer list has one); otherwise the plan without splits, with the reason."""
    from ..adapters.deepspeed.config import parse_block
    from ..adapters.deepspeed.head_split import embedding_splits, split_problem
    from .plan_split import with_splits

    block = parse_block(job.config)
    owners = block.layer_of_spec if block is not None else None
    runs = dict(framework_splits("deepspeed"))
    runs["split_embedding"] = runs["split_embedding"] and embedding_splits(job.layers, owners)
    chosen, rows, line = with_splits(args, job.model, cluster, job.num_microbatches, result,
                                     constraints=replace(constraints_of(args), **runs))
    problem = split_problem(chosen.plan, job.layers, owners) if chosen.plan.splits else None
    if problem is None:
        return chosen, rows, line
    return result, None, f"{line}; not kept: {problem}"


def run_from_deepspeed(args) -> int:
    """Plan from a DeepSpeed config and the function returning its PipelineModule's layer list."""
    from ..adapters.deepspeed.from_config import import_deepspeed, view_job
    from .plan_report import check_size, summary, tuned

    import_deepspeed()  # before --module's script imports it: DeepSpeed's import-time log lines go to stderr
    output, bare = _prepare(args, "--deepspeed-config and --module")
    job = view_job(args.deepspeed_config, args.module, bare, world_size=args.world_size, gpu=args.gpu,
                   partition_method=args.partition_method)
    tune = (job.config.get("octopipe") or {}).get("tune") or {}
    cluster = apply_headroom(args, bare, tune.get("memory_headroom"),
                             f"{args.deepspeed_config}: $.octopipe.tune.memory_headroom")
    model, m = job.model, job.num_microbatches
    check_size(model, cluster, m, args.time_budget)
    from .plan_split import plain_budget

    result = tuned(args, model, cluster, m, time_budget_s=plain_budget(args, model, cluster))
    split_rows, split_line = None, None
    if args.splits != "off":
        result, split_rows, split_line = _deepspeed_splits(args, job, cluster, result)
    plan = bind_plan(result.plan, model, cluster)
    failed = keep_on_failure(lambda: write_plan(plan, output), output, plan)
    model_file = model_path(output)
    failed += keep_on_failure(lambda: write_model(model, model_file), model_file)
    if args.png:
        from ..simulator.gantt import write_png

        failed += keep_on_failure(lambda: write_png(model, cluster, plan, args.png), args.png)
    current = _simulated({"schedule": "1f1b", "stages": f"DeepSpeed's {job.current_source}", "stages_per_rank": 1},
                         model, cluster, "1f1b", cluster.num_devices, m, 1, job.current)
    costs = Costs(gpu=model.meta.get("gpu"), source=str(model.meta.get("cost_model", "analytic")),
                  why="the layer list, as the DeepSpeed start-up costs it")
    block = {"plan": output}
    memory_lines = deepspeed_memory_lines(args, job, plan)
    rows = split_rows or comparison_rows(result, cluster)
    if args.json:
        print(json.dumps({"plan": plan_to_dict(plan), "costs": costs.as_dict(), "plan_file": output,
                          **({"split_layers": split_line} if split_line else {}),
                          "model_file": model_file, "job": {"num_microbatches": m, "num_layers": model.num_layers,
                                                            "current": current},
                          "tuned": {"step_ms": result.step_ms, "bubble": result.bubble,
                                    "peak_bytes": list(result.peak)},
                          "memory_headroom_bytes": cluster.memory_headroom_bytes,
                          "usable_memory_bytes": cluster.usable_memory_bytes,
                          "octopipe_block": block, "comparison": [r.as_dict() for r in rows],
                          "memory_choices": len(plan.memory), "memory_notes": memory_lines,
                          **({"split_layers": split_line} if split_line else {})}, indent=1))
    else:
        print(summary(result, model, cluster, costs.line()))
        if split_line:
            print("  " + split_line)
        print()
        lines = [f"Your job: {cluster.num_devices} pipeline ranks x {m} micro-batches per step "
                 f"(gradient_accumulation_steps), {model.num_layers} layers in the PipelineModule list",
                 f"Run the plan: add `import octopipe_plugin.deepspeed` to the script and to {args.deepspeed_config}"
                 f"   \"octopipe\": {json.dumps(block)}",
                 *memory_lines,
                 f"  check it on CPU first: octopipe dryrun {output} --model {model_file} --cluster {args.cluster}",
                 "", f"  your job now: DeepSpeed's PipelineEngine (1F1B, one stage per rank) on {job.current_source}",
                 *_table(current, result)]
        print("\n".join(lines))
        print()
        print(format_table(rows, cluster.memory_bytes, cluster.memory_headroom_bytes))
    if failed:
        raise OctoPipeError("; ".join(failed))
    return 0


def deepspeed_memory_lines(args, job, plan) -> list[str]:
    """What a DeepSpeed job changes for the plan's memory choices: its activation_checkpoint_interval (the starting
    point, --activation-checkpoint-interval) dropped where the plan decides per layer, the config's
    "activation_checkpointing" block (DeepSpeed's own checkpoint function, which the plan's choices do not use)."""
    interval = getattr(args, "activation_checkpoint_interval", 0) or 0
    levers = getattr(args, "recompute", "none") != "none" or getattr(args, "offload", "none") != "none"
    lines = []
    if plan.memory or (interval and levers):
        why = (f"the plan's memory choices on {len(plan.memory)} layer(s) replace it; an interval beside them is "
               f"refused" if plan.memory else "the plan fits without it")
        lines.append(f"  and build the PipelineModule with activation_checkpoint_interval=0 ({why})" if interval
                     else f"  memory choices: {len(plan.memory)} layer(s) recompute or offload per the plan "
                          f"(keep activation_checkpoint_interval=0, DeepSpeed's default)")
        if "activation_checkpointing" in job.config:
            lines.append(f"  {args.deepspeed_config}'s \"activation_checkpointing\" block configures DeepSpeed's "
                         f"interval checkpoints only: the plan's choices do not read it")
    return lines


def _simulated(out: dict, model, cluster, name, pp, m, v, bounds) -> dict:
    """`out` with the step, bubble and per-rank peaks of a built-in on given boundaries (or why it cannot run)."""
    try:
        plan = build_plan(model, name, pp, m, stages_per_device=v, boundaries=list(bounds))
    except PlanError as exc:
        return {**out, "error": str(exc)}
    res = simulate(model, cluster, plan)
    return {**out, "step_ms": res.step_time_ms, "bubble": res.bubble_ratio, "peak_bytes": list(res.peak_memory_bytes)}


def current_setup(view, cluster) -> dict:
    """The launch as it runs now: Megatron's own schedule on its stages, simulated (or why it cannot run)."""
    pp, v = view.facts.pipeline_size, view.stages_per_rank
    name = "interleaved-1f1b" if v > 1 else "1f1b"
    out = {"schedule": name, "stages": view.current_source, "stages_per_rank": v}
    return _simulated(out, view.model, cluster, name, pp, view.facts.num_microbatches, v, view.current)


def model_path(plan_path: str) -> str:
    """Where the launch's model is written next to its plan: plan.json -> plan.model.json."""
    stem = plan_path[:-5] if plan_path.endswith(".json") else plan_path
    return f"{stem}.model.json"


def launch_report(view, result, current: dict, added: list[str], add: list[str], drop: list[str],
                  output: str, inputs: str, memory_drop=()) -> str:
    """What to add to the launch, and the plan against the launch's current setup (step, bubble, peak per rank)."""
    f = view.facts
    memory = len(result.plan.memory)
    why = (f"the plan's memory choices on {memory} layer(s) replace them" if memory else
           "the plan fits without recompute")
    lines = [f"Your launch: {f.pipeline_size} pipeline ranks x {f.num_microbatches} micro-batches per step "
             f"(data-parallel size {f.data_parallel_size}), {view.model.num_layers} layers",
             *[f"  constraint added for Megatron: {note}" for note in added],
             f"Run the plan: add to the launch   {' '.join(add)}",
             *([f"  and drop {', '.join(drop)} (the plan sets the stages)"] if drop else []),
             *([f"  and drop {' '.join(memory_drop)} ({why}; Megatron's uniform recompute beside them is refused)"]
               if memory_drop else []),
             *([f"  memory choices: {memory} layer(s) recompute or offload per the plan (no --recompute-* argument "
                f"needed)"] if memory and not memory_drop else []),
             f"  check it on CPU first: octopipe simulate {inputs} --plan {output}; octopipe dryrun {output} "
             f"{inputs}",
             "",
             f"  your launch now: Megatron's {current['schedule']} on {current['stages']}, "
             f"{current['stages_per_rank']} stage(s) per rank",
             *_table(current, result)]
    return "\n".join(lines)


def _table(current: dict, result) -> list[str]:
    """Your setup against the plan: v, step, bubble, peak GiB per rank."""
    lines = [f"  {'setup':<16} {'v':>3} {'step ms':>10} {'bubble':>7}  peak GiB per rank"]
    if "error" in current:
        lines.append(f"  {'your setup':<16} {current['stages_per_rank']:>3} {'-':>10} {'-':>7}  "
                     f"(cannot run: {current['error'][:80]})")
    else:
        lines.append(f"  {'your setup':<16} {current['stages_per_rank']:>3} {current['step_ms']:>10.1f} "
                     f"{current['bubble']:>7.1%}  {_peaks(current['peak_bytes'])}")
    per = {len(result.plan.stages_of(d)) for d in range(result.plan.num_devices)}
    lines.append(f"  {'OctoPipe plan':<16} {'-'.join(map(str, sorted(per))):>3} {result.step_ms:>10.1f} "
                 f"{result.bubble:>7.1%}  {_peaks(result.peak)}")
    if "step_ms" in current:
        lines.append(f"  {current['step_ms'] / result.step_ms:.2f}x faster than your current setup; fullest rank "
                     f"{max(result.peak) / _GIB:.1f} GiB against {max(current['peak_bytes']) / _GIB:.1f} GiB now")
    return lines


def _peaks(peaks) -> str:
    shown = " ".join(f"{p / _GIB:.1f}" for p in peaks[:16])
    return shown + (f" ... (max {max(peaks) / _GIB:.1f})" if len(peaks) > 16 else "")
