"""A split LM head of a model with multi-token prediction (issue 32 item 6): 1 + depth heads over one weight.

The shards run the head over every hidden state the owner hands over (the main model's and each MTP
depth's, concatenated along dim 0), each head with its own loss coefficient (1, and Megatron's MTP
loss scaling factor / depth). Checked against single-process autograd in float64 at rtol 1e-10: the
shard math alone, then the toy language model with MTP depth 1 and 2 run by the executor over gloo
(testing/split_checks.py: the loss and every gradient each rank holds; a reference with one MTP
coefficient 1% off must fail every comparison); and the dry run of the tuner's deepseek-v3-mini
split plan (stand-ins) runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.executor.head_input import (
    HeadInput, concat_heads, heads_meta, loss_coefficients, mtp_loss_scales, mtp_targets,
)
from octopipe_plugin.executor.interface import TensorMeta
from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.executor.validate import check_model_runnable, check_runnable
from octopipe_plugin.executor.vocab_shard import VocabShards, shard_rows
from octopipe_plugin.formats import Plan, Stage, plan_to_dict
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for
from octopipe_plugin.testing.plans import make_plan
from octopipe_plugin.testing.split_checks import (
    check_split_plans_worker, cost_model, embedding_split, head_split, with_shards,
)
from octopipe_plugin.testing.toy import ToySpec

V, H, B, S = 13, 5, 2, 4
DT = torch.float64
FACTOR = 0.3  # a factor whose depth terms are not small beside the main loss


def test_mtp_targets_shift_each_depth_one_token_further_and_leave_its_last_positions_without_one():
    t = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = mtp_targets(t, 2, ignore_index=-1).reshape(3, 2, 4)
    assert got[0].tolist() == t.tolist()
    assert got[1].tolist() == [[2, 3, 4, -1], [6, 7, 8, -1]]
    assert got[2].tolist() == [[3, 4, -1, -1], [7, 8, -1, -1]]
    assert torch.equal(mtp_targets(t, 0), t.reshape(-1))
    assert mtp_loss_scales(2, 0.1) == (1.0, 0.05, 0.05) and mtp_loss_scales(1, 0.3) == (1.0, 0.3)
    a, b = torch.zeros(2, 3, H), torch.ones(2, 3, H)
    assert torch.equal(concat_heads([a, b]), torch.cat([a, b])) and concat_heads(a) is a
    with pytest.raises(ValueError, match="differ in shape"):
        concat_heads([a, b[:1]])
    assert heads_meta(TensorMeta(shape=(2, 3, H), dtype=DT), 3).shape == (6, 3, H)


def _plan() -> Plan:
    """Two stages on two devices, the head (layer 3) split over both."""
    rows = [["0F0", "1H0", "1J0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]
    return Plan(model="m", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=4, device=1)),
                schedule=parse_schedule(rows), splits=(SplitLayer(layer=3, devices=(0, 1), shares=(0.4, 0.6)),))


def _data(depth: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    states = [torch.randn(B, S, H, generator=g, dtype=DT) for _ in range(1 + depth)]
    w = torch.randn(V, H, generator=g, dtype=DT)
    t = torch.randint(V, (B, S), generator=g)
    t[0, 1] = -100  # a main token without loss (and, shifted, a depth-1 token)
    return states, w, t


def _reference(states, w, t, coefs):
    """sum_j coefs[j] x mean cross-entropy of head j (its logits states[j] W^T, depth j's targets t[p + j]) by
    autograd on the whole weight: (loss, each state's gradient, the weight's gradient)."""
    xs = [x.clone().requires_grad_(True) for x in states]
    wr = w.clone().requires_grad_(True)
    loss = torch.zeros((), dtype=DT)
    for j, x in enumerate(xs):
        tj = torch.full_like(t, -100)
        tj[:, :S - j] = t[:, j:]
        loss = loss + coefs[j] * F.cross_entropy((x @ wr.t()).reshape(-1, V), tj.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), [x.grad for x in xs], wr.grad


def _rule(t_all, depth, coefs):
    """The loss rule over every head's per-token losses: each head's masked mean times its coefficient."""
    valid = (t_all != -100).reshape(1 + depth, -1)

    def rule(l):
        l = l.reshape(valid.shape)
        return sum(coefs[j] * (l[j] * valid[j]).sum() / valid[j].sum() for j in range(1 + depth))

    return rule


@pytest.mark.parametrize("depth", [1, 2])
def test_head_shards_over_the_main_and_mtp_hidden_states_give_every_head_s_loss_and_gradients(depth):
    plan = _plan()
    states, w, t = _data(depth, seed=depth)
    coefs = mtp_loss_scales(depth, FACTOR)
    t_all = mtp_targets(t, depth)
    coef = loss_coefficients(_rule(t_all, depth, coefs), t_all.numel(), DT, "cpu")
    shards = []
    for r in (0, 1):
        lo, hi = shard_rows(plan, "output", V, r)
        shards.append(VocabShards(plan=plan, rank=r, vocab_size=V, head_weight=nn.Parameter(w[lo:hi].clone()),
                                  hidden_meta=TensorMeta(shape=(B, S, H), dtype=DT), heads=1 + depth))
    meta = shards[0].split_meta("head-input")
    assert meta.hidden.shape == ((1 + depth) * B, S, H) and meta.targets.shape == ((1 + depth) * B * S,)
    assert shards[0].split_meta("stats").shape == ((1 + depth) * B * S, 3)  # per token and hidden state
    given = HeadInput(hidden=concat_heads(states), targets=t_all, coef=coef)
    stats = [s.head_forward(1, 0, tuple(given)) for s in shards]
    out = [s.head_backward_input(1, 0, [stats[1 - s.rank]]) for s in shards]
    for s in shards:
        s.head_backward_weight(1, 0)
    loss, dxs, dw = _reference(states, w, t, coefs)
    for _, reported in out:  # every shard reports the loss over every head
        torch.testing.assert_close(reported.loss, loss, rtol=1e-10, atol=0)
    partial = out[0][0] + out[1][0]
    assert partial.shape == ((1 + depth) * B, S, H)
    for j, dx in enumerate(partial.chunk(1 + depth)):  # each hidden state's input gradient, head-major
        torch.testing.assert_close(dx, dxs[j], rtol=1e-10, atol=1e-13)
    for s in shards:
        lo, hi = s.head_rows
        torch.testing.assert_close(s.head_weight.grad, dw[lo:hi], rtol=1e-10, atol=1e-13)
    # a 1% error in the last depth's coefficient fails at this tolerance
    off = list(coefs)
    off[-1] *= 1.01
    off_loss, off_dxs, off_dw = _reference(states, w, t, off)
    assert not torch.allclose(out[0][1].loss, off_loss, rtol=1e-10, atol=0)
    assert not torch.allclose(partial.chunk(1 + depth)[-1], off_dxs[-1], rtol=1e-10, atol=1e-13)
    assert not torch.allclose(shards[1].head_weight.grad, off_dw[shard_rows(plan, "output", V, 1)[0]:],
                              rtol=1e-10, atol=1e-13)


def test_a_head_input_without_every_head_s_rows_is_refused_by_name():
    plan = _plan()
    states, w, t = _data(1)
    lo, hi = shard_rows(plan, "output", V, 0)
    s = VocabShards(plan=plan, rank=0, vocab_size=V, head_weight=nn.Parameter(w[lo:hi].clone()), heads=2)
    coef = torch.ones(B * S, dtype=DT)
    with pytest.raises(ValueError, match=r"1H0: a head of 2 hidden states .* concatenated along dim 0") as exc:
        s.head_forward(1, 0, HeadInput(states[0][:1], t.reshape(-1)[:S], coef[:S]))  # 1 row of dim 0: not 2 heads
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="16 rows|8 targets"):
        s.head_forward(1, 0, HeadInput(concat_heads(states), t.reshape(-1), coef))  # the main head's targets only
    with pytest.raises(ValueError, match="heads 0"):
        VocabShards(plan=plan, rank=0, vocab_size=V, head_weight=nn.Parameter(w[lo:hi].clone()), heads=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_split_torch_stages_hand_over_every_head_s_targets_and_megatron_s_mtp_loss(reduction):
    """The owner's loss terms: each depth's cross-entropy over its own targets times factor / depth ("sum": times
    the main head's count over the depth's, as Megatron's per-token loss), / num_microbatches; the report logs
    each head's."""
    from octopipe_plugin.executor.vocab_shard import SplitTorchStages

    plan, depth = _plan(), 2
    states, w, t = _data(depth)
    lo, hi = shard_rows(plan, "output", V, 1)
    runner = SplitTorchStages(plan=plan, rank=1, modules={1: nn.Identity()}, num_microbatches=2, vocab_size=V,
                              head_weight=nn.Parameter(w[lo:hi].clone()), targets=lambda mb: t, reduction=reduction,
                              mtp_depth=depth, mtp_loss_scaling_factor=FACTOR)
    t_all, rule = runner._head_loss(0, None)
    assert torch.equal(t_all, mtp_targets(t, depth))
    per_token = torch.rand(t_all.numel(), generator=torch.Generator().manual_seed(5), dtype=DT) + 0.5
    heads = per_token.reshape(1 + depth, -1)
    valid = (t_all != -100).reshape(1 + depth, -1)
    sums = [float(heads[j][valid[j]].sum()) for j in range(1 + depth)]
    counts = [int(v.sum()) for v in valid]
    assert counts == [7, 5, 4]  # 8 tokens: the masked main one (depth 1 sees it one earlier), each depth's last ones
    if reduction == "mean":
        want = sums[0] / counts[0] + sum(FACTOR / depth * sums[j] / counts[j] for j in (1, 2))
    else:
        want = sums[0] + sum(FACTOR / depth * sums[j] * counts[0] / counts[j] for j in (1, 2))
    assert float(rule(per_token)) == pytest.approx(want / 2, rel=1e-12)
    coef = loss_coefficients(rule, t_all.numel(), DT, "cpu")
    rep = runner._report(0, per_token, coef)
    assert float(rep.loss) == pytest.approx(want / 2, rel=1e-12) and float(rep.raw) == pytest.approx(want, rel=1e-12)
    assert rep.num_tokens == (None if reduction == "mean" else counts[0])
    main = sums[0] / counts[0] if reduction == "mean" else sums[0]
    assert float(rep.logs["lm loss"]) == pytest.approx(main, rel=1e-12)
    for j in (1, 2):
        assert float(rep.logs[f"mtp_{j} loss"]) == pytest.approx(sums[j] / counts[j], rel=1e-12)
    # the owner's hidden states: main, then each depth's, concatenated along dim 0; a missing depth is refused
    assert torch.equal(runner._module_output(1, tuple(states), None), torch.cat(states))
    with pytest.raises(ValueError, match="gave 2 hidden states; a head with MTP depth 2 takes 3"):
        runner._module_output(1, tuple(states[:2]), None)


# ----- the toy language model with MTP, run by the executor over gloo

MTP1 = ToySpec(layers=("embed", "mlp", "attn", "mlp", "mtp", "lm"), vocab=29, mtp_loss_scale=FACTOR)
MTP2 = replace(MTP1, layers=("embed", "mlp", "attn", "mtp", "mtp", "lm"), seq=5)
TIED = replace(MTP1, tied=True)


def _generated(name: str, p: int, m: int, bounds, splits_of, spec: ToySpec, label: str):
    """A built-in schedule on the given stage ranges, its split layers' shard actions placed."""
    v = 2 if name in ("zb-v", "interleaved-1f1b") else 1
    devs = stage_devices_for(name, p, v)
    plan = make_plan(stage_devices=devs, bounds=bounds, num_devices=p, num_microbatches=m,
                     schedule=SCHEDULES[name].generate(devs, p, m))
    return _doc(with_shards(spec, plan, splits_of(plan)), label), spec


def _tuned(p: int, m: int, spec: ToySpec):
    """The split-aware tuner's plan for the toy's cost model (a heavy head): its own irregular orders."""
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.tuner.split import tune_split

    cluster = replace(zero_cost_cluster(p), memory_bytes=1 << 40)
    plan = tune_split(cost_model(spec, 4.0), cluster, m, iterations=6, time_budget_s=10, seed=p).plan
    assert plan.splits, "the tuner chose no split for a 4 ms head: the test would not test splits"
    return _doc(plan, f"tuned p={p} m={m} depth={spec.mtp_depth} splits={plan.splits}"), spec


def _doc(plan, label: str) -> dict:
    check_runnable(plan, nccl=True)
    doc = plan_to_dict(plan)
    doc["meta"] = {"label": label}
    return doc


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_executor_runs_a_split_head_over_the_main_and_mtp_hidden_states_on_two_and_three_ranks():
    """Depth 1 and 2; the MTP layers on the owner stage or before it (the boundary then carries every state, the
    owner holding only the head, as the tuner's deepseek-v3-mini plans); tied with a split embedding; an owner
    without a shard; the head input's meta learned by handshake (testing/split_checks.py, every other plan)."""
    cases2 = [
        _generated("1f1b", 2, 3, [(0, 3), (3, 6)], lambda plan: [head_split(MTP1, [0, 1], [0.3, 0.7])], MTP1,
                   "1f1b, depth 1 on the owner stage"),
        _generated("zb-v", 2, 3, [(0, 2), (2, 3), (3, 5), (5, 6)],
                   lambda plan: [head_split(TIED, [0, 1]), embedding_split([0, 1])], TIED,
                   "V-shape, depth 1 before the owner, tied head and embedding split"),
        _generated("gpipe", 2, 2, [(0, 4), (4, 6)], lambda plan: [head_split(MTP2, [0], [1.0])], MTP2,
                   "depth 2, the owner without a shard"),
    ]
    spawn(check_split_plans_worker, 2, *map(list, zip(*cases2)))
    cases3 = [_tuned(3, 3, MTP1),
              _generated("interleaved-1f1b", 3, 3, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)],
                         lambda plan: [head_split(MTP2, [0, 1, 2], [0.2, 0.5, 0.3])], MTP2,
                         "looped, depth 2, each depth its own stage")]
    spawn(check_split_plans_worker, 3, *map(list, zip(*cases3)))


