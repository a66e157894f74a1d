"""Exactness check of plans with split layers: the toy language model run by the executor, against one process.

Every rank builds the toy model (testing/toy.py, `vocab` set) with the same seed, runs its stages
without the split layers and its shards of them (`executor.vocab_shard.SplitTorchStages`), and
compares the loss (on every head shard, or on the last stage) and every gradient it holds, each
shard's rows against the same rows of the reference's weight gradient, with a float64 single-process
reference step; then two evaluation steps (the plan's forwards, and one micro-batch more) against the
reference's losses. Every K and G must run inside the runner's `_shard_grad` hook, told `last_backward`
on the rank's last of each kind. Plans come from the schedule generators or the split-aware tuner,
their shard actions placed by `tuner.split_sched.insert_shards` (irregular per-device orders).

A toy with MTP depths ("mtp" layers before the head) runs the head over 1 + depth hidden states
(`SplitTorchStages(mtp_depth=)`); its check also computes the reference with one MTP coefficient
1% off and requires every compared loss and gradient to miss that one (the tolerance would catch
such an error in the coefficient).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.interface import TensorMeta
from ..executor.launch import init_gloo
from ..executor.vocab_shard import SplitTorchStages, shard_rows
from ..formats import Layer, Model, plan_from_dict
from ..formats.splits import SplitLayer
from .toy import ToySpec, boundary_metas, build_layers, loss_fn, microbatch, mtp_coefficients, reference_step

KINDS = {"embed": "embedding", "lm": "lm_head", "mtp": "mtp"}  # the toy's layer names -> the cost model's kinds


def cost_model(spec: ToySpec, head_ms: float = 3.0) -> Model:
    """A cost model of the toy's layers (heavy head, light embedding), for the tuner and the shard inserter."""
    def ms(kind: str, i: int) -> float:
        return head_ms if kind == "lm" else 0.2 if kind == "embed" else 1.0 + (i % 3) * 0.3

    return Model(name="toy-lm", layers=tuple(
        Layer(name=f"l{i}", kind=KINDS.get(k, "dense"), fwd_ms=ms(k, i), bwd_ms=ms(k, i), wgrad_ms=ms(k, i),
              state_bytes=1 << 10, activation_bytes=1 << 10, output_bytes=0) for i, k in enumerate(spec.layers)))


def with_shards(spec: ToySpec, plan, splits) -> "object":
    """`plan` (stage actions only) with `splits` set and every shard action placed into its orders."""
    from ..executor.dryrun import zero_cost_cluster
    from ..tuner.split_sched import ShardPolicy, insert_shards

    cluster = replace(zero_cost_cluster(plan.num_devices), memory_bytes=1 << 40)
    out = insert_shards(cost_model(spec), cluster, replace(plan, splits=tuple(splits)), ShardPolicy())
    if out is None:
        raise AssertionError(f"could not place the shard actions of {splits} into the plan")
    return out


def head_split(spec: ToySpec, devices, shares=None) -> SplitLayer:
    """The toy's LM head split over `devices` (equal shares unless given)."""
    shares = tuple(shares) if shares is not None else tuple(1.0 / len(devices) for _ in devices)
    return SplitLayer(layer=len(spec.layers) - 1, devices=tuple(devices), shares=shares, stats_bytes=0)


def embedding_split(devices, shares=None) -> SplitLayer:
    """The toy's embedding (layer 0) split over `devices`."""
    shares = tuple(shares) if shares is not None else tuple(1.0 / len(devices) for _ in devices)
    return SplitLayer(layer=0, devices=tuple(devices), shares=shares)


