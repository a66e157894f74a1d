"""--pipeline-schedule octopipe at start-up: Megatron's parser takes the plan's stages; mismatches stop it."""

import json
import os
import sys

import pytest

from octopipe_plugin.adapters.megatron.graph import model_from_megatron
from octopipe_plugin.adapters.megatron.arguments import PLAN_FILE
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import read_plan, write_plan
from octopipe_plugin.schedules.registry import build_plan

from launch_helpers import TINY_GPT, parse

pytestmark = [pytest.mark.framework, pytest.mark.timeout(120)]


def tiny_model():
    return model_from_megatron(parse(TINY_GPT, octopipe=False, validate=False))


def plan_file(tmp_path, schedule="interleaved-zb", devices=2, microbatches=4, name="plan.json", **kw):
    """A looped plan with split backward (I/W) on the stages E+t | t+t | t+t | t+L."""
    path = tmp_path / name
    kw = kw or {"stages_per_device": 2, "boundaries": [(0, 2), (2, 4), (4, 6), (6, 8)]}
    write_plan(build_plan(tiny_model(), schedule, devices, microbatches, **kw), path)
    return str(path)


def test_plan_stages_become_megatrons_layout_and_virtual_stages(tmp_path):
    path = plan_file(tmp_path)  # interleaved zero-bubble: stages 0..3 on ranks 0,1,0,1
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                             "--pipeline-schedule", "octopipe", "--octopipe-plan", path, "--save", str(tmp_path / "ck"), "--save-interval", "1"],
                 world=2)
    stages = [(st.start, st.end) for st in read_plan(path).stages]
    assert stages == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Megatron's validate_args accepted the layout and derived VP = 4 stages / 2 ranks from it
    assert args.pipeline_model_parallel_layout == "Et|tt|tt|tL"
    assert args.virtual_pipeline_model_parallel_size == 2 and args.num_layers == 6
    assert args.octopipe_plan["stages"][3] == {"layers": [6, 8], "device": 1}
    assert "3I0" in args.octopipe_plan["schedule"][1]  # the plan's split backward travels with it
    assert json.loads((tmp_path / "ck" / PLAN_FILE).read_text())["stages"] == args.octopipe_plan["stages"]


def test_the_plan_saved_with_the_checkpoint_is_used_on_load(tmp_path):
    os.makedirs(tmp_path / "ck")
    write_plan(build_plan(tiny_model(), "interleaved-1f1b", 2, 4, stages_per_device=2, split="balanced"),
               tmp_path / "ck" / PLAN_FILE)
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                             "--pipeline-schedule", "octopipe", "--load", str(tmp_path / "ck")], world=2)
    assert args.octopipe_plan == json.loads((tmp_path / "ck" / PLAN_FILE).read_text())
    assert args.virtual_pipeline_model_parallel_size == 2


def test_default_schedule_leaves_megatron_alone():
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], world=2)
    assert args.pipeline_schedule == "default" and args.pipeline_model_parallel_layout is None
    assert getattr(args, "octopipe_plan", None) is None


def test_a_plan_that_does_not_match_the_run_stops_startup_with_one_message(tmp_path):
    path = plan_file(tmp_path, devices=2, microbatches=4)
    run = ["--pipeline-schedule", "octopipe", "--octopipe-plan", path]
    # pipeline size, micro-batch count (gbs 16 / (mbs 1 x dp 1)), ramp-up and model size, all in one message
    with pytest.raises(OctoPipeError) as exc:
        parse([*TINY_GPT[:1], "8", *TINY_GPT[2:], "--pipeline-model-parallel-size", "4", "--global-batch-size", "16",
               "--rampup-batch-size", "4", "4", "64", *run], world=4, validate=False)
    msg = str(exc.value)
    assert msg.startswith(f"--pipeline-schedule octopipe: plan {path} does not match this run: ")
    for part in ("covers 8 layers but this run's model has 10", "2 devices but --pipeline-model-parallel-size is 4",
                 "4 micro-batches per step but this run has 16", "--rampup-batch-size"):
        assert part in msg
    # the micro-batch count includes data parallelism: 8 ranks = PP 2 x DP 4, gbs 16 -> 4 per step matches
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", *run], world=8)
    assert args.virtual_pipeline_model_parallel_size == 2


