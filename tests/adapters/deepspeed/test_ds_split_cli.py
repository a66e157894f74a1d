"""`octopipe plan --deepspeed-config --module --splits auto`: split plans for the DeepSpeed job, kept only where
OctoPipeEngine runs them (an untied bias-free Linear head, or a head tied to the embedding whose forward_fn is the
projection x @ W^T, its owner among the shards)."""

from __future__ import annotations

import json
import os

import deepspeed  # noqa: F401  (its first import prints an accelerator line to stdout: done before the captured runs)
import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import read_plan

pytestmark = [pytest.mark.framework, pytest.mark.timeout(600)]

MODULE = '''
import sys
sys.path.insert(0, {examples!r})
from torch import nn
from torch.nn import functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from train_gpt import Block, gpt_specs

def untied():
    return ([LayerSpec(nn.Embedding, 64000, 256)] + [LayerSpec(Block, 256, 4) for _ in range(6)]
            + [LayerSpec(nn.LayerNorm, 256), LayerSpec(nn.Linear, 256, 64000, bias=False)])

def tied():  # the example's head: x @ W^T / sqrt(hidden), a scaled projection
    return gpt_specs(vocab=64000, hidden=256, heads=4, layers=6)

def tied_projection():
    specs = gpt_specs(vocab=64000, hidden=256, heads=4, layers=6)
    specs[-1] = TiedLayerSpec("embed", nn.Embedding, 64000, 256, forward_fn=lambda m, x: F.linear(x, m.weight))
    return specs
'''


@pytest.fixture()
def job(tmp_path, monkeypatch):
    examples = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "examples", "deepspeed")
    (tmp_path / "splitjob.py").write_text(MODULE.format(examples=os.path.abspath(examples)))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                                "octopipe": {"tune": {"cluster": "h100x4", "seq_len": 1024}}}))
    return tmp_path, str(path)


def _plan(capsys, cfg, target, out):
    rc = main(["plan", "--cluster", "h100x4", "--time-budget", "3", "--seed", "1", "--no-progress",
               "--deepspeed-config", cfg, "--module", target, "--splits", "auto", "--json", "-o", out])
    text, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(text)


def test_an_untied_linear_head_is_split_with_its_owner_among_the_shards(capsys, job):
    tmp, cfg = job
    doc = _plan(capsys, cfg, "splitjob:untied", str(tmp / "p.json"))
    plan = read_plan(tmp / "p.json")
    assert doc["split_layers"].startswith("split layers   head over") and "not kept" not in doc["split_layers"]
    # An untied plain nn.Embedding first entry is split too (issue 35), its owner among its shards.
    head, = [s for s in plan.splits if s.layer == 8]
    assert plan.stages[-1].device in head.devices
    assert all(s.layer in (0, 8) for s in plan.splits)
    for embedding in (s for s in plan.splits if s.layer == 0):
        assert plan.stages[0].device in embedding.devices
    assert [r["label"] for r in doc["comparison"]][:2] == ["OctoPipe (split layers)", "OctoPipe (no split)"]


def test_a_head_tied_to_the_embedding_is_split_when_its_forward_fn_is_the_projection(capsys, job):
    tmp, cfg = job
    doc = _plan(capsys, cfg, "splitjob:tied_projection", str(tmp / "p.json"))
    assert doc["split_layers"].startswith("split layers   head over") and "not kept" not in doc["split_layers"]
    plan = read_plan(tmp / "p.json")
    assert [s.layer for s in plan.splits] == [8]  # a tied embedding is not split (README, DeepSpeed section)


def test_a_tied_head_that_scales_the_projection_keeps_the_plan_without_splits_and_says_why(capsys, job):
    tmp, cfg = job
    doc = _plan(capsys, cfg, "splitjob:tied", str(tmp / "p.json"))
    assert ("not kept: list entry 8 (the split LM head, TiedLayerSpec 'embed'): its forward_fn computes x @ weight^T "
            "times 0.0625 (a scaled projection)") in doc["split_layers"]
    assert not read_plan(tmp / "p.json").splits
