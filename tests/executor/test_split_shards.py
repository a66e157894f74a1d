"""The split head's hand-over and shard math (executor/head_input.py, executor/vocab_shard.py), in one process.

Loss coefficients from a loss rule (exact for linear rules, non-linear ones refused by name); the
shards' cross-entropy, input gradient and weight gradients against `F.cross_entropy` on the whole
weight (float64); the gradient sinks; forward-only split plans (kinds, deadlock-freedom, messages);
tensor parallelism inside a shard over two gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octopipe_plugin.actions import Kind, parse_schedule
from octopipe_plugin.executor.head_input import HeadInput, NonLinearLossRule, head_input_meta, loss_coefficients
from octopipe_plugin.executor.interface import TensorMeta
from octopipe_plugin.executor.lowered import FORWARD_KINDS, forward_plan, is_forward_only, lowered_plan
from octopipe_plugin.executor.validate import check_runnable
from octopipe_plugin.executor.vocab_shard import TensorParallel, VocabShards, shard_rows
from octopipe_plugin.formats import Plan, Stage
from octopipe_plugin.formats.splits import SplitLayer, loss_terms_bytes
from octopipe_plugin.schedules.split_messages import split_messages, stats_gathers

V, H, TOKENS = 11, 5, 6
DT = torch.float64


def _plan(devices=(0, 1), shares=(0.4, 0.6), embedding=False) -> Plan:
    """Two stages on two devices, the head (layer 3) split over `devices` (with `embedding`, layer 0 over both)."""
    if devices == (0, 1):
        rows = [["0F0", "1H0", "1J0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]
    else:  # the head whole on the owner's device 1
        rows = [["0F0", "0B0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]
    splits = [SplitLayer(layer=3, devices=tuple(devices), shares=tuple(shares), stats_bytes=12 * TOKENS)]
    if embedding:
        rows = [["0E0", *rows[0][:-1], "0G0", rows[0][-1]], ["0E0", *rows[1], "0G0"]]  # G after 0B0
        splits.append(SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5)))
    return Plan(model="m", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=4, device=1)),
                schedule=parse_schedule(rows), splits=tuple(splits))


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, TOKENS // 2, H, generator=g, dtype=DT)
    w = torch.randn(V, H, generator=g, dtype=DT)
    t = torch.randint(V, (TOKENS,), generator=g)
    return x, w, t


def test_loss_coefficients_of_a_mean_rule_are_the_mask_over_its_count_and_scales():
    valid = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    coef = loss_coefficients(lambda l: (l * valid).sum() / 4 / 3 * 8.0, TOKENS, DT, "cpu")
    assert coef.dtype == DT and coef.shape == (TOKENS,)
    assert torch.equal(coef, valid.to(DT) * (8.0 / 12))
    # a shape is flattened in its own order (the hidden states' rows)
    assert loss_coefficients(lambda l: l[0].sum(), (2, 3), torch.float32, "cpu").tolist() == [1, 1, 1, 0, 0, 0]
    assert torch.equal(loss_coefficients(lambda l: torch.zeros(()), 3, DT, "cpu"), torch.zeros(3, dtype=DT))


def test_a_loss_rule_not_linear_in_the_per_token_losses_is_refused_by_name_in_one_line():
    with pytest.raises(NonLinearLossRule, match="not linear in the per-token losses") as exc:
        loss_coefficients(lambda l: (l ** 2).mean(), TOKENS, DT, "cpu")
    assert "\n" not in str(exc.value)
    with pytest.raises(NonLinearLossRule):
        loss_coefficients(lambda l: l.sum() / l.detach().sum(), TOKENS, torch.float32, "cpu")  # weights from values
    with pytest.raises(TypeError, match="one scalar tensor"):
        loss_coefficients(lambda l: l * 2, TOKENS, DT, "cpu")


def _shards(plan, w, rank, **kw) -> VocabShards:
    rows = shard_rows(plan, "output", V, rank)
    weight = None if rows is None else nn.Parameter(w[rows[0]:rows[1]].clone())
    return VocabShards(plan=plan, rank=rank, vocab_size=V, head_weight=weight,
                       hidden_meta=TensorMeta(shape=(2, TOKENS // 2, H), dtype=DT), **kw)


def _reference(x, w, t, coef):
    """Per-token cross-entropy weighted by coef: (its sum, d/dx, d/dw)."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    per_token = F.cross_entropy(x.reshape(-1, H) @ w.t(), t.clamp(0), reduction="none")
    per_token = torch.where((t >= 0) & (t < V), per_token, torch.zeros_like(per_token))
    loss = (coef * per_token).sum()
    loss.backward()
    return loss.detach(), x.grad, w.grad, per_token.detach()