def test_a_v_shape_plan_for_a_hybrid_model_is_taken(tmp_path):
    """A hybrid model's chunks follow any stage->rank map now (pretrain_hooks + the segment hook): the pattern
    holds the plan's stages in stage order, Megatron derives VP from it, and the model hooks are installed."""
    from octopipe_plugin.adapters.megatron import hooks

    argv = ["--hybrid-layer-pattern", "M*-M*-", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
            "--position-embedding-type", "rope", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    model = model_from_megatron(parse(argv, octopipe=False, validate=False))
    plan = build_plan(model, "zb-v", 2, 4)
    write_plan(plan, tmp_path / "hv.json")
    try:
        args = parse(argv + ["--pipeline-schedule", "octopipe", "--octopipe-plan", str(tmp_path / "hv.json")], world=2)
        assert [st["device"] for st in args.octopipe_plan["stages"]] == [0, 1, 1, 0]
        symbols = "".join("M*-M*-")
        layers = [(st.start, st.end) for st in plan.stages]
        # graph layer i + 1 is pattern symbol i (layer 0 is the embedding)
        want = "|".join(symbols[max(a - 1, 0):min(b - 1, 6)] for a, b in layers)
        assert args.hybrid_layer_pattern == want and args.virtual_pipeline_model_parallel_size == 2
        assert "megatron.training.models.hybrid.HybridModelBuilder.build_model" in \
            [line.split(":")[0] for line in hooks.installed()]
    finally:
        hooks.uninstall()


def test_start_up_tuning_of_a_hybrid_run_keeps_any_placement():
    """The tuner may place a hybrid model's stages as it does a GPT's: only the chunks-per-rank rule is added."""
    from octopipe_plugin.adapters.megatron.startup import run_constraints
    from octopipe_plugin.tuner.constraints import Constraints

    args = parse(["--hybrid-layer-pattern", "M*-M*-", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                  "--vocab-size", "128"], octopipe=False, validate=False)
    cons, notes = run_constraints(args, Constraints())
    assert cons.placement == "any" and cons.uniform_stages_per_device
    assert notes == ["the same number of stages on every rank (Megatron builds as many model chunks on each)"]


def test_a_hybrid_plan_with_mtp_before_its_last_stage_is_refused(tmp_path):
    argv = ["--hybrid-layer-pattern", "M*-M*-/*-", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
            "--position-embedding-type", "rope", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    model = model_from_megatron(parse(argv, octopipe=False, validate=False))  # E M * - M * - mtp L
    write_plan(build_plan(model, "interleaved-1f1b", 2, 4, stages_per_device=2,
                          boundaries=[(0, 3), (3, 5), (5, 8), (8, 9)]), tmp_path / "h.json")
    with pytest.raises(OctoPipeError, match=r"MTP layers \[7\] before its last stage \(3, layers 8\.\.8\)"):
        parse(argv + ["--pipeline-schedule", "octopipe", "--octopipe-plan", str(tmp_path / "h.json")], world=2,
              validate=False)


def test_a_v_shape_plan_for_a_gpt_model_is_taken(tmp_path):
    path = plan_file(tmp_path, schedule="zb-v", name="v.json", stages_per_device=2)
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule",
                             "octopipe", "--octopipe-plan", path], world=2)
    assert [st["device"] for st in args.octopipe_plan["stages"]] == [0, 1, 1, 0]
    assert args.virtual_pipeline_model_parallel_size == 2  # the chunks themselves follow the map (pretrain_hooks)


