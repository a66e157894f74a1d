"""Vocabulary shards of a split LM head and embedding (docs/formats.md, "Split layers"), in real tensors.

`VocabShards` is one rank's shard math, framework-neutral (plain torch): a runner built on
`StageCore` takes it as `shards=` and the executor's shard actions run here. Head shard on the
global rows [lo, hi) of the head weight (`row_range`, or the rows a tensor-parallel rank holds):

- H: from the owner's `HeadInput` (hidden X, targets, coefficients), logits Z = X W[lo:hi]^T and
  per token the local max, the sum of exponentials and the target logit (0 where the target is
  not in its rows), reduced over tensor parallelism first, then sent to every other shard;
- J: with every shard's statistics, the global max M, sum S and target logit T give the per-token
  loss log S + M - T (cross-entropy, exactly the unsplit model's), reported through `report`;
  the softmax gradient dZ = coef (exp(Z - M) / S - onehot) gives the partial input gradient
  dZ W[lo:hi] (all-reduced over tensor parallelism, as ColumnParallelLinear's backward), which
  goes to the owner, whose backward sums them as the head's input gradient;
- K: the rows' weight gradient dZ^T X, deferred like W.

Embedding shard: E looks up the tokens that fall in its rows (zeros elsewhere; summed over
tensor parallelism), summed into stage 0's input; G adds stage 0's input gradient into its rows.
A tied embedding and head over the same devices and shares use one shard weight per device: both
gradients accumulate into it. Shard gradients reach the weight through `grad_sink`: "autograd"
(the weight's AccumulateGrad runs, so grad-accumulator hooks fire: Megatron DDP's main_grad,
DeepSpeed's), "direct" (added into `.grad`, no hooks) or a callable `sink(weight, grad)`.

Multi-token prediction (`heads` = 1 + the MTP depth, `formats.model.head_inputs`): the head's one
weight serves every hidden state. The owner's `HeadInput` holds them concatenated along dim 0
(`head_input.concat_heads`: head-major rows, the targets and coefficients alike), so H, J and K run
the one-head math above over all the rows at once: per hidden state and token its statistics, its
per-token loss (each head's loss coefficients in `coef`: 1 for the main head, the MTP loss scaling
factor / depth for each depth), its partial input gradient (all of them in the one partial message
to the owner, which splits it back into the states) and its part of the rows' weight gradient.

Statistics, coefficients and the softmax gradient are float32 (float64 for float64 activations),
as Megatron's vocab-parallel cross-entropy computes in float32.

`SplitTorchStages` is the plain-module runner: TorchStages for the stages, a VocabShards for the
shards, and a cross-entropy loss rule (mean or sum over the targets, then `scale_loss`; with MTP
depths the main loss plus each depth's times its coefficient, as Megatron's `process_mtp_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..formats.splits import row_range, side_of
from .head_input import (
    as_head_input, coef_dtype, concat_heads, head_input_meta, heads_meta, mtp_loss_scales, mtp_targets, stats_meta,
)
from .interface import LossOutput, TensorMeta
from .split_backward import accumulate_grad, grad_acc
from .torch_stage import TorchStages

REDUCTIONS = ("mean", "sum")
SHARD_SINKS = ("autograd", "direct")


def shard_rows(plan, side: str, num_rows: int, rank: int) -> tuple[int, int] | None:
    """Rows [lo, hi) of the split layer of `side` ("output": head, "input": embedding) that `rank` holds, or None."""
    n = plan.stages[-1].end
    for sp in plan.splits:
        if side_of(sp, n) == side:
            return row_range(sp, num_rows, rank)
    return None


def split_sides(plan) -> tuple[bool, bool]:
    """(the plan splits its LM head, the plan splits its embedding)."""
    n = plan.stages[-1].end
    sides = {side_of(sp, n) for sp in plan.splits}
    return "output" in sides, "input" in sides


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallel:
    """Reductions over the tensor-parallel ranks of one shard (each holding a slice of the shard's rows):
    `all_reduce(tensor, op)` in place, op "max" or "sum"; every rank of the group calls it in the same order.

    Sequence parallelism (`all_gather` given): each rank's head input holds its block of the tokens
    (rank `rank` of the group, blocks in rank order along the rows of hidden.reshape(-1, h), as
    Megatron's sequence-parallel hidden states [s/tp, b, h]); H gathers every block (the rank's
    vocabulary slice needs every token), the statistics messages carry the rank's own block, J
    gathers the global statistics and `reduce_scatter` gives each rank its block of the partial.
    `all_gather(t)` -> the ranks' `t` concatenated along dim 0; `reduce_scatter(t)` -> this rank's
    block of dim 0 of the sum over ranks.
    """

    all_reduce: Callable[[torch.Tensor, str], None]
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce_scatter: Callable[[torch.Tensor], torch.Tensor] | None = None
    rank: int = 0

    @property
    def sequence_parallel(self) -> bool:
        """Whether each rank holds a block of the tokens (module docstring)."""
        return self.all_gather is not None

    @staticmethod
    def over(group, *, sequence_parallel: bool = False) -> "TensorParallel":
        """The reductions over a torch.distributed process group (gloo, which has no reduce-scatter, sums whole
        and keeps its block)."""
        import torch.distributed as dist

        ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
        size, rank = dist.get_world_size(group), dist.get_rank(group)

        def all_reduce(t: torch.Tensor, op: str) -> None:
            dist.all_reduce(t, op=ops[op], group=group)

        if not sequence_parallel:
            return TensorParallel(all_reduce=all_reduce, rank=rank)

        def all_gather(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        def reduce_scatter(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            if dist.get_backend(group) == "gloo":
                dist.all_reduce(t, group=group)
                return t.chunk(size)[rank].clone()
            out = torch.empty((t.shape[0] // size, *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.reduce_scatter_tensor(out, t, group=group)
            return out

        return TensorParallel(all_reduce=all_reduce, all_gather=all_gather, reduce_scatter=reduce_scatter, rank=rank)


def default_report(mb: int, per_token: torch.Tensor, coef: torch.Tensor) -> LossOutput:
    """The loss a head shard reports by default: sum of coef x per-token loss (the backward's root)."""
    return LossOutput(loss=(coef * per_token).sum())


class VocabShards:
    """This rank's shards of `plan`'s split LM head and/or embedding (any rank of a split plan has one).

    - `vocab_size`: rows of the GLOBAL (possibly padded) vocabulary; targets outside [0, vocab_size)
      (e.g. -100) carry no loss;
    - `head_weight` / `embedding_weight`: this rank's rows of the weight ([rows, hidden]:
      `nn.Linear(hidden, vocab, bias=False).weight[lo:hi]`, `nn.Embedding(vocab, hidden).weight[lo:hi]`),
      the same Parameter for a tied pair; None where the rank holds no shard;
    - `head_rows` / `embedding_rows`: the global rows those weights hold (default: the plan's,
      `shard_rows`; with tensor parallelism pass this rank's slice);
    - `hidden_meta`: the head's input, one hidden state ([..., hidden]; None: the head's messages learn it each
      step from a handshake ahead of the owner's first head input to each shard); `embedding_meta`: the
      embedding's output (default `hidden_meta`);
    - `heads`: hidden states the head takes (1 + the MTP depth): the head's input is `heads` states of
      `hidden_meta` concatenated along dim 0 (module docstring); `report` then gets the per-token losses
      and coefficients of every head, head-major;
    - `tokens(mb)`: the micro-batch's token ids (on the weight's device), for the embedding's E;
    - `report(mb, per_token_losses, coef) -> LossOutput`: what J reports (default `default_report`);
    - `grad_sink`: where K and G put the weight gradients (module docstring);
    - `tp`: the tensor-parallel reductions (`TensorParallel`), None without tensor parallelism.
    """

    def __init__(self, *, plan, rank: int, vocab_size: int, head_weight: nn.Parameter | None = None,
                 embedding_weight: nn.Parameter | None = None, head_rows: tuple[int, int] | None = None,
                 embedding_rows: tuple[int, int] | None = None, hidden_meta: TensorMeta | None = None,
                 embedding_meta: TensorMeta | None = None, tokens: Callable[[int], torch.Tensor] | None = None,
                 report: Callable | None = None, grad_sink: "str | Callable" = "autograd",
                 tp: TensorParallel | None = None, heads: int = 1):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"heads {heads!r}: expected an int >= 1 (1 + the model's MTP depth)")
        if isinstance(grad_sink, str) and grad_sink not in SHARD_SINKS:
            raise ValueError(f"grad_sink {grad_sink!r}: expected one of {', '.join(SHARD_SINKS)} or a callable "
                             f"sink(weight, grad)")
        self.rank = rank
        self.vocab_size = vocab_size
        self.heads = heads
        self.head_split, self.embedding_split = split_sides(plan)
        self.head_rows = head_rows if head_rows is not None else shard_rows(plan, "output", vocab_size, rank)
        self.embedding_rows = (embedding_rows if embedding_rows is not None
                               else shard_rows(plan, "input", vocab_size, rank))
        _check_rows("head_weight", head_weight, self.head_rows, rank)
        _check_rows("embedding_weight", embedding_weight, self.embedding_rows, rank)
        if head_weight is not None and head_weight is embedding_weight and self.head_rows != self.embedding_rows:
            raise ValueError(f"rank {rank}: a tied head and embedding share one shard weight, but this rank holds "
                             f"head rows {self.head_rows} and embedding rows {self.embedding_rows} (split both over "
                             f"the same devices in the same shares)")
        self.head_weight, self.embedding_weight = head_weight, embedding_weight
        self.tokens = tokens
        self.hidden_meta = hidden_meta
        self.embedding_meta = embedding_meta or hidden_meta
        self.report = report or default_report
        self.grad_sink = grad_sink
        self.tp = tp
        if tp is not None and tp.sequence_parallel and (tp.reduce_scatter is None or self.embedding_rows is not None):
            raise ValueError(f"rank {rank}: tp: sequence parallelism takes all_gather and reduce_scatter, and a head "
                             f"shard only (a split embedding under sequence parallelism is not supported: split the "
                             f"head only, or run without sequence parallelism)")
        self._head: dict[int, dict] = {}
        self._emb: dict[int, dict] = {}

    def split_meta(self, what: str):
        """Meta of a split hand-over: the head's input (a HeadInput of metas) and partials, the statistics, the
        embedding's partials and gradient."""
        m = self.hidden_meta if self.heads == 1 or self.hidden_meta is None else heads_meta(self.hidden_meta,
                                                                                              self.heads)
        if what == "head-input":
            return None if m is None else head_input_meta(m)  # None: learned per step by a handshake
        if what == "head-partial":
            return m
        if what == "stats":
            return None if m is None else stats_meta(m)
        return self.embedding_meta

    def pending(self) -> int:
        """Shard micro-batches whose state is still held (0 after a complete step)."""
        return len(self._head) + len(self._emb)

    def clear(self) -> None:
        """Forget every held state (a step abandoned)."""
        self._head.clear()
        self._emb.clear()

    # ----- head shard

    def head_forward(self, stage: int, mb: int, hidden, *, forward_only: bool = False) -> torch.Tensor:
        """H: the rows' logits, kept; their local max, sum of exponentials and target logit, handed on."""
        lo, hi = self.head_rows
        given = as_head_input(hidden)
        h = given.hidden
        if self.heads > 1:
            _check_heads(given, self.heads, self.rank, f"{stage}H{mb}")
        sdt = coef_dtype(h.dtype)
        sp = self.tp is not None and self.tp.sequence_parallel
        with torch.no_grad():
            x = h.detach().reshape(-1, h.shape[-1])
            t = given.targets.reshape(-1)
            coef = given.coef.reshape(-1).to(sdt)
            block = x.shape[0]  # this rank's tokens (all of them without sequence parallelism)
            if sp:  # every token, the tensor-parallel ranks' blocks in rank order
                x, t, coef = self.tp.all_gather(x), self.tp.all_gather(t), self.tp.all_gather(coef)
            z = (x @ self.head_weight.detach().t()).to(sdt)
            local_max = z.max(dim=1).values
            if self.tp is not None:
                self.tp.all_reduce(local_max, "max")  # the shard's max over its tensor-parallel slices
            sum_exp = torch.exp(z - local_max[:, None]).sum(dim=1)
            mine = (t >= lo) & (t < hi)
            target = torch.where(mine, z.gather(1, (t - lo).clamp(0, hi - lo - 1)[:, None])[:, 0],
                                 torch.zeros((), dtype=z.dtype, device=z.device))
            if self.tp is not None:
                self.tp.all_reduce(sum_exp, "sum")
                self.tp.all_reduce(target, "sum")
            stats = torch.stack([local_max, sum_exp, target], dim=1)
            if sp:  # the messages carry this rank's block; J gathers the global statistics
                stats = stats[self.tp.rank * block:(self.tp.rank + 1) * block].contiguous()
        self._head[mb] = {"x": x, "z": z, "stats": stats, "t": t, "coef": coef, "shape": tuple(h.shape)}
        return stats

    def head_backward_input(self, stage: int, mb: int, peer_stats, *,
                            forward_only: bool = False) -> tuple[torch.Tensor | None, LossOutput]:
        """J: per-token losses from every shard's statistics (reported), the rows' softmax gradient and the partial
        input gradient (None in an evaluation step, which keeps nothing)."""
        lo, hi = self.head_rows
        saved = self._head.pop(mb) if forward_only else self._head[mb]
        z, t, coef = saved.pop("z"), saved["t"], saved["coef"]
        with torch.no_grad():
            every = torch.stack([saved.pop("stats"), *peer_stats])  # [shards, tokens, 3]
            gmax = every[:, :, 0].max(dim=0).values
            total = (every[:, :, 1] * torch.exp(every[:, :, 0] - gmax)).sum(dim=0)
            target = every[:, :, 2].sum(dim=0)  # one shard holds each target, the others add 0
            if self.tp is not None and self.tp.sequence_parallel:  # this rank's block: gather every token's
                gmax, total, target = self.tp.all_gather(torch.stack([gmax, total, target], dim=1)).unbind(1)
            known = (t >= 0) & (t < self.vocab_size)
            per_token = torch.where(known, torch.log(total) + gmax - target, torch.zeros_like(total))
        out = self.report(mb, per_token, coef)
        if forward_only:
            return None, out
        w = self.head_weight
        with torch.no_grad():
            dz = torch.exp(z - gmax[:, None]) / total[:, None]
            mine = known & (t >= lo) & (t < hi)
            rows = torch.nonzero(mine)[:, 0]
            dz[rows, t[rows] - lo] -= 1.0
            dz *= coef[:, None]
            # in the weight's dtype from here, as the unsplit head's linear gets its logits' gradient (Megatron's
            # cross-entropy computes in float32, autograd casts back): half the kept bytes under bf16
            dz = dz.to(w.dtype)
            partial = dz @ w.detach()
            if self.tp is not None and self.tp.sequence_parallel:
                partial = self.tp.reduce_scatter(partial)  # the slices' parts summed, this rank's block of tokens
            elif self.tp is not None:
                self.tp.all_reduce(partial, "sum")  # every tensor-parallel slice's part of the input gradient
            partial = partial.reshape(saved["shape"])
        saved["dz"] = dz
        return partial, out

    def head_backward_weight(self, stage: int, mb: int) -> None:
        """K: the rows' weight gradient dZ^T X; frees the micro-batch's logits."""
        saved = self._head.pop(mb)
        w = self.head_weight
        with torch.no_grad():
            dw = saved["dz"].t() @ saved["x"].to(w.dtype)
        self._sink(w, dw)

    # ----- embedding shard

    def embedding_forward(self, stage: int, mb: int, *, forward_only: bool = False) -> torch.Tensor:
        """E: the embedding of the tokens in the shard's rows, zeros for every other token."""
        lo, hi = self.embedding_rows
        w = self.embedding_weight
        tok = self.tokens(mb)
        mine = (tok >= lo) & (tok < hi)
        with torch.no_grad():
            out = torch.zeros(tuple(tok.shape) + (w.shape[1],), dtype=w.dtype, device=w.device)
            out[mine] = w.detach()[tok[mine] - lo]
            if self.tp is not None:
                self.tp.all_reduce(out, "sum")  # the shard's tensor-parallel slices hold disjoint rows
        if not forward_only:
            self._emb[mb] = {"mine": mine, "rows": tok[mine] - lo}
        return out

    def embedding_backward(self, stage: int, mb: int, grad_output) -> None:
        """G: stage 0's input gradient added into the rows of the tokens the shard looked up."""
        saved = self._emb.pop(mb)
        w = self.embedding_weight
        with torch.no_grad():
            dw = torch.zeros_like(w).index_add_(0, saved["rows"], grad_output[saved["mine"]].to(w.dtype))
        self._sink(w, dw)

    def _sink(self, weight: nn.Parameter, grad: torch.Tensor) -> None:
        """A shard weight's gradient into the weight, as `grad_sink` says."""
        if callable(self.grad_sink):
            self.grad_sink(weight, grad)
        elif self.grad_sink == "direct":
            accumulate_grad(weight, grad)
        else:
            with torch.enable_grad():  # the weight's AccumulateGrad node is reached through a view made here
                torch.autograd.backward([torch.autograd.graph.GradientEdge(grad_acc(weight), 0)], [grad])


def _check_heads(given, heads: int, rank: int, action: str) -> None:
    """Refuse a head input that does not hold `heads` hidden states' rows (head-major) with a target and a
    coefficient each."""
    h = given.hidden
    rows = h.numel() // h.shape[-1] if h.dim() and h.shape[-1] else 0
    if h.dim() < 2 or h.shape[0] % heads or given.targets.numel() != rows or given.coef.numel() != rows:
        raise ValueError(f"rank {rank}: {action}: a head of {heads} hidden states (the main one and {heads - 1} MTP "
                         f"depth(s)) takes them concatenated along dim 0 with one target and one coefficient per "
                         f"row; got hidden {tuple(h.shape)}, {given.targets.numel()} targets, {given.coef.numel()} "
                         f"coefficients (fix: the owner hands over head_input.concat_heads(states) with "
                         f"mtp_targets)")


def _check_rows(name: str, weight, rows, rank: int) -> None:
    """Refuse a shard weight that does not hold exactly the rank's rows (or one given where none is held)."""
    if rows is None:
        if weight is not None:
            raise ValueError(f"rank {rank}: {name} given, but the plan puts no shard of that layer on this rank "
                             f"(pass None)")
        return
    lo, hi = rows
    if hi <= lo:
        raise ValueError(f"rank {rank}: its shard of {name} has no rows ([{lo}, {hi})): raise its share or the "
                         f"vocabulary size")
    if weight is None or weight.dim() != 2 or weight.shape[0] != hi - lo:
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"rank {rank}: {name}: expected this rank's rows [{lo}, {hi}) of the weight, "
                         f"[{hi - lo}, hidden], got {got} (fix: pass weight[lo:hi] from shard_rows)")


