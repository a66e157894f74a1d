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
    assert first["plan_meta"]["tuned_for"]["profiled_kinds"] == ["dense", "embedding", "lm_head"]
    assert not first["left_open"]  # Megatron's own initialisation starts from nothing
    assert first["cached"] and second["cached"] == first["cached"]  # the second start-up read the cache
