"""The DeepSpeed example files: the ds_config's block is valid, the benchmark's partitions are DeepSpeed's."""

import json
import sys
from pathlib import Path

import pytest

from octopipe_plugin.adapters.deepspeed.config import parse_block

pytestmark = pytest.mark.framework
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "deepspeed"


def test_example_ds_config_block_is_valid():
    block = parse_block(json.loads((EXAMPLES / "ds_config.json").read_text()))
    assert block is not None and block.tune is not None and block.save_plan


def test_benchmark_partitions_and_plans(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import benchmark

    from octopipe_plugin.costs import resolve_cluster, resolve_model

    model, cluster = resolve_model("deepseek-v3-mini"), resolve_cluster("h100x4")
    divisor = sum(layer.state_bytes for layer in model.layers) / 18 / 2e6
    parts = benchmark.deepspeed_parts(model, 4, divisor)
    assert parts[0] == 0 and parts[-1] == model.num_layers and len(parts) == 5
    args = benchmark.parse_args(["--stand-in", "--microbatches", "8", "--tune-budget", "1"])
    plans = benchmark.plans(args, model, cluster, divisor)
    assert plans["stock"].num_stages == 4 and plans["dualpipev"].num_stages == 8
    assert [st.start for st in plans["stock"].stages] == parts[:-1]
    assert plans["octopipe"].num_microbatches == 8
    sys.modules.pop("benchmark", None)
