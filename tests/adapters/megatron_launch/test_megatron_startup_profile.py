"""`--octopipe-profile`: rank 0 measures the layer kinds before tuning and the tuner plans on those costs."""

import json
import os
import subprocess
import sys

import pytest

from octopipe_plugin.adapters.megatron import startup
from octopipe_plugin.adapters.megatron.arguments import run_facts
from octopipe_plugin.errors import OctoPipeError

from launch_helpers import TINY_GPT, parse

pytestmark = [pytest.mark.framework, pytest.mark.timeout(180)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TUNE = ["--global-batch-size", "2", "--pipeline-schedule", "octopipe", "--octopipe-cluster", "h100x1",
        "--octopipe-tune-iterations", "5"]


def test_profile_next_to_a_plan_is_refused(tmp_path):
    with pytest.raises(OctoPipeError, match="--octopipe-plan .* gives the plan; drop one of them"):
        parse(TINY_GPT + TUNE + ["--octopipe-profile", "--octopipe-plan", str(tmp_path / "p.json")], validate=False)
    with pytest.raises(OctoPipeError, match="needs --pipeline-schedule octopipe"):
        parse(TINY_GPT + ["--octopipe-profile"], validate=False)


def test_profiled_costs_reach_the_model_graph(monkeypatch):
    args = parse(TINY_GPT + ["--global-batch-size", "2"], octopipe=False, validate=False)
    vars(args).update(octopipe_cluster="h100x1", octopipe_gpu=None, octopipe_costs=None, octopipe_seed=0,
                      octopipe_tune_seconds=30.0, octopipe_tune_iterations=5)
    seen = []
    real = startup.model_from_megatron

    def recording(src, **kw):
        seen.append(kw["measured"])
        return real(src, **kw)

    monkeypatch.setattr(startup, "model_from_megatron", recording)
    profiled = {"dense": {"fwd_ms": 7.0, "bwd_ms": 9.0, "wgrad_ms": 5.0}, "lm_head": {"fwd_ms": 3.0}}
    plan = startup.tune_for_run(args, run_facts(args), profiled)
    assert seen == [profiled]
    assert plan.meta["tuned_for"]["profiled_kinds"] == ["dense", "lm_head"]
    # the model the tuner saw carries the measured figures (and analytic ones elsewhere)
    model = real(args, gpu="H100", measured=profiled)
    dense = [l for l in model.layers if l.kind == "dense"]
    assert {(l.fwd_ms, l.bwd_ms, l.wgrad_ms) for l in dense} == {(7.0, 9.0, 5.0)}


def test_the_measured_fused_ratio_reaches_the_graph_unless_te_runs_fused_b():
    from octopipe_plugin.adapters.megatron.startup_profile import kind_costs
    from octopipe_plugin.formats import Layer

    layer = Layer(name="decoder.layers.0", kind="dense", fwd_ms=2.0, bwd_ms=3.0, wgrad_ms=1.0, state_bytes=1,
                  activation_bytes=1, output_bytes=1, source="measured", fused_ratio=0.9)
    record = {"fused_bwd_ms": 3.6}
    fields = kind_costs(layer, record, fused=False)
    assert fields["fused_ratio"] == 0.9 and (fields["bwd_ms"], fields["wgrad_ms"]) == (3.0, 1.0)
    # TE layers running fused B: B is the measured fused backward itself, no ratio on top of it
    te = kind_costs(layer, record, fused=True)
    assert "fused_ratio" not in te and (te["bwd_ms"], te["wgrad_ms"]) == (3.6, 0.0)
    args = parse(TINY_GPT + ["--global-batch-size", "2"], octopipe=False, validate=False)
    model = startup.model_from_megatron(args, gpu="H100", measured={"dense": fields})
    assert {l.fused_ratio for l in model.layers if l.kind == "dense"} == {0.9}
    assert {l.fused_ratio for l in model.layers if l.kind != "dense"} == {None}


def test_the_measured_w_walk_reaches_the_graph_unless_te_runs_fused_b():
    """W's graph walk (graph_nodes, walk_ms_per_node) travels with its kind into the run's model, where the
    simulator charges it on W (simulator/costs.py walk_ms); a TE kind running fused B carries none."""
    from octopipe_plugin.adapters.megatron.startup_profile import kind_costs
    from octopipe_plugin.formats import Layer
    from octopipe_plugin.simulator.costs import walk_ms

    layer = Layer(name="decoder.layers.0", kind="dense", fwd_ms=2.0, bwd_ms=3.0, wgrad_ms=1.0, state_bytes=1,
                  activation_bytes=1, output_bytes=1, source="measured", graph_nodes=40, walk_ms_per_node=0.001)
    fields = kind_costs(layer, {"fused_bwd_ms": 3.6}, fused=False)
    assert (fields["graph_nodes"], fields["walk_ms_per_node"]) == (40, 0.001)
    assert "graph_nodes" not in kind_costs(layer, {"fused_bwd_ms": 3.6}, fused=True)
    args = parse(TINY_GPT + ["--global-batch-size", "2"], octopipe=False, validate=False)
    model = startup.model_from_megatron(args, gpu="H100", measured={"dense": fields})
    dense = [l for l in model.layers if l.kind == "dense"]
    assert {(l.graph_nodes, l.walk_ms_per_node) for l in dense} == {(40, 0.001)}
    # the second dense layer's W walks the first one's 40 nodes
    assert walk_ms(dense[:2]) == pytest.approx(0.001 * 40)


def test_merge_puts_the_costs_file_on_top():
    merged = startup.merge_costs({"dense": {"fwd_ms": 1.0, "bwd_ms": 2.0}}, {"dense": {"fwd_ms": 4.0}, "moe": {}})
    assert merged == {"dense": {"fwd_ms": 4.0, "bwd_ms": 2.0}, "moe": {}}


def test_real_profiler_at_startup(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "megatron_profile_startup_run.py"),
                           str(tmp_path / "cache")], capture_output=True, text=True, env=env, timeout=160)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    first, second = json.loads(line[len("RESULT "):])
    assert sorted(first["measured"]) == ["dense", "embedding", "lm_head"]
    assert all(first["measured"][k]["fwd_ms"] > 0 for k in ("dense", "lm_head"))
    assert first["measured"]["dense"]["fused_ratio"] > 0  # the measured fused B over I + W travels with its kind
    assert first["plan_meta"]["tuned_for"]["profiled_kinds"] == ["dense", "embedding", "lm_head"]
    assert not first["left_open"]  # Megatron's own initialisation starts from nothing
    # the second start-up read the cache: the same entries and the very same figures (a re-measure differs)
    assert first["cached"] and second["cached"] == first["cached"]
    assert second["measured"] == first["measured"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_rank0_profiles_then_the_plan_is_broadcast(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))
    import megatron_harness  # spawn: the ranks fork from its forkserver (Megatron imported once a session)

    megatron_harness.spawn(_profile_worker, 2, str(tmp_path))
    plans = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert plans[0] == plans[1] and plans[0]["num_devices"] == 2
    assert plans[0]["meta"]["tuned_for"]["profiled_kinds"] == ["dense", "embedding", "lm_head"]


def _profile_worker(rank, world, port, out):
    # a spawned process of its own: the CPU shims stay in it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))
    import megatron_cpu_shims

    megatron_cpu_shims.install()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from launch_helpers import parse as parse_in_child

    args = parse_in_child(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                                      "--pipeline-schedule", "octopipe", "--octopipe-cluster", "h100x2",
                                      "--octopipe-tune-iterations", "5", "--distributed-backend", "gloo",
                                      "--octopipe-profile", "--octopipe-profile-repeats", "1",
                                      "--octopipe-profile-cache", os.path.join(out, "cache")],
                          world=world, rank=rank, validate=False)
    assert dist.is_initialized() and dist.get_world_size() == world  # the run's group, not the profiler's
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(args.octopipe_plan, fh)
    dist.destroy_process_group()