def test_stage_arguments_next_to_a_plan_are_refused(tmp_path):
    path = plan_file(tmp_path)
    with pytest.raises(OctoPipeError, match="the plan sets the pipeline stages; drop --pipeline-model-parallel-layout"):
        parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule",
                          "octopipe", "--octopipe-plan", path, "--pipeline-model-parallel-layout", "Ettt|tttL"],
              world=2, validate=False)
    with pytest.raises(OctoPipeError, match="needs --octopipe-plan PATH, or --octopipe-cluster"):
        parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "octopipe"], world=2,
              validate=False)


def test_uniform_recompute_next_to_a_plan_with_memory_choices_is_refused(tmp_path):
    from dataclasses import replace

    from octopipe_plugin.formats.memory import parse_choice

    plan = read_plan(plan_file(tmp_path))
    write_plan(replace(plan, memory=((1, parse_choice("recompute")),)), tmp_path / "mem.json")
    base = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule",
                       "octopipe", "--octopipe-plan", str(tmp_path / "mem.json")]
    for extra, flag in ((["--recompute-granularity", "full", "--recompute-method", "uniform"], "--recompute-granularity"),
                        (["--recompute-activations"], "--recompute-activations")):
        with pytest.raises(OctoPipeError, match=f"plan \\$.memory sets each layer's recompute/offload; drop {flag}"):
            parse(base + extra, world=2, validate=False)
    # the same uniform recompute beside the plan without memory choices runs as Megatron's own
    args = parse(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule",
                             "octopipe", "--octopipe-plan", plan_file(tmp_path, name="plain.json"),
                             "--recompute-activations"], world=2, validate=False)
    assert "memory" not in args.octopipe_plan


def test_hybrid_plan_becomes_a_piped_hybrid_pattern(tmp_path):
    argv = ["--hybrid-layer-pattern", "M*-M*-/*-", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
            "--position-embedding-type", "rope", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    model = model_from_megatron(parse(argv, octopipe=False, validate=False))
    write_plan(build_plan(model, "interleaved-1f1b", 2, 4, stages_per_device=2, boundaries=[(0, 3), (3, 5), (5, 7), (7, 9)]),
               tmp_path / "h.json")
    args = parse(argv + ["--pipeline-schedule", "octopipe", "--octopipe-plan", str(tmp_path / "h.json")], world=2)
    assert args.hybrid_layer_pattern == "M*|-M|*-|/*-"
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tuned_on_rank0_and_broadcast(tmp_path):
    from octopipe_plugin.executor.launch import spawn

    spawn(_tune_worker, 2, str(tmp_path))
    plans = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert plans[0] == plans[1] and plans[0]["num_devices"] == 2 and plans[0]["num_microbatches"] == 4
    assert plans[0]["meta"]["tuned_for"] == {"cluster": "h100x2", "gpu": "H100-SXM"}
    assert json.loads((tmp_path / "ck" / PLAN_FILE).read_text()) == plans[0]  # rank 0 saved it for --load


def _tune_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    from launch_helpers import parse as parse_in_child

    import torch.distributed as dist

    args = parse_in_child(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                                      "--pipeline-schedule", "octopipe", "--octopipe-cluster", "h100x2",
                                      "--octopipe-tune-iterations", "20", "--distributed-backend", "gloo",
                                      "--save", os.path.join(out, "ck"), "--save-interval", "1"],
                          world=world, rank=rank, validate=False)
    assert dist.is_initialized()  # opened here; Megatron's initialize skips its own init_process_group then
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(args.octopipe_plan, fh)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("failure", ["missing-plan-file", "tuning-error"])
def test_a_rank0_failure_ends_both_ranks_with_its_message(tmp_path, failure):
    """Rank 0 cannot produce a plan: both ranks stop in Megatron's parse_args with rank 0's one line, no hang.

    Rank 1 is given a good plan file (missing-plan-file), so its stop can only come from rank 0's broadcast."""
    from octopipe_plugin.executor.launch import spawn

    good = plan_file(tmp_path)
    spawn(_failing_worker, 2, str(tmp_path), failure, good)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1], got
    assert got[0]["type"] == "StartupError" and "\n" not in got[0]["message"]
    if failure == "missing-plan-file":
        assert str(tmp_path / "missing.json") in got[0]["message"] and "a readable file" in got[0]["message"]
    else:
        assert "--octopipe-cluster h100x4 has 4 devices but the pipeline has 2 ranks" in got[0]["message"]


