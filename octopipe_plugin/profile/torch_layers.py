"""Plain-torch reference layers of the zoo's kinds, built from an Arch (one tensor-parallel rank, tp = 1).

What `octopipe profile --impl torch` and the fidelity benchmark measure when no framework is
involved: a Llama-style pre-norm decoder layer (RMSNorm, GQA attention with RoPE-free SDPA,
SwiGLU or GELU MLP), a DeepSeek-style MoE layer (top-k router, routed and shared experts), the
embedding and the LM head with its cross-entropy. Inputs are [batch, seq, hidden] (token ids
[batch, seq] for the embedding); the LM head returns the micro-batch's mean loss.
Mamba has no plain-torch layer here (its kernels come from mamba-ssm): the profiler falls back
to the analytic model for it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..costs.arch import Arch
from ..errors import OctoPipeError


class RMSNorm(nn.Module):
    """x / rms(x) * weight."""

    def __init__(self, h: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """SwiGLU (gated) or GELU feed-forward h -> ffn -> h."""

    def __init__(self, h: int, ffn: int, gated: bool, bias: bool = False):
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(h, 2 * ffn if gated else ffn, bias=bias)
        self.down = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(up(x)))."""
        u = self.up(x)
        if self.gated:
            g, u = u.chunk(2, dim=-1)
            return self.down(F.silu(g) * u)
        return self.down(F.gelu(u))


class Attention(nn.Module):
    """Causal grouped-query self-attention, optionally within a sliding window."""

    def __init__(self, arch: Arch, window: int = 0):
        super().__init__()
        self.heads, self.groups, self.dh = arch.heads, arch.groups, arch.dhead
        self.window = window
        self.qkv = nn.Linear(arch.hidden, (self.heads + 2 * self.groups) * self.dh, bias=arch.bias)
        self.proj = nn.Linear(self.heads * self.dh, arch.hidden, bias=arch.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """proj(softmax(q k^T / sqrt(d)) v) over causal (windowed) positions."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.dh, self.groups * self.dh, self.groups * self.dh], dim=-1)
        q = q.view(b, s, self.heads, self.dh).transpose(1, 2)
        k = k.view(b, s, self.groups, self.dh).transpose(1, 2)
        v = v.view(b, s, self.groups, self.dh).transpose(1, 2)
        if self.groups != self.heads:
            rep = self.heads // self.groups
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.window and self.window < s:
            i = torch.arange(s, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.heads * self.dh))


class MoE(nn.Module):
    """Top-k routed experts plus always-on shared experts (DeepSeek-V3 style, no capacity drop)."""

    def __init__(self, arch: Arch):
        super().__init__()
        h, f = arch.hidden, arch.expert_ffn
        self.top_k = arch.top_k
        self.router = nn.Linear(h, arch.num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(h, f, arch.gated_mlp) for _ in range(arch.num_experts)])
        self.shared = MLP(h, f * arch.shared_experts, arch.gated_mlp) if arch.shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token through its top-k experts, weighted by the renormalised router scores."""
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        scores = torch.softmax(self.router(t), dim=-1)
        weight, chosen = scores.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, expert(t[tok]) * weight[tok, slot, None])
        if self.shared is not None:
            out = out + self.shared(t)
        return out.view(shape)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)) then + mlp(norm(.)), either part optional."""

    def __init__(self, arch: Arch, attention: Attention | None, mlp: nn.Module | None):
        super().__init__()
        self.norm1 = RMSNorm(arch.hidden) if attention is not None else None
        self.attention = attention
        self.norm2 = RMSNorm(arch.hidden) if mlp is not None else None
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after this block."""
        if self.attention is not None:
            x = x + self.attention(self.norm1(x))
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x


class Embedding(nn.Module):
    """Token ids [b, s] -> hidden states [b, s, h]."""

    def __init__(self, arch: Arch):
        super().__init__()
        self.table = nn.Embedding(arch.padded_vocab, arch.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look the ids up."""
        return self.table(ids)


class LMHead(nn.Module):
    """Final norm, output projection to the vocabulary, mean cross-entropy against fixed labels."""

    def __init__(self, arch: Arch, seed: int = 0):
        super().__init__()
        self.norm = RMSNorm(arch.hidden)
        self.output = nn.Linear(arch.hidden, arch.padded_vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, arch.vocab, (arch.micro_batch_size, arch.seq_len), generator=g)
        self.register_buffer("labels", labels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean token loss."""
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), self.labels[: x.shape[0], : x.shape[1]].flatten())


def builders(arch: Arch) -> dict[str, Callable[[], nn.Module]]:
    """kind -> factory of a fresh plain-torch layer of that kind (kinds without one are absent)."""
    if arch.tp != 1:
        raise OctoPipeError(f"plain-torch layers are built for tp = 1, got tp = {arch.tp} (use --impl megatron)")
    if arch.vision_layers:
        raise OctoPipeError("plain-torch layers: vision encoders are not built here (use the analytic model)")
    gated = arch.gated_mlp
    return {
        "dense": lambda: Block(arch, Attention(arch), MLP(arch.hidden, arch.ffn, gated, arch.bias)),
        "dense_local": lambda: Block(arch, Attention(arch, arch.sliding_window), MLP(arch.hidden, arch.ffn, gated)),
        "moe": lambda: Block(arch, Attention(arch), MoE(arch)),
        "attention": lambda: Block(arch, Attention(arch), None),
        "mlp": lambda: Block(arch, None, MLP(arch.hidden, arch.ffn, gated, arch.bias)),
        "embedding": lambda: Embedding(arch),
        "lm_head": lambda: LMHead(arch),
    }


def hidden_input(arch: Arch, dtype: torch.dtype) -> Callable[[torch.device], torch.Tensor]:
    """Factory of one micro-batch of hidden states [b, s, h]."""
    shape = (arch.micro_batch_size, arch.seq_len, arch.hidden)
    return lambda device: torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device,
                                                                                           dtype=dtype)


def token_input(arch: Arch) -> Callable[[torch.device], torch.Tensor]:
    """Factory of one micro-batch of token ids [b, s]."""
    shape = (arch.micro_batch_size, arch.seq_len)
    return lambda device: torch.randint(0, arch.vocab, shape, generator=torch.Generator().manual_seed(0)).to(device)

