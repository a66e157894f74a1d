"""Mamba-2 mixer block (Dao and Gu 2024, "Transformers are SSMs", Sec. 7 block; Megatron `MambaMixer`).

in_proj: h -> [z, x, B, C, dt] = 2*d_inner + 2*G*N + H; depthwise causal conv1d over x, B, C;
SSD chunked scan; gated RMSNorm(y * silu(z)); out_proj: d_inner -> h. d_inner = H * P.
Heads (H), d_inner and groups are sharded by t (Megatron shards `nheads` and `ngroups` by TP).
"""

from __future__ import annotations

from .arch import Arch
from .blocks import Block, Dims, norm, tp_comm
from .ops import core, elementwise, matmul


def ssd_flops(tokens: int, heads: int, head_dim: int, state: int, chunk: int) -> float:
    """Forward FLOPs of the SSD chunked scan (Dao and Gu 2024, Sec. 6; `ssd_minimal_discrete` in mamba_ssm).

    Per chunk of Q tokens and per head: C B^T (2 Q^2 N), the masked product with X (2 Q^2 P),
    chunk states B^T X (2 Q N P) and the state-to-output product C h (2 Q N P); the inter-chunk
    recurrence is O(N P) per chunk and ignored. Per token: 2 Q (N + P) + 4 N P per head.
    """
    q = min(chunk, tokens)
    return float(tokens) * heads * (2.0 * q * (state + head_dim) + 4.0 * state * head_dim)


def mamba(d: Dims, arch: Arch) -> Block:
    """Norm + Mamba-2 mixer + residual."""
    n, h, t, dt, sp = d.n, d.h, d.t, d.dt, d.sp
    heads, p, g, st = arch.ssm_heads // t, arch.mamba_head_dim, max(arch.mamba_groups // t, 1), arch.mamba_state
    di = heads * p
    xbc = di + 2 * g * st  # conv channels: x, B, C
    proj = 2 * di + 2 * g * st + heads  # z, x, B, C, dt
    norm_op, norm_params, norm_act = norm(d)
    ops = [norm_op, *tp_comm(d, "mamba all-reduce"), matmul("in proj", n, h, proj, dt),
           core("conv1d", 2.0 * n * xbc * arch.mamba_conv, 2.0 * n * xbc * dt),
           core("ssd scan", ssd_flops(d.s, heads, p, st, arch.mamba_chunk) * d.b, 2.0 * n * (xbc + di) * dt),
           elementwise("gated norm", 3.0 * n * di * dt), matmul("out proj", n, di, h, dt),
           elementwise("residual", 3.0 * n * h * dt / sp)]
    # in_proj, conv weight + bias, dt_bias / A_log / D per head, gated-norm weight, out_proj
    params = norm_params + h * proj + xbc * (arch.mamba_conv + 1) + 3 * heads + di + di * h
    # Saved for backward by the fused path (mamba_split_conv1d_scan_combined): norm and in_proj inputs,
    # z and the conv input/output (x, B, C), fp32 dt and its cumulative decay, the scan output, out_proj input.
    act = norm_act + n * h * dt // sp + n * di * dt + 2 * n * xbc * dt + 8 * n * heads + 2 * n * di * dt
    return Block(ops=tuple(ops), params=params, activation=act)