# ----- the model of the tuner's plans: deepseek-v3-mini (MTP depth 1)


def test_a_split_head_of_a_model_with_mtp_is_runnable():
    from octopipe_plugin.costs import resolve_model
    from octopipe_plugin.testing.split_plans import head_split_plan

    ds = resolve_model("deepseek-v3-mini")
    from octopipe_plugin.executor.dryrun import zero_cost_cluster

    plan = head_split_plan(ds, replace(zero_cost_cluster(2), memory_bytes=1 << 40), 2)
    check_model_runnable(ds, plan)  # no refusal: the shards take every head's hidden states


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_dry_run_of_the_tuner_s_deepseek_v3_mini_split_plan_runs_its_shards():
    from octopipe_plugin.costs import resolve_model
    from octopipe_plugin.executor.dryrun import dry_run, zero_cost_cluster
    from octopipe_plugin.formats.model import head_inputs
    from octopipe_plugin.schedules.split_messages import split_messages
    from octopipe_plugin.tuner.split import tune_split

    ds = resolve_model("deepseek-v3-mini")
    assert head_inputs(ds) == 2
    cluster = replace(zero_cost_cluster(3), memory_bytes=1 << 40)
    plan = tune_split(ds, cluster, 3, iterations=4, time_budget_s=5, seed=0).plan
    head = ds.num_layers - 1
    assert [sp.layer for sp in plan.splits] == [head], plan.splits
    check_model_runnable(ds, plan)
    report = dry_run(ds, plan, target_ms=300.0)
    assert report.messages_checked >= len(split_messages(plan))
    assert report.measured_ms > 0.9 * report.predicted_ms