def _failing_worker(rank, world, port, out, failure, good):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist

    from launch_helpers import parse as parse_in_child

    if failure == "missing-plan-file":
        source = ["--octopipe-plan", os.path.join(out, "missing.json") if rank == 0 else good]
    else:  # a cluster of 4 devices for a 2-rank pipeline: tune_for_run refuses it on rank 0
        source = ["--octopipe-cluster", "h100x4", "--octopipe-tune-iterations", "5"]
    try:
        parse_in_child(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                                   "--pipeline-schedule", "octopipe", *source, "--distributed-backend", "gloo",
                                   "--distributed-timeout-minutes", "1"], world=world, rank=rank, validate=False)
        report = {"type": None, "message": "start-up went on"}
    except OctoPipeError as exc:
        report = {"type": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    if dist.is_initialized():
        dist.destroy_process_group()


def _zoo_plan(tmp_path, zoo: str, name: str) -> str:
    """A plan tuned the `octopipe plan` way for a zoo model (bound to it: fingerprint with its layer kinds)."""
    from octopipe_plugin.costs import resolve_model
    from octopipe_plugin.formats import bind_plan

    model = resolve_model(zoo)
    path = tmp_path / name
    write_plan(bind_plan(build_plan(model, "1f1b", 2, 4), model), path)
    return str(path)


def _gpt_run(num_layers: int, path: str) -> list[str]:
    return [*TINY_GPT[:1], str(num_layers), *TINY_GPT[2:], "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--pipeline-schedule", "octopipe", "--octopipe-plan", path]


def test_a_plan_for_another_model_with_the_same_layer_count_is_refused(tmp_path):
    # deepseek-v3-mini: embedding, 2 dense, 22 MoE, 1 MTP, lm_head = 27 layers; a dense GPT of 25 decoder layers too
    path = _zoo_plan(tmp_path, "deepseek-v3-mini", "ds.json")
    with pytest.raises(OctoPipeError) as exc:
        parse(_gpt_run(25, path), world=2, validate=False)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"--pipeline-schedule octopipe: plan {path} does not match this run: ")
    assert ("it was made for another model: model 'deepseek-v3-mini' (27 layers) "
            "[embedding dense*2 moe*22 mtp lm_head], not this run's [embedding dense*25 lm_head] "
            "(layer 3 is 'moe' there and 'dense' (decoder.layers.2) here)") in msg
    assert "covers" not in msg  # the count matches: the kinds tell the models apart


def test_the_same_layers_under_zoo_names_pass_and_other_costs_are_warned(tmp_path, caplog):
    # llama3-8b from the zoo: embedding, 32 dense layers ('layer0'..), lm_head; this run: the same kinds, tiny sizes
    path = _zoo_plan(tmp_path, "llama3-8b", "llama.json")
    with caplog.at_level("WARNING", logger="octopipe.megatron"):
        args = parse(_gpt_run(32, path), world=2)
    assert args.pipeline_model_parallel_layout.count("t") == 32
    warned = [r.getMessage() for r in caplog.records if "other costs" in r.getMessage()]
    assert len(warned) == 1 and f"plan {path} was made for the same layers with other costs (F+I+W" in warned[0]
    # a plan bound to this very run's graph: nothing to warn about
    caplog.clear()
    graph = model_from_megatron(parse(_gpt_run(32, path)[:-4], world=2, octopipe=False, validate=False))
    from octopipe_plugin.formats import bind_plan

    write_plan(bind_plan(build_plan(graph, "1f1b", 2, 4), graph), tmp_path / "own.json")
    with caplog.at_level("WARNING", logger="octopipe.megatron"):
        parse(_gpt_run(32, str(tmp_path / "own.json")), world=2)
    assert not [r for r in caplog.records if "other costs" in r.getMessage()]
