"""A small pure-torch transformer-like model (MLP and attention blocks) split into stages.

With `vocab` set it is a language model: an "embed" layer (token ids to vectors), the blocks and an
"lm" head (bias-free logits over the vocabulary), trained with cross-entropy on next-token targets;
`tied` shares the embedding's weight with the head's (the layers a plan may split by rows).

Multi-token prediction: "mtp" layers right before the "lm" head are MTP depths 1, 2, ...
(DeepSeek-V3 Sec. 2.2, simplified: a depth transforms the previous depth's hidden states, without
the next token's embedding). Each passes on the main hidden states and those of the depths so far
(a tuple), the head projects every one through its one weight, and the loss is Megatron's: the
main cross-entropy plus `mtp_loss_scale` / depth times each depth's, depth j predicting the token
j + 1 further on (its last j positions predict nothing).

Used by the executor's tests and benchmark as a real-compute model, and as a worked
example of wiring nn.Module stages to TorchStages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..executor.interface import TensorMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class ToySpec:
    """Shape of the toy model and its data."""

    hidden: int = 8
    seq: int = 4
    batch: int = 2  # micro-batch size
    layers: tuple[str, ...] = ("in", "mlp", "attn", "mlp", "attn", "mlp", "head")
    dtype: torch.dtype = torch.float64
    seed: int = 0
    vocab: int = 0  # > 0: token ids in, logits out ("embed" and "lm" layers), cross-entropy loss
    tied: bool = False  # the "lm" head uses the "embed" layer's weight
    mtp_loss_scale: float = 0.1  # Megatron's --mtp-loss-scaling-factor: each MTP depth's loss x this / depth

    @property
    def mtp_depth(self) -> int:
        """Number of "mtp" layers (multi-token-prediction depths)."""
        return self.layers.count("mtp")


class MLPBlock(nn.Module):
    """Pre-norm residual MLP."""

    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x))."""
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class AttnBlock(nn.Module):
    """Pre-norm residual causal self-attention (two heads)."""

    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, num_heads=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attention(norm(x)) with a causal mask."""
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        y = self.norm(x)
        out, _ = self.attn(y, y, y, attn_mask=mask, need_weights=False)
        return x + out


class MTPBlock(nn.Module):
    """One multi-token-prediction depth: from the previous depth's hidden states (the main model's for the first)
    a normed projection and an MLP block; takes the main states or the tuple (main, depth 1, ...) and returns
    the tuple with its own states appended."""

    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.proj = nn.Linear(h, h)
        self.block = MLPBlock(h)

    def forward(self, x) -> tuple:
        """(*states, block(proj(norm(states[-1]))))."""
        states = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        return states + (self.block(self.proj(self.norm(states[-1]))),)


class SharedHead(nn.Linear):
    """The LM head of a model with MTP: one weight, the logits of each hidden state of the tuple it is given."""

    def forward(self, x):
        """Logits of a tensor, or a tuple of the logits of each tensor of a tuple."""
        if isinstance(x, torch.Tensor):
            return super().forward(x)
        return tuple(super(SharedHead, self).forward(t) for t in x)


def build_layers(spec: ToySpec) -> nn.ModuleList:
    """Every layer of the model, seeded so every process builds identical weights."""
    torch.manual_seed(spec.seed)
    head = SharedHead if spec.mtp_depth else nn.Linear
    make = {"in": lambda h: nn.Linear(h, h), "mlp": MLPBlock, "attn": AttnBlock, "head": lambda h: nn.Linear(h, h),
            "embed": lambda h: nn.Embedding(spec.vocab, h), "lm": lambda h: head(h, spec.vocab, bias=False),
            "mtp": MTPBlock}
    layers = nn.ModuleList([make[k](spec.hidden) for k in spec.layers]).to(spec.dtype)
    if spec.tied:
        layers[spec.layers.index("lm")].weight = layers[spec.layers.index("embed")].weight
    return layers


def microbatch(spec: ToySpec, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of micro-batch `mb`, a pure function of (seed, mb); token ids with a vocabulary."""
    g = torch.Generator().manual_seed(spec.seed * 7919 + mb)
    if spec.vocab:
        ids = torch.randint(spec.vocab, (spec.batch, spec.seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    shape = (spec.batch, spec.seq, spec.hidden)
    return torch.randn(shape, generator=g, dtype=spec.dtype), torch.randn(shape, generator=g, dtype=spec.dtype)


def mtp_coefficients(spec: ToySpec) -> tuple[float, ...]:
    """The loss coefficient of each head: 1 for the main one, mtp_loss_scale / depth for each MTP depth."""
    d = spec.mtp_depth
    return (1.0,) + tuple(spec.mtp_loss_scale / d for _ in range(d))


def loss_fn(spec: ToySpec, coefficients: tuple[float, ...] | None = None):
    """The last stage's loss of micro-batch mb: mean squared error against its target (cross-entropy over the
    vocabulary for a language model; with MTP depths the sum over the heads of each one's mean cross-entropy times
    its coefficient, `mtp_coefficients` unless `coefficients` are given)."""
    coefs = coefficients if coefficients is not None else mtp_coefficients(spec)

    def fn(out, mb: int) -> torch.Tensor:
        target = microbatch(spec, mb)[1]
        if spec.vocab and spec.mtp_depth:
            total = torch.zeros((), dtype=spec.dtype)
            for j, logits in enumerate(out):  # depth j predicts target[p + j]; the last j positions nothing
                t = torch.full_like(target, -100)
                t[:, :spec.seq - j] = target[:, j:]
                ce = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), t.reshape(-1),
                                                       ignore_index=-100)
                total = total + coefs[j] * ce
            return total
        if spec.vocab:
            return torch.nn.functional.cross_entropy(out.reshape(-1, spec.vocab), target.reshape(-1))
        return torch.nn.functional.mse_loss(out, target)

    return fn