class SplitTorchStages(TorchStages):
    """StageRunner of a plan with a split LM head and/or embedding: TorchStages for the stages, a VocabShards
    (`self.shards`) for this rank's shards.

    - `modules[s]`: stage s's layers *without* the split ones (an owner holding only the split
      layer gets an identity); the owner of a split head returns the head's input from its layers;
    - `head_weight` / `embedding_weight`, `vocab_size`, `hidden_meta`, `embedding_meta`, `tokens`: VocabShards';
    - `targets(mb)`: the micro-batch's targets (on the model's device), read by the head's owner (its
      hand-over) and by every head shard's report;
    - the loss is cross-entropy over the targets that are not `ignore_index`, `reduction` "mean" (as
      `F.cross_entropy`) or "sum" (reported as num_tokens too), then `scale_loss(loss, num_tokens)`
      (default: / num_microbatches) and `grad_scale`, as in TorchStages;
    - `mtp_depth` d > 0 (multi-token prediction, DeepSeek-V3 Sec. 2.2): the head's owner gives its 1 + d hidden
      states (main first; a sequence of tensors, or them concatenated along dim 0) and the head runs over
      all of them (VocabShards `heads`). Depth j's targets are `targets(mb)` shifted j further along their
      last dim (`head_input.mtp_targets`, the last j positions without one) and the loss is Megatron's:
      main + sum_j `mtp_loss_scaling_factor` / d x CE_j, CE_j over depth j's own targets ("mean": their
      mean; "sum": their sum x the main head's count / theirs, as Megatron's per-token loss), reported
      with each head's cross-entropy in `logs` ("lm loss", "mtp_1 loss", ...);
    - the other keywords are TorchStages' (used for the stages' own layers; `grad_sink` for the shards too).
    """

    def __init__(self, *, plan, rank: int, modules: Mapping[int, nn.Module], num_microbatches: int,
                 vocab_size: int, hidden_meta: TensorMeta | None = None, embedding_meta: TensorMeta | None = None,
                 head_weight: nn.Parameter | None = None, embedding_weight: nn.Parameter | None = None,
                 tokens: Callable[[int], torch.Tensor] | None = None,
                 targets: Callable[[int], torch.Tensor] | None = None,
                 metas: Sequence | None = None, load_input: Callable | None = None, loss_fn: Callable | None = None,
                 call: Callable | None = None, scale_loss: Callable | None = None,
                 grad_scale: Callable | None = None, grad_sink: str = "autograd", reduction: str = "mean",
                 ignore_index: int = -100, mtp_depth: int = 0, mtp_loss_scaling_factor: float = 0.1):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r}: expected one of {', '.join(REDUCTIONS)}")
        if not isinstance(mtp_depth, int) or isinstance(mtp_depth, bool) or mtp_depth < 0:
            raise ValueError(f"mtp_depth {mtp_depth!r}: expected an int >= 0")
        self.rank = rank
        self.targets = targets
        self.reduction, self.ignore_index = reduction, ignore_index
        self.mtp_depth = mtp_depth
        self.loss_scales = mtp_loss_scales(mtp_depth, mtp_loss_scaling_factor) if mtp_depth else (1.0,)
        shards = VocabShards(plan=plan, rank=rank, vocab_size=vocab_size, head_weight=head_weight,
                             embedding_weight=embedding_weight, hidden_meta=hidden_meta,
                             embedding_meta=embedding_meta, tokens=tokens, report=self._report, grad_sink=grad_sink,
                             heads=1 + mtp_depth)
        super().__init__(modules=modules, num_stages=plan.num_stages, num_microbatches=num_microbatches, metas=metas,
                         load_input=load_input, loss_fn=loss_fn, call=call, scale_loss=scale_loss,
                         grad_scale=grad_scale, grad_sink=grad_sink, shards=shards,
                         head_loss=self._head_loss if shards.head_split else None)

    # the shard attributes tests and callers read
    head_rows = property(lambda self: self.shards.head_rows)
    embedding_rows = property(lambda self: self.shards.embedding_rows)
    head_weight = property(lambda self: self.shards.head_weight)
    embedding_weight = property(lambda self: self.shards.embedding_weight)

    def _valid(self, mb: int) -> tuple[torch.Tensor, int]:
        """(mask of the micro-batch's targets that count, their number)."""
        t = self.targets(mb).reshape(-1)
        valid = t != self.ignore_index
        return valid, int(valid.sum())

    def _module_output(self, stage: int, x, batch):
        """The stages' outputs as TorchStages gives them; with MTP the head owner's 1 + d hidden states as the
        head's one input (concatenated along dim 0: the partial's gradient reaches each state)."""
        out = super()._module_output(stage, x, batch)
        if self.mtp_depth and self.head_split and stage == self.num_stages - 1:
            if not isinstance(out, torch.Tensor) and len(out) != 1 + self.mtp_depth:
                raise ValueError(f"rank {self.rank}: the split head's owner (stage {stage}) gave {len(out)} hidden "
                                 f"states; a head with MTP depth {self.mtp_depth} takes {1 + self.mtp_depth} (the "
                                 f"main one, then each depth's)")
            out = concat_heads(out)
        return out

    def _mtp_terms(self, mb: int):
        """(targets of every head, head-major; per head its mask of the targets that count and their number)."""
        t = mtp_targets(self.targets(mb), self.mtp_depth, self.ignore_index)
        valid = (t != self.ignore_index).reshape(1 + self.mtp_depth, -1)
        return t, valid, [int(v.sum()) for v in valid]

    def _mtp_total(self, per_token: torch.Tensor, valid: torch.Tensor, counts: list) -> tuple:
        """(the micro-batch's loss over every head, each head's cross-entropy): main + coefficient x depth's."""
        losses = torch.where(valid, per_token.reshape(valid.shape),
                             torch.zeros((), dtype=per_token.dtype, device=per_token.device))
        mean = self.reduction == "mean"
        heads = [losses[0].sum() / counts[0] if mean else losses[0].sum()]
        total = heads[0]
        for j in range(1, 1 + self.mtp_depth):
            n = max(counts[j], 1)  # a depth without targets adds 0 (Megatron clamps its count)
            heads.append(losses[j].sum() / n)
            total = total + self.loss_scales[j] * (heads[j] if mean else losses[j].sum() * (counts[0] / n))
        return total, heads

    def _head_loss(self, mb: int, batch):
        """(targets, loss rule) of the owner's hand-over: the unsplit model's cross-entropy, then scale_loss and
        grad_scale, as a function of the per-token losses."""
        if self.mtp_depth:
            return self._mtp_head_loss(mb)
        valid, count = self._valid(mb)
        mean = self.reduction == "mean"

        def rule(per_token: torch.Tensor) -> torch.Tensor:
            loss = (per_token * valid).sum()
            scaled = self.scale_loss(loss / count if mean else loss, None if mean else count)
            return self.grad_scale(scaled) if self.grad_scale is not None else scaled

        return self.targets(mb), rule

    def _mtp_head_loss(self, mb: int):
        """`_head_loss` of a head with MTP depths: every head's targets, the rule over every head's per-token losses."""
        t, valid, counts = self._mtp_terms(mb)
        num_tokens = None if self.reduction == "mean" else counts[0]

        def rule(per_token: torch.Tensor) -> torch.Tensor:
            scaled = self.scale_loss(self._mtp_total(per_token, valid, counts)[0], num_tokens)
            return self.grad_scale(scaled) if self.grad_scale is not None else scaled

        return t, rule

    def _report(self, mb: int, per_token: torch.Tensor, coef: torch.Tensor) -> LossOutput:
        """J's report: the micro-batch's cross-entropy (mean or sum over its targets) and its scaled value."""
        if self.mtp_depth:
            return self._mtp_report(mb, per_token)
        valid, count = self._valid(mb)
        with torch.no_grad():
            total = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
            loss = total.sum() / count if self.reduction == "mean" else total.sum()
            num_tokens = None if self.reduction == "mean" else count
            scaled = self.scale_loss(loss, num_tokens)
        return LossOutput(loss=scaled.detach(), num_tokens=num_tokens, raw=loss)

    def _mtp_report(self, mb: int, per_token: torch.Tensor) -> LossOutput:
        """`_report` of a head with MTP depths: the loss over every head (the backward's root before grad_scale), each
        head's cross-entropy in `logs`."""
        t, valid, counts = self._mtp_terms(mb)
        with torch.no_grad():
            total, heads = self._mtp_total(per_token, valid, counts)
            num_tokens = None if self.reduction == "mean" else counts[0]
            scaled = self.scale_loss(total, num_tokens)
        logs = {"lm loss": heads[0].detach(), **{f"mtp_{j} loss": heads[j].detach() for j in range(1, len(heads))}}
        return LossOutput(loss=scaled.detach(), num_tokens=num_tokens, logs=logs, raw=total.detach())
