"""`octopipe plan --deepspeed-config --module`: the start-up's model of the layer list, its batch, its partition now."""

from __future__ import annotations

import json
import os
import sys

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import read_plan
from octopipe_plugin.formats.fingerprint import model_fingerprint

pytestmark = [pytest.mark.framework, pytest.mark.timeout(300)]

MODULE = '''
import sys
sys.path.insert(0, {examples!r})
from train_gpt import gpt_specs

def build():
    return gpt_specs(vocab=512, hidden=64, heads=4, layers=6)

def allocated():
    import torch
    return [torch.nn.Linear(4, 4)]  # built under the meta device by the planner
'''


@pytest.fixture()
def job(tmp_path, monkeypatch):
    examples = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "deepspeed")
    (tmp_path / "myjob.py").write_text(MODULE.format(examples=os.path.abspath(examples)))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
              "octopipe": {"tune": {"cluster": "h100x1", "gpu": "H100", "seq_len": 128}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return tmp_path, str(path), config


def _plan(capsys, cfg, *extra, expect=0):
    rc = main(["plan", "--cluster", "h100x2", "--iterations", "20", "--no-progress", "--deepspeed-config", cfg,
               *extra])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if expect == 0 else err


def test_graph_equals_the_startups_and_the_table_shows_deepspeeds_partition(capsys, job, monkeypatch):
    import torch.distributed as dist

    import octopipe_plugin.tuner as tuner
    from octopipe_plugin.adapters.deepspeed.config import parse_block
    from octopipe_plugin.adapters.deepspeed.plan_source import tune_at_startup
    from octopipe_plugin.executor.launch import free_port

    tmp, cfg, config = job
    text = _plan(capsys, cfg, "--module", "myjob:build", "-o", str(tmp / "plan.json"))
    assert "Your job: 2 pipeline ranks x 8 micro-batches per step (gradient_accumulation_steps), 9 layers" in text
    assert "your job now: DeepSpeed's PipelineEngine (1F1B, one stage per rank) on partition_method 'parameters'" \
        in text and "x faster than your current setup" in text
    assert '"octopipe": {"plan": "' + str(tmp / "plan.json") + '"}' in text
    plan = read_plan(tmp / "plan.json")
    # the model DeepSpeed's start-up tunes for the same list and config (its tuner call captured)
    import myjob

    seen = {}

    class Captured(Exception):
        pass

    def capture(model, cluster, m, **kw):
        seen.update(model=model, m=m)
        raise Captured

    monkeypatch.setattr(tuner, "tune", capture)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(Captured):
            tune_at_startup(myjob.build(), parse_block(config), config, None)
    finally:
        dist.destroy_process_group()
    assert plan.meta["fingerprint"]["model"] == model_fingerprint(seen["model"])
    assert plan.num_microbatches == seen["m"] == 8


def test_uniform_partition_and_the_meta_device(capsys, job):
    tmp, cfg, _ = job
    doc = json.loads(_plan(capsys, cfg, "--module", "myjob:build", "--partition-method", "uniform", "--json",
                           "-o", str(tmp / "p.json")))
    assert "'uniform' (parts [0, 5, 9])" in doc["job"]["current"]["stages"]
    import myjob  # noqa: F401
    from octopipe_plugin.adapters.deepspeed.from_config import build_layers

    assert next(build_layers("myjob:allocated")[0].parameters()).device.type == "meta"


@pytest.mark.parametrize("extra, fragment", [
    (["--module", "myjob:nothing"], "--module myjob:nothing: cannot import it"),
    (["--module", "myjob"], "expected pkg.module:function"),
    ([], "--deepspeed-config and --module go together"),
    (["--module", "myjob:build", "--partition-method", "profile"], "--partition-method profile: expected"),
])
def test_bad_inputs_are_one_line(capsys, job, extra, fragment):
    _, cfg, _ = job
    err = _plan(capsys, cfg, *extra, expect=2)
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_the_blocks_headroom_is_used_unless_overridden(capsys, job):
    tmp, cfg, config = job
    config["octopipe"]["tune"]["memory_headroom"] = "10GiB"
    (tmp / "ds_config.json").write_text(json.dumps(config))
    doc = json.loads(_plan(capsys, cfg, "--module", "myjob:build", "--json", "-o", str(tmp / "p.json")))
    assert doc["memory_headroom_bytes"] == 10 * 2**30
    doc = json.loads(_plan(capsys, cfg, "--module", "myjob:build", "--json", "-o", str(tmp / "p.json"),
                           "--memory-headroom", "0"))
    assert doc["memory_headroom_bytes"] == 0


def test_json_on_a_first_import_is_clean_and_the_parts_are_plain_ints(job):
    """A fresh `octopipe plan --json` process: DeepSpeed's import-time log lines (its accelerator warning on a
    machine without a GPU) stay off stdout, and partition_balanced's numpy ints print as plain ints."""
    import re
    import subprocess

    tmp, cfg, _ = job
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "octopipe_plugin", "plan", "--cluster", "h100x2", "--iterations",
                           "20", "--no-progress", "--deepspeed-config", cfg, "--module", "myjob:build", "--json",
                           "-o", str(tmp / "p.json")], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    stages = doc["job"]["current"]["stages"]
    assert re.search(r"'parameters' \(parts \[0, \d+, 9\]\)", stages), stages


def test_the_jobs_interval_is_replaced_by_the_plans_memory_choices_or_kept(capsys, job):
    tmp, cfg, _ = job
    text = _plan(capsys, cfg, "--module", "myjob:build", "--activation-checkpoint-interval", "2", "--recompute",
                 "full", "--splits", "off", "-o", str(tmp / "p.json"))
    plan = read_plan(str(tmp / "p.json"))
    assert plan.memory
    assert (f"and build the PipelineModule with activation_checkpoint_interval=0 (the plan's memory choices on "
            f"{len(plan.memory)} layer(s) replace it; an interval beside them is refused)") in text
    doc = json.loads(_plan(capsys, cfg, "--module", "myjob:build", "--activation-checkpoint-interval", "2",
                           "--recompute", "none", "--offload", "none", "--json", "-o", str(tmp / "q.json")))
    assert doc["memory_choices"] == 0 and doc["memory_notes"] == []  # the job's own interval stays