def boundary_metas(spec: ToySpec, num_stages: int) -> tuple[TensorMeta, ...]:
    """Every boundary carries a [batch, seq, hidden] activation (the last one is the loss)."""
    act = TensorMeta(shape=(spec.batch, spec.seq, spec.hidden), dtype=spec.dtype)
    return tuple(act if s < num_stages - 1 else TensorMeta(shape=(), dtype=spec.dtype) for s in range(num_stages))


def stage_modules(layers: nn.ModuleList, bounds, stages) -> dict[int, nn.Module]:
    """nn.Sequential of each listed stage's layer range; `bounds[s] = (start, end)`."""
    return {s: nn.Sequential(*layers[bounds[s][0]:bounds[s][1]]) for s in stages}


def reference_step(spec: ToySpec, layers: nn.ModuleList, num_microbatches: int,
                   coefficients: tuple[float, ...] | None = None) -> torch.Tensor:
    """Single-process reference: mean loss over micro-batches, gradients left in `layers` (`coefficients`: the
    heads' loss coefficients, `loss_fn`'s)."""
    total = torch.zeros((), dtype=spec.dtype)
    for mb in range(num_microbatches):
        x = microbatch(spec, mb)[0]
        for layer in layers:
            x = layer(x)
        loss = loss_fn(spec, coefficients)(x, mb) / num_microbatches
        loss.backward()
        total += loss.detach()
    return total


class MegatronStyleChunk(nn.Module):
    """A stage's layers behind Megatron's chunk convention: the pipeline input arrives via set_input_tensor."""

    def __init__(self, layers: nn.Module):
        super().__init__()
        self.layers = layers
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Megatron's hook: the activation received from the previous stage (None on the first)."""
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor | None) -> torch.Tensor:
        """Run the layers on the received activation, or on the batch's input on the first stage."""
        return self.layers(self.input_tensor if self.input_tensor is not None else tokens)


def megatron_style_forward_step(data_iterator, model: MegatronStyleChunk):
    """forward_step_func(data_iterator, model) -> (output, loss_func), as a Megatron training script writes it."""
    batch = next(data_iterator) if data_iterator is not None else None
    tokens, target = batch if batch is not None else (None, None)
    output = model(tokens)

    def loss_func(out: torch.Tensor):
        loss = torch.nn.functional.mse_loss(out, target)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func