@pytest.mark.parametrize("sink", ["autograd", "direct"])
def test_two_head_shards_give_the_unsplit_cross_entropy_and_its_gradients(sink):
    plan = _plan()
    x, w, t = _data()
    t[2] = -100  # a token without loss
    valid = (t >= 0).to(DT)
    coef = loss_coefficients(lambda l: (l * valid).sum() / valid.sum() / 2, TOKENS, DT, "cpu")
    shards = [_shards(plan, w, r, grad_sink=sink) for r in (0, 1)]
    fired = []
    for s in shards:
        s.head_weight.register_post_accumulate_grad_hook(lambda p, r=s.rank: fired.append(r))
    given = HeadInput(hidden=x, targets=t, coef=coef)
    stats = [s.head_forward(1, 0, tuple(given)) for s in shards]  # received: the 3-tuple
    assert stats[0].shape == (TOKENS, 3) and stats[0].dtype == DT
    out = [s.head_backward_input(1, 0, [stats[1 - s.rank]]) for s in shards]
    for s in shards:
        s.head_backward_weight(1, 0)
    loss, dx, dw, per_token = _reference(x, w, t, coef)
    for _, reported in out:  # every shard reports the same loss (default: sum of coef x per-token loss)
        torch.testing.assert_close(reported.loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[0][0] + out[1][0], dx, rtol=1e-12, atol=1e-15)
    for s in shards:
        lo, hi = s.head_rows
        torch.testing.assert_close(s.head_weight.grad, dw[lo:hi], rtol=1e-12, atol=1e-15)
    # "autograd" runs the weight's AccumulateGrad (a framework's hooks see shard gradients), "direct" does not
    assert fired == ([0, 1] if sink == "autograd" else [])
    assert all(s.pending() == 0 for s in shards)
    # a 1% scale error in the coefficients fails at this tolerance
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out[0][0] * 1.01 + out[1][0], dx, rtol=1e-10, atol=0)


def test_a_custom_sink_and_report_get_the_shard_gradient_and_per_token_losses():
    plan = _plan(devices=(1,), shares=(1.0,))
    x, w, t = _data(1)
    coef = torch.full((TOKENS,), 0.5, dtype=DT)
    got, reports = [], []
    s = _shards(plan, w, 1, grad_sink=lambda p, g: got.append(g),
                report=lambda mb, l, c: reports.append((mb, l, c)) or "report")
    s.head_forward(1, 0, HeadInput(x, t, coef))
    partial, rep = s.head_backward_input(1, 0, ())
    s.head_backward_weight(1, 0)
    loss, dx, dw, per_token = _reference(x, w, t, coef)
    assert rep == "report" and reports[0][0] == 0
    torch.testing.assert_close(reports[0][1], per_token, rtol=1e-12, atol=0)
    torch.testing.assert_close(partial, dx, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got[0], dw, rtol=1e-12, atol=1e-15)
    assert s.head_weight.grad is None  # the sink took it


def test_split_metas_declare_the_head_input_with_its_loss_terms():
    s = _shards(_plan(), _data()[1], 0)
    meta = s.split_meta("head-input")
    assert isinstance(meta, HeadInput) and meta == head_input_meta(s.hidden_meta)
    assert meta.targets == TensorMeta(shape=(TOKENS,), dtype=torch.int64, requires_grad=False)
    assert meta.coef.shape == (TOKENS,) and meta.coef.dtype == DT
    bf16 = head_input_meta(TensorMeta(shape=(4, 2, H), dtype=torch.bfloat16))
    assert bf16.coef.dtype == torch.float32 and bf16.targets.shape == (8,)
    assert s.split_meta("stats") == TensorMeta(shape=(TOKENS, 3), dtype=DT, requires_grad=False)
    # the simulator charges the head input its loss terms: 12 bytes a token, as the statistics' tokens
    assert loss_terms_bytes(s_split(_plan())) == 12 * TOKENS


def s_split(plan):
    return next(sp for sp in plan.splits if sp.layer == 3)


