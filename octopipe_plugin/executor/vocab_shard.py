"""Vocabulary shards of a split LM head and embedding (docs/formats.md, "Split layers"), in real tensors.

`SplitTorchStages` is the StageRunner of a plan with split layers over plain modules: the
stages' own layers run in a `TorchStages` (the split layers taken out of their owner stages),
the split layers' rows run here. Head shard on rows [lo, hi) of the head weight (`row_range`):

- H: logits Z = X W[lo:hi]^T of the head's input X, and per token the local max, the sum of
  exponentials and the target logit (0 where the target is not in its rows), sent to every shard;
- J: with every shard's statistics, the global max M, sum S and target logit T give the loss
  log S + M - T per token (cross-entropy, exactly the unsplit model's), and the softmax gradient
  dZ = c (exp(Z - M) / S - onehot), c the loss normalisation; the partial input gradient dZ W[lo:hi]
  goes to the owner, whose backward sums them as the head's input gradient;
- K: the rows' weight gradient dZ^T X, deferred like W.

Embedding shard: E looks up the tokens that fall in its rows (zeros elsewhere), summed into stage
0's input; G adds stage 0's input gradient into its rows. A tied embedding and head over the same
devices and shares use one shard weight per device: both gradients accumulate into it.
Shard gradients are added into `p.grad` directly (no autograd hooks run for shard weights).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..formats.splits import row_range, side_of
from .interface import LossOutput, TensorMeta
from .split_backward import accumulate_grad
from .torch_stage import TorchStages

REDUCTIONS = ("mean", "sum")


def shard_rows(plan, side: str, num_rows: int, rank: int) -> tuple[int, int] | None:
    """Rows [lo, hi) of the split layer of `side` ("output": head, "input": embedding) that `rank` holds, or None."""
    n = plan.stages[-1].end
    for sp in plan.splits:
        if side_of(sp, n) == side:
            return row_range(sp, num_rows, rank)
    return None


class SplitTorchStages:
    """StageRunner of a plan with a split LM head and/or embedding: TorchStages for the stages, shards here.

    - `modules[s]`: stage s's layers *without* the split ones (an owner holding only the split
      layer gets an identity); the owner of a split head returns the head's input from F;
    - `head_weight` / `embedding_weight`: this rank's rows of the split layer's weight ([rows, hidden]:
      `nn.Linear(hidden, vocab, bias=False).weight[lo:hi]`, `nn.Embedding(vocab, hidden).weight[lo:hi]`,
      rows from `shard_rows`), the same Parameter for a tied pair; None where the rank holds no shard;
    - `tokens(mb)` / `targets(mb)`: the micro-batch's token ids and targets (on the model's device);
    - `hidden_meta`: the head's input ([..., hidden]); `embedding_meta`: the embedding's output;
    - the loss is cross-entropy over the targets that are not `ignore_index`, `reduction` "mean" (as
      `F.cross_entropy`) or "sum" (reported as num_tokens too), then `scale_loss(loss, num_tokens)`
      (default: / num_microbatches) and `grad_scale`, as in TorchStages;
    - the other keywords are TorchStages' (used for the stages' own layers).
    """

    def __init__(self, *, plan, rank: int, modules: Mapping[int, nn.Module], num_microbatches: int,
                 vocab_size: int, hidden_meta: TensorMeta | None = None, embedding_meta: TensorMeta | None = None,
                 head_weight: nn.Parameter | None = None, embedding_weight: nn.Parameter | None = None,
                 tokens: Callable[[int], torch.Tensor] | None = None,
                 targets: Callable[[int], torch.Tensor] | None = None,
                 metas: Sequence | None = None, load_input: Callable | None = None, loss_fn: Callable | None = None,
                 call: Callable | None = None, scale_loss: Callable | None = None,
                 grad_scale: Callable | None = None, grad_sink: str = "autograd", reduction: str = "mean",
                 ignore_index: int = -100):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r}: expected one of {', '.join(REDUCTIONS)}")
        ns = plan.num_stages
        self.num_stages = ns
        self.rank = rank
        self.head_rows = shard_rows(plan, "output", vocab_size, rank)
        self.embedding_rows = shard_rows(plan, "input", vocab_size, rank)
        self.head_split = any(side_of(sp, plan.stages[-1].end) == "output" for sp in plan.splits)
        self.embedding_split = any(side_of(sp, plan.stages[-1].end) == "input" for sp in plan.splits)
        _check_rows("head_weight", head_weight, self.head_rows, rank)
        _check_rows("embedding_weight", embedding_weight, self.embedding_rows, rank)
        if head_weight is not None and head_weight is embedding_weight and self.head_rows != self.embedding_rows:
            raise ValueError(f"rank {rank}: a tied head and embedding share one shard weight, but this rank holds "
                             f"head rows {self.head_rows} and embedding rows {self.embedding_rows} (split both over "
                             f"the same devices in the same shares)")
        self.head_weight, self.embedding_weight = head_weight, embedding_weight
        self.tokens, self.targets = tokens, targets
        self.hidden_meta = hidden_meta
        self.embedding_meta = embedding_meta or hidden_meta
        self.reduction, self.ignore_index = reduction, ignore_index
        self.scale_loss = scale_loss or (lambda loss, num_tokens: loss / num_microbatches)
        self.grad_scale = grad_scale
        self.metas = tuple(metas) if metas is not None else None
        # The stages run in a TorchStages that sees them as the middle of a longer pipeline: with a split
        # embedding stage 0 takes (and gives the gradient of) the summed partials like any received
        # activation; with a split head the last stage returns the head's input and takes its gradient.
        self.offset = 1 if self.embedding_split else 0
        inner_ns = ns + self.offset + (1 if self.head_split else 0)
        off = self.offset
        self.inner = TorchStages(
            modules={s + off: m for s, m in modules.items()}, num_stages=inner_ns, num_microbatches=num_microbatches,
            load_input=None if self.embedding_split else load_input, loss_fn=None if self.head_split else loss_fn,
            call=None if call is None else (lambda s, m, x, b: call(s - off, m, x, b)),
            scale_loss=self.scale_loss, grad_scale=grad_scale, grad_sink=grad_sink)
        self._head: dict[int, dict] = {}
        self._emb: dict[int, dict] = {}

    # ----- the stages' own layers (TorchStages)

    def boundary_meta(self, stage: int):
        """Meta of stage `stage`'s output (None: learned per step)."""
        return self.metas[stage] if self.metas is not None else None

    def split_meta(self, what: str) -> TensorMeta | None:
        """Meta of a split hand-over: the head's input and partials, the statistics, the embedding's partials."""
        if what in ("head-input", "head-partial"):
            return self.hidden_meta
        if what == "stats":
            m = self.hidden_meta
            return None if m is None else TensorMeta(shape=(math.prod(m.shape[:-1]), 3), dtype=m.dtype,
                                                     requires_grad=False)
        return self.embedding_meta

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """Run the stage's own layers (stage 0 of a split embedding on the sum of the partials)."""
        if stage == 0 and self.embedding_split:
            inputs = inputs.detach().requires_grad_(not forward_only)
        return self.inner.forward(stage + self.offset, mb, inputs, batch=batch, forward_only=forward_only)

    def backward(self, stage: int, mb: int, grad_output):
        """Fused backward of the stage's own layers."""
        return self.inner.backward(stage + self.offset, mb, grad_output)

    def backward_input(self, stage: int, mb: int, grad_output):
        """Input gradient of the stage's own layers."""
        return self.inner.backward_input(stage + self.offset, mb, grad_output)

    def backward_weight(self, stage: int, mb: int) -> None:
        """Deferred weight gradient of the stage's own layers."""
        self.inner.backward_weight(stage + self.offset, mb)

    def pending(self) -> int:
        """(stage or shard, micro-batch) pairs whose state is still held (0 after a complete step)."""
        return self.inner.pending() + len(self._head) + len(self._emb)

    # ----- head shard

    def head_forward(self, stage: int, mb: int, hidden) -> torch.Tensor:
        """H: the rows' logits, kept; their local max, sum of exponentials and target logit, handed on."""
        lo, hi = self.head_rows
        with torch.no_grad():
            x = hidden.detach().reshape(-1, hidden.shape[-1])
            z = x @ self.head_weight.detach().t()
            t = self.targets(mb).reshape(-1)
            local_max = z.max(dim=1).values
            sum_exp = torch.exp(z - local_max[:, None]).sum(dim=1)
            mine = (t >= lo) & (t < hi)
            target = torch.where(mine, z.gather(1, (t - lo).clamp(0, hi - lo - 1)[:, None])[:, 0],
                                 torch.zeros((), dtype=z.dtype, device=z.device))
            stats = torch.stack([local_max, sum_exp, target], dim=1)
        self._head[mb] = {"x": x, "z": z, "stats": stats, "t": t, "shape": tuple(hidden.shape)}
        return stats

    def head_backward_input(self, stage: int, mb: int, peer_stats) -> tuple[torch.Tensor, LossOutput]:
        """J: the loss from every shard's statistics, the rows' softmax gradient and the partial input gradient."""
        lo, hi = self.head_rows
        saved = self._head[mb]
        z, t = saved.pop("z"), saved["t"]
        with torch.no_grad():
            every = torch.stack([saved.pop("stats"), *peer_stats])  # [shards, tokens, 3]
            gmax = every[:, :, 0].max(dim=0).values
            total = (every[:, :, 1] * torch.exp(every[:, :, 0] - gmax)).sum(dim=0)
            target = every[:, :, 2].sum(dim=0)  # one shard holds each target, the others add 0
            valid = t != self.ignore_index
            per_token = torch.where(valid, torch.log(total) + gmax - target, torch.zeros_like(total))
            count = int(valid.sum())
            loss = per_token.sum() / count if self.reduction == "mean" else per_token.sum()
        num_tokens = None if self.reduction == "mean" else count
        scaled, coef = self._scaled(loss, num_tokens)
        with torch.no_grad():
            weight = valid.to(z.dtype) * (coef / count if self.reduction == "mean" else coef)
            dz = torch.exp(z - gmax[:, None]) / total[:, None]
            mine = valid & (t >= lo) & (t < hi)
            rows = torch.nonzero(mine)[:, 0]
            dz[rows, t[rows] - lo] -= 1.0
            dz *= weight[:, None]
            partial = (dz @ self.head_weight.detach()).reshape(saved["shape"])
        saved["dz"] = dz
        return partial, LossOutput(loss=scaled.detach(), num_tokens=num_tokens, raw=loss)

    def _scaled(self, loss: torch.Tensor, num_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scaled loss the step sums, d(backward's start)/d(loss)): scale_loss and grad_scale as TorchStages."""
        leaf = loss.detach().requires_grad_(True)
        with torch.enable_grad():
            scaled = self.scale_loss(leaf, num_tokens)
            root = self.grad_scale(scaled) if self.grad_scale is not None else scaled
            (coef,) = torch.autograd.grad(root, leaf)
        return scaled, coef.detach()

    def head_backward_weight(self, stage: int, mb: int) -> None:
        """K: the rows' weight gradient dZ^T X; frees the micro-batch's logits."""
        saved = self._head.pop(mb)
        with torch.no_grad():
            accumulate_grad(self.head_weight, saved["dz"].t() @ saved["x"])

    # ----- embedding shard

    def embedding_forward(self, stage: int, mb: int) -> torch.Tensor:
        """E: the embedding of the tokens in the shard's rows, zeros for every other token."""
        lo, hi = self.embedding_rows
        w = self.embedding_weight
        tok = self.tokens(mb)
        mine = (tok >= lo) & (tok < hi)
        with torch.no_grad():
            out = torch.zeros(tuple(tok.shape) + (w.shape[1],), dtype=w.dtype, device=w.device)
            out[mine] = w.detach()[tok[mine] - lo]
        self._emb[mb] = {"mine": mine, "rows": tok[mine] - lo}
        return out

    def embedding_backward(self, stage: int, mb: int, grad_output) -> None:
        """G: stage 0's input gradient added into the rows of the tokens the shard looked up."""
        saved = self._emb.pop(mb)
        w = self.embedding_weight
        with torch.no_grad():
            dw = torch.zeros_like(w).index_add_(0, saved["rows"], grad_output[saved["mine"]].to(w.dtype))
            accumulate_grad(w, dw)


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