class RecordingSplitStages(SplitTorchStages):
    """SplitTorchStages that records every shard weight-gradient action's hook call: (kind, last_backward), and, in
    training steps, the statistics each H made and each J was given (mb -> tensor / tuple of the peers')."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.shard_grads: list = []
        self.stats_made: dict = {}
        self.stats_taken: dict = {}

    def head_forward(self, stage: int, mb: int, hidden, *, forward_only: bool = False):
        out = super().head_forward(stage, mb, hidden, forward_only=forward_only)
        if not forward_only:
            self.stats_made[mb] = out.clone()
        return out

    def head_backward_input(self, stage: int, mb: int, peer_stats, *, forward_only: bool = False):
        if not forward_only:
            self.stats_taken[mb] = tuple(p.clone() for p in peer_stats)
        return super().head_backward_input(stage, mb, peer_stats, forward_only=forward_only)

    def _shard_grad(self, stage: int, kind, last_backward: bool):
        self.shard_grads.append((kind, last_backward))
        return super()._shard_grad(stage, kind, last_backward)


def stage_metas(spec: ToySpec, plan) -> tuple:
    """Each stage's output meta: an activation, or after MTP layers the tuple of the main and each depth's states
    (`boundary_metas` without MTP)."""
    metas = list(boundary_metas(spec, plan.num_stages))
    act = TensorMeta(shape=(spec.batch, spec.seq, spec.hidden), dtype=spec.dtype)
    for s in range(plan.num_stages - 1):
        depth = spec.layers[:plan.stages[s].end].count("mtp")
        if depth:
            metas[s] = tuple(act for _ in range(1 + depth))
    return tuple(metas)


def split_runner(spec: ToySpec, layers: nn.ModuleList, plan, rank: int, learn: bool = False) -> SplitTorchStages:
    """SplitTorchStages of `rank`'s stages (split layers taken out) and shards of `plan` over the toy's layers
    (`learn`: the head's input undeclared, learned each step by the transport's handshake)."""
    split = {sp.layer for sp in plan.splits}
    mods = {s: nn.Sequential(*[layers[i] for i in range(plan.stages[s].start, plan.stages[s].end) if i not in split])
            for s in plan.stages_of(rank)}
    last = len(spec.layers) - 1
    head_rows = shard_rows(plan, "output", spec.vocab, rank)
    emb_rows = shard_rows(plan, "input", spec.vocab, rank)
    head_w = emb_w = None
    if emb_rows is not None:
        emb_w = nn.Parameter(layers[0].weight[emb_rows[0]:emb_rows[1]].detach().clone())
    if head_rows is not None:
        head_w = (emb_w if spec.tied and emb_rows == head_rows else
                  nn.Parameter(layers[last].weight[head_rows[0]:head_rows[1]].detach().clone()))
    act = TensorMeta(shape=(spec.batch, spec.seq, spec.hidden), dtype=spec.dtype)
    return RecordingSplitStages(
        plan=plan, rank=rank, modules=mods, num_microbatches=plan.num_microbatches, vocab_size=spec.vocab,
        hidden_meta=None if learn else act, embedding_meta=act, head_weight=head_w, embedding_weight=emb_w,
        tokens=lambda mb: microbatch(spec, mb)[0], targets=lambda mb: microbatch(spec, mb)[1],
        metas=stage_metas(spec, plan), load_input=lambda mb: microbatch(spec, mb)[0],
        loss_fn=loss_fn(spec), mtp_depth=spec.mtp_depth, mtp_loss_scaling_factor=spec.mtp_loss_scale)


def check_split_plan(rank: int, plan, spec: ToySpec, timeout_s: float = 60.0, tags: bool = True,
                     exchange: str | None = None, learn: bool = False) -> None:
    """Run `plan` on this rank; assert its loss and every gradient it holds equal the reference (float64)."""
    layers = build_layers(spec)
    runner = split_runner(spec, layers, plan, rank, learn)
    opts = ExecutorOptions(timeout_s=timeout_s, tags=tags, exchange=exchange)
    executor = PipelineExecutor(plan, runner, options=opts)
    result = executor.run_step()
    _check_sends(executor, plan, rank, f"rank {rank}, plan {plan.meta.get('label', '')}")
    _check_gathered(runner, plan, rank, f"rank {rank}, plan {plan.meta.get('label', '')}")
    ref = build_layers(spec)
    ref_loss = reference_step(spec, ref, plan.num_microbatches)
    off = off_loss = None
    if spec.mtp_depth:  # the reference with the last MTP depth's coefficient 1% off: every comparison must miss it
        coefs = list(mtp_coefficients(spec))
        coefs[-1] *= 1.01
        off = build_layers(spec)
        off_loss = reference_step(spec, off, plan.num_microbatches, tuple(coefs))
    label = (f"rank {rank}, plan {plan.meta.get('label', '')}, {'tagged' if tags else 'untagged'}, {exchange}"
             f"{', head input learned' if learn else ''}")
    reports = runner.head_rows is not None if runner.head_split else plan.num_stages - 1 in plan.stages_of(rank)
    if reports:
        _same(result.loss, ref_loss, f"{label}: loss", off_loss)
    elif result.loss is not None:
        raise AssertionError(f"{label}: a rank without the loss reported one")
    split = {sp.layer for sp in plan.splits}
    for s in plan.stages_of(rank):
        for idx in range(plan.stages[s].start, plan.stages[s].end):
            if idx in split:
                continue
            wrong = off[idx].parameters() if off is not None else (None for _ in ref[idx].parameters())
            for (name, p), q, o in zip(layers[idx].named_parameters(), ref[idx].parameters(), wrong):
                _same(p.grad, q.grad, f"{label}: layer {idx} {name}", None if o is None else o.grad)
    last = len(spec.layers) - 1
    for rows, weight, idx in ((runner.head_rows, runner.head_weight, last),
                              (runner.embedding_rows, runner.embedding_weight, 0)):
        if rows is not None:
            _same(weight.grad, ref[idx].weight.grad[rows[0]:rows[1]], f"{label}: layer {idx} shard rows {rows}",
                  None if off is None else off[idx].weight.grad[rows[0]:rows[1]])
    if runner.pending():
        raise AssertionError(f"{label}: state of {runner.pending()} (stage or shard, micro-batch) pairs not freed")
    _check_shard_hooks(runner, plan, rank, label)
    _check_evaluation(executor, runner, spec, ref, reports, label)


def _check_sends(executor, plan, rank: int, label: str) -> None:
    """The step gave its core up once per action that sent (not per message: a shard's fan-out sends many), and on
    gloo held to its end only the sends no later receive showed consumed (issue 36), split hand-overs included:
    a send to P consumed at P's position c is dropped by a receive from P, in a later action, made after c."""
    from ..schedules.messages import device_positions, plan_messages
    from ..schedules.split_messages import split_messages

    tp = executor.transport
    if tp.exchange != "message" or plan.pairs:
        return
    pos = device_positions(plan)
    msgs = [m for ms in plan_messages(plan).values() for m in ms] + [m for _, m in split_messages(plan)]
    sent = [m for m in msgs if m.src == rank]
    got = [m for m in msgs if m.dst == rank]
    senders = {pos[(rank, m.producer)] for m in sent}
    if tp.yields != (len(senders) if tp.give_way else 0):
        raise AssertionError(f"{label}: {tp.yields} yields after sends, {len(senders)} actions sent")
    kept = sum(not any(g.src == s.dst and pos[(rank, g.consumer)] > pos[(rank, s.producer)]
                       and pos[(s.dst, g.producer)] > pos[(s.dst, s.consumer)] for g in got) for s in sent)
    if tp.left_at_finish != kept:
        raise AssertionError(f"{label}: {tp.left_at_finish} sends held to the step's end, expected {kept} of "
                             f"{len(sent)}")


def _check_gathered(runner, plan, rank: int, label: str) -> None:
    """Every J was given, by the statistics' all-gather, exactly what each other shard's H made (bit for bit), in
    shard-device order: what their point-to-point messages gave before (issue 36), so the loss and every gradient
    are the same numbers. Collective over the world (every rank checks the same plans in turn)."""
    from ..schedules.split_messages import stats_gathers

    gathers = stats_gathers(plan)
    if not gathers:
        return
    made: list = [None] * dist.get_world_size()
    dist.all_gather_object(made, runner.stats_made)
    devices = gathers[0].devices
    if rank not in devices:
        return
    if sorted(runner.stats_taken) != list(range(plan.num_microbatches)):
        raise AssertionError(f"{label}: J ran for micro-batches {sorted(runner.stats_taken)}")
    for mb, got in runner.stats_taken.items():
        want = [made[e][mb] for e in devices if e != rank]
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"{label}: the J of micro-batch {mb} was given other statistics than the shards' H made "
                                 f"(devices {[e for e in devices if e != rank]}, in that order)")