@pytest.mark.parametrize("embedding", [False, True])
def test_forward_plans_of_split_plans_run_forwards_heads_losses_and_lookups_only(embedding):
    plan = _plan(embedding=embedding)
    check_runnable(plan)
    for m in (None, 3):
        ev = forward_plan(plan, m)
        assert is_forward_only(ev) and not is_forward_only(plan)
        assert {a.kind for row in ev.schedule for a in row} == (
            {Kind.F, Kind.H, Kind.J} | ({Kind.E} if embedding else set()))
        assert FORWARD_KINDS >= {a.kind for row in ev.schedule for a in row}
        check_runnable(ev)  # complete as an evaluation plan, and deadlock-free
        whats = {msg.what for _, msg in split_messages(ev)}
        assert whats == {"head-input"} | ({"embedding-partial"} if embedding else set())
        # the statistics: one all-gather per micro-batch over the head's shards, not messages
        gathers = [(g.microbatch, g.devices) for g in stats_gathers(ev)]
        assert gathers == [(mb, (0, 1)) for mb in range(ev.num_microbatches)]
        low = lowered_plan(ev, 0)
        assert low.forward_only and not low.last_shard_backward
    train = lowered_plan(plan, 0)  # the rank's last K and G are told last_backward
    steps = train.program.steps
    last_k = max(i for i, st in enumerate(steps) if st.action.kind is Kind.K)
    assert train.is_last_backward(last_k, steps[last_k].action)


