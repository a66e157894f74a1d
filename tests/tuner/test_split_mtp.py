"""Multi-token prediction and a split head: the shared output head's work of every depth sits in lm_head."""

from __future__ import annotations

import dataclasses

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.costs import resolve_model
from octopipe_plugin.executor.validate import check_model_runnable
from octopipe_plugin.formats import Plan, Stage
from octopipe_plugin.formats.model import head_inputs
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.tuner.split import STATS_BYTES_PER_TOKEN, stats_bytes


def test_the_head_takes_one_hidden_state_per_mtp_depth_plus_the_main_one():
    ds, llama = resolve_model("deepseek-v3-mini"), resolve_model("llama3-8b")
    assert head_inputs(ds) == 2 and head_inputs(llama) == 1
    three = dataclasses.replace(ds, layers=ds.layers[:-1] + ds.layers[-2:])  # two mtp layers, then the head
    assert head_inputs(three) == 3
    assert head_inputs(dataclasses.replace(ds, layers=ds.layers[:-1])) == 1  # no lm_head last: no head
    # the softmax statistics each shard sends: per token and per hidden state
    assert stats_bytes(ds) == STATS_BYTES_PER_TOKEN * 4096 * 2
    assert stats_bytes(llama) == STATS_BYTES_PER_TOKEN * 8192


def test_the_mtp_layer_hands_both_hidden_states_to_the_head():
    ds = resolve_model("deepseek-v3-mini")
    mtp, head = ds.layers[-2], ds.layers[-1]
    assert (mtp.kind, head.kind) == ("mtp", "lm_head")
    assert mtp.output_bytes == 2 * ds.layers[-3].output_bytes  # main + the depth's hidden states
    assert head.total_ms > 5 * mtp.total_ms  # the two heads' projections and losses are the head's


def _plan(model, split_layer: int) -> Plan:
    n = model.num_layers
    stages = (Stage(start=0, end=n - 2, device=0), Stage(start=n - 2, end=n, device=1))
    sched = (("0F0", "0B0"), ("1F0", "1B0"))
    return Plan(model=model.name, num_devices=2, num_microbatches=1, stages=stages,
                schedule=parse_schedule(sched),
                splits=(SplitLayer(layer=split_layer, devices=(0, 1), shares=(0.5, 0.5)),))


def test_the_shard_runners_take_a_split_head_of_a_model_with_mtp():
    """Issue 32 item 6: the shards run every head's hidden states (tests/executor/test_split_mtp_exec.py runs them)."""
    ds, llama = resolve_model("deepseek-v3-mini"), resolve_model("llama3-8b")
    check_model_runnable(ds, _plan(ds, ds.num_layers - 1))
    check_model_runnable(llama, _plan(llama, llama.num_layers - 1))
    check_model_runnable(ds, _plan(ds, 0))  # the embedding of an MTP model splits as any