def _check_shard_hooks(runner, plan, rank: int, label: str) -> None:
    """Every K and G ran inside the runner's `_shard_grad`, `last_backward` on the rank's last of each kind only."""
    from ..actions import Kind

    for kind in (Kind.K, Kind.G):
        ran = [a for a in plan.schedule[rank] if a.kind is kind]
        calls = [last for k, last in runner.shard_grads if k is kind]
        if len(calls) != len(ran) or (ran and calls != [False] * (len(ran) - 1) + [True]):
            raise AssertionError(f"{label}: {kind.value} ran {len(ran)} times, its hook saw last_backward={calls}")


def _check_evaluation(executor, runner, spec: ToySpec, ref, reports: bool, label: str) -> None:
    """Evaluation steps (the plan's forwards, and another micro-batch count) report the reference's losses, keep
    nothing and leave every gradient as the training step made it."""
    plan = executor.plan
    held = [p.grad.clone() for p in _grads(runner)]
    for m in (plan.num_microbatches, plan.num_microbatches + 1):
        ev = executor.run_step(forward_only=True, num_microbatches=m)
        if reports:
            want = reference_loss(spec, ref, m, plan.num_microbatches)
            torch.testing.assert_close(ev.loss, want, rtol=1e-10, atol=1e-12, msg=f"{label}: evaluation loss, m={m}")
        elif ev.loss is not None:
            raise AssertionError(f"{label}: a rank without the loss reported one in evaluation")
        if runner.pending():
            raise AssertionError(f"{label}: evaluation kept the state of {runner.pending()} pairs")
    for before, p in zip(held, _grads(runner)):
        if not torch.equal(before, p.grad):
            raise AssertionError(f"{label}: an evaluation step changed a gradient")