def _tp_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from octopipe_plugin.executor.launch import init_gloo

    init_gloo(rank, world, port, timeout_s=60)
    plan = _plan()
    x, w, t = _data(2)
    coef = loss_coefficients(lambda l: l.mean(), TOKENS, DT, "cpu")
    tp = TensorParallel.over(dist.group.WORLD)
    shards = []
    for r in (0, 1):  # both head shards of the plan live here, each cut in two by tensor parallelism
        lo, hi = shard_rows(plan, "output", V, r)
        mid = (lo + hi) // 2
        mine = (lo, mid) if rank == 0 else (mid, hi)
        shards.append(VocabShards(plan=plan, rank=r, vocab_size=V, head_weight=nn.Parameter(w[mine[0]:mine[1]].clone()),
                                  head_rows=mine, tp=tp, grad_sink="direct"))
    stats = [s.head_forward(1, 0, HeadInput(x, t, coef)) for s in shards]
    out = [s.head_backward_input(1, 0, [stats[1 - i]]) for i, s in enumerate(shards)]
    for s in shards:
        s.head_backward_weight(1, 0)
    loss, dx, dw, _ = _reference(x, w, t, coef)
    for partial, rep in out:
        torch.testing.assert_close(rep.loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[0][0] + out[1][0], dx, rtol=1e-12, atol=1e-15)
    for s in shards:
        lo, hi = s.head_rows
        torch.testing.assert_close(s.head_weight.grad, dw[lo:hi], rtol=1e-12, atol=1e-15)
    # sequence parallelism: each rank hands over its block of the tokens, gets its block of the input gradient
    sp = TensorParallel.over(dist.group.WORLD, sequence_parallel=True)
    blk = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
    shards = []
    for r in (0, 1):
        lo, hi = shard_rows(plan, "output", V, r)
        mid = (lo + hi) // 2
        mine = (lo, mid) if rank == 0 else (mid, hi)
        shards.append(VocabShards(plan=plan, rank=r, vocab_size=V, head_weight=nn.Parameter(w[mine[0]:mine[1]].clone()),
                                  head_rows=mine, tp=sp, grad_sink="direct"))
    rows = x.reshape(-1, H)
    stats = [s.head_forward(1, 0, HeadInput(rows[blk], t[blk], coef[blk])) for s in shards]
    assert stats[0].shape == (TOKENS // 2, 3)  # the statistics messages carry the rank's block
    out = [s.head_backward_input(1, 0, [stats[1 - i]]) for i, s in enumerate(shards)]
    for s in shards:
        s.head_backward_weight(1, 0)
    for partial, rep in out:
        torch.testing.assert_close(rep.loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[0][0] + out[1][0], dx.reshape(-1, H)[blk], rtol=1e-12, atol=1e-15)
    for s in shards:
        lo, hi = s.head_rows
        torch.testing.assert_close(s.head_weight.grad, dw[lo:hi], rtol=1e-12, atol=1e-15)
    # the embedding's shard, cut the same way: its lookup summed over the slices, each slice's rows' gradient
    emb_plan = _plan(embedding=True)
    tokens = t.reshape(2, TOKENS // 2)
    lo, hi = shard_rows(emb_plan, "input", V, 0)
    mid = (lo + hi) // 2
    mine = (lo, mid) if rank == 0 else (mid, hi)
    head = shard_rows(emb_plan, "output", V, 0)  # (the plan splits its head too: unused here)
    emb = VocabShards(plan=emb_plan, rank=0, vocab_size=V, embedding_weight=nn.Parameter(w[mine[0]:mine[1]].clone()),
                      embedding_rows=mine, head_weight=nn.Parameter(w[head[0]:head[1]].clone()),
                      tokens=lambda mb: tokens, tp=tp, grad_sink="direct")
    part = emb.embedding_forward(0, 0)
    held = (tokens >= lo) & (tokens < hi)
    torch.testing.assert_close(part, torch.where(held[..., None], w[tokens.clamp(0)], torch.zeros(())), rtol=0, atol=0)
    g = torch.randn(2, TOKENS // 2, H, generator=torch.Generator().manual_seed(3), dtype=DT)
    emb.embedding_backward(0, 0, g)
    want = torch.zeros_like(w).index_add_(0, tokens.reshape(-1), g.reshape(-1, H))
    torch.testing.assert_close(emb.embedding_weight.grad, want[mine[0]:mine[1]], rtol=1e-12, atol=1e-15)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tensor_parallel_slices_of_a_shard_reduce_statistics_then_shards_and_all_reduce_the_partial():
    """Also under sequence parallelism (each rank a block of the tokens), and the embedding's shard."""
    from octopipe_plugin.executor.launch import spawn

    spawn(_tp_worker, 2)


def test_bf16_shards_compute_statistics_in_float32_and_give_gradients_in_the_weight_dtype():
    plan = _plan()
    x, w, t = _data(4)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    coef = loss_coefficients(lambda l: l.mean(), TOKENS, torch.float32, "cpu")
    shards = []
    for r in (0, 1):
        lo, hi = shard_rows(plan, "output", V, r)
        shards.append(VocabShards(plan=plan, rank=r, vocab_size=V, head_weight=nn.Parameter(wb[lo:hi].clone()),
                                  hidden_meta=TensorMeta(shape=tuple(x.shape), dtype=torch.bfloat16)))
    assert shards[0].split_meta("stats").dtype == torch.float32
    stats = [s.head_forward(1, 0, HeadInput(xb, t, coef)) for s in shards]
    assert stats[0].dtype == torch.float32
    out = [s.head_backward_input(1, 0, [stats[1 - i]]) for i, s in enumerate(shards)]
    for s in shards:
        s.head_backward_weight(1, 0)
    # the unsplit bf16 head: logits in bf16, cross-entropy in float32 (as Megatron's and DeepSpeed's loss do)
    xr, wr = xb.clone().requires_grad_(True), wb.clone().requires_grad_(True)
    ref = F.cross_entropy((xr.reshape(-1, H) @ wr.t()).float(), t)
    ref.backward()
    assert out[0][0].dtype == torch.bfloat16 and shards[0].head_weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out[0][1].loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((out[0][0].float() + out[1][0].float()), xr.grad.float(), rtol=2e-2, atol=2e-3)
    for s in shards:
        lo, hi = s.head_rows
        torch.testing.assert_close(s.head_weight.grad.float(), wr.grad[lo:hi].float(), rtol=2e-2, atol=2e-3)


def test_an_evaluation_of_a_split_plan_refuses_shards_without_forward_only_in_one_line():
    from octopipe_plugin.executor import RunnerInterfaceError, TorchStages, check_runner
    from octopipe_plugin.executor.interface import check_evaluation

    class OldShards(VocabShards):
        def head_forward(self, stage, mb, hidden):  # a stand-in written before evaluation steps existed
            return super().head_forward(stage, mb, hidden)

    plan = _plan()
    runner = TorchStages(modules={}, num_stages=2, num_microbatches=1, shards=_shards(plan, _data()[1], 0))
    binding = check_runner(runner, {Kind.F, Kind.B, Kind.H, Kind.J, Kind.K})
    check_evaluation(runner, binding, {Kind.F, Kind.H, Kind.J})  # VocabShards takes it
    rows = shard_rows(plan, "output", V, 0)
    runner.shards = OldShards(plan=plan, rank=0, vocab_size=V,
                              head_weight=nn.Parameter(_data()[1][rows[0]:rows[1]].clone()))
    with pytest.raises(RunnerInterfaceError, match=r"OldShards.head_forward\(\) lacks the keyword forward_only=") as e:
        check_evaluation(runner, binding, {Kind.F, Kind.H, Kind.J})
    assert "\n" not in str(e.value)
