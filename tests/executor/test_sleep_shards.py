"""SleepShards: the one stand-in of a split plan's shard passes and hand-overs, for the dry run and any runner."""

import time

import pytest
import torch

from octopipe_plugin.executor import ExecutorError
from octopipe_plugin.executor.clock import DeviceClock
from octopipe_plugin.executor.interface import LossOutput, TensorMeta
from octopipe_plugin.executor.standin import (
    ShardCosts, SleepShards, SleepStages, StandInCosts, split_numel, split_ready, split_stamp,
)
from octopipe_plugin.testing.sleep_layer import DTYPE, HeadHandOver, stamp, stamped

ND = 3
LINK = tuple(tuple(0.0 if a == b else 10.0 * (1 + a) for b in range(ND)) for a in range(ND))  # ms, by sender


def _head(fwd=3.0, bwd=6.0, wgrad=3.0) -> ShardCosts:
    return ShardCosts(side="output", owner=2, devices=(0, 1, 2), shares=(0.5, 0.25, 0.25), fwd=fwd, bwd=bwd,
                      wgrad=wgrad, link_ms=LINK, stats_ms=LINK)


def test_summed_partials_land_when_the_latest_sender_s_part_does():
    t0 = 1000.0
    parts = [split_stamp("head-partial", 4, j, t0 + j, ND) for j in range(ND)]
    total = parts[0] + parts[1] + parts[2]  # what the executor hands the owner's backward
    ready = split_ready(total, "head-partial", 4, lambda j: LINK[j][2], rank=2, action="2B4")
    assert ready == pytest.approx(max(t0 + j + LINK[j][2] / 1000 for j in range(ND)))
    with pytest.raises(ExecutorError, match="expected micro-batch 5 of 'head-partial'"):
        split_ready(total, "head-partial", 5, lambda j: 0.0, rank=2, action="2B5")
    with pytest.raises(ExecutorError, match="expected micro-batch 4 of 'stats'"):
        split_ready(total, "stats", 4, lambda j: 0.0, rank=2, action="2J4")
    # a producer that does not know the micro-batch (a framework's layer) writes -1: the kind is still checked
    unknown = split_stamp("head-input", -1, 2, t0, ND, shape=(1, 1, 8))
    assert split_ready(unknown, "head-input", 4, lambda j: 0.0, rank=0, action="0H4") == t0
    with pytest.raises(ValueError, match=f"needs {split_numel(ND)} elements"):
        split_stamp("head-input", 0, 0, t0, ND, shape=(1, 1, 4))  # too small for the header and 3 slots


def test_shards_take_a_framework_s_head_input_and_report_through_the_runner():
    clock = DeviceClock("device")
    t0 = time.time()
    clock.start(t0)
    reports = []

    def report(mb, losses, coef):
        reports.append((mb, losses.shape, coef.tolist()))
        return LossOutput(loss=torch.zeros(()))

    meta = TensorMeta(shape=(1, 1, 8), dtype=DTYPE)
    shards = SleepShards(shards=(_head(),), rank=0, device=clock, num_devices=ND, hand_over=meta, report=report)
    assert shards.split_meta("head-partial").shape == (1, 1, 8)
    assert shards.split_meta("stats").shape == (split_numel(ND),)
    hidden = split_stamp("head-input", 1, 2, t0, ND, shape=(1, 1, 8))
    coef = torch.tensor([0.25], dtype=torch.float32)
    stats = shards.head_forward(3, 1, (hidden, torch.zeros(1, dtype=torch.int64), coef))  # megsplit's 3-tuple
    assert shards.pending() == 1
    peer = split_stamp("stats", 1, 1, t0, ND)
    partial, loss = shards.head_backward_input(3, 1, (peer,))
    assert isinstance(loss, LossOutput) and reports == [(1, (1,), [0.25])] and shards.pending() == 0
    assert partial.shape == (1, 1, 8) and partial.dtype == DTYPE
    shards.head_backward_weight(3, 1)
    # H waited for the owner's hand-over (link 2 -> 0), then slept its half of F; J and K their halves
    assert float(stats[5]) >= t0 + LINK[2][0] / 1000 + 0.5 * 3.0 / 1000 - 1e-6
    assert clock.busy_s == pytest.approx(0.5 * (3.0 + 6.0 + 3.0) / 1000)
    assert shards.checked == 2
    with pytest.raises(ExecutorError, match="expected micro-batch 2 of 'head-input'"):
        shards.head_forward(3, 2, hidden)


def test_the_owner_s_hand_over_layer_stamps_forward_and_waits_for_the_partials_backward():
    clock = DeviceClock("device")
    t0 = time.time()
    clock.start(t0)
    shards = SleepShards(shards=(_head(),), rank=2, device=clock, num_devices=ND,
                         hand_over=TensorMeta(shape=(1, 8), dtype=DTYPE))
    layer = HeadHandOver(shards, mb=lambda: 7)
    x = stamped(t0 + 0.001, (1, 4)).requires_grad_(True)
    out = layer(x)
    assert out.shape == (1, 8)
    assert split_ready(out, "head-input", 7, lambda j: 0.0, rank=0, action="H") == pytest.approx(t0 + 0.001)
    partials = sum(split_stamp("head-partial", 7, j, t0 + 0.002, ND, shape=(1, 8)) for j in range(ND))
    out.backward(partials)
    want = max(t0 + 0.002 + LINK[j][2] / 1000 for j in range(ND))
    assert x.grad.shape == (1, 4) and stamp(x.grad) == pytest.approx(want)


def test_sleep_stages_run_their_shard_actions_in_their_sleep_shards():
    costs = StandInCosts(fwd=(0.0, 0.0), bwd=(0.0, 0.0), wgrad=(0.0, 0.0), hop=(0.0, 0.0), shards=(_head(),))
    run = SleepStages(costs=costs, rank=2)
    assert isinstance(run.shards, SleepShards) and run.shards.device is run.device
    handed = run.forward(1, 0, (torch.tensor([0.0, 0.0, 0.0, time.time(), 0.0], dtype=torch.float64),))
    run.head_forward(1, 0, handed)
    assert run.checked == 2  # the boundary and the hand-over, counted together
    run.checked = 0
    assert run.checked == 0