def _grads(runner) -> list:
    """The parameters with a gradient this rank holds (its stages' and its shards')."""
    params = [p for m in runner.modules.values() for p in m.parameters()]
    params += [w for w in (runner.head_weight, runner.embedding_weight) if w is not None]
    return [p for p in {id(p): p for p in params}.values() if p.grad is not None]


def reference_loss(spec: ToySpec, layers: nn.ModuleList, num_microbatches: int, train_microbatches: int):
    """The single-process loss of an evaluation over `num_microbatches`, each scaled as in training
    (/ `train_microbatches`, TorchStages' default `scale_loss`)."""
    total = torch.zeros((), dtype=spec.dtype)
    with torch.no_grad():
        for mb in range(num_microbatches):
            x = microbatch(spec, mb)[0]
            for layer in layers:
                x = layer(x)
            total += loss_fn(spec)(x, mb) / train_microbatches
    return total


def _same(got, want, label: str, wrong=None) -> None:
    """`got` equals `want` at rtol 1e-10; a 1% scale error of it, and `wrong` (the reference with an MTP coefficient
    1% off), would fail."""
    if got is None:
        raise AssertionError(f"{label}: no gradient")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=label)
    if want.abs().max() > 1e-6 and torch.allclose(got * 1.01, want, rtol=1e-10, atol=1e-12):
        raise AssertionError(f"{label}: the tolerance would not catch a 1% scale error")
    if wrong is not None and torch.allclose(got, wrong, rtol=1e-10, atol=1e-12):
        raise AssertionError(f"{label}: the tolerance would not catch a 1% error in an MTP depth's loss coefficient")


def check_split_plans_worker(rank: int, world: int, port: int, docs: list[dict], specs: list[ToySpec]) -> None:
    """Spawn target: join the group, check every (plan document, spec) in turn (every other one untagged, every
    third one with the batched exchange, every fourth from the second on with the head input learned)."""
    init_gloo(rank, world, port, timeout_s=60)
    for i, (doc, spec) in enumerate(zip(docs, specs)):
        check_split_plan(rank, plan_from_dict(doc), spec, tags=i % 2 == 0, exchange="batched" if i % 3 == 2 else None,
                         learn=i % 4 == 1)
    dist.destroy_process_group()
