"""Building blocks of a layer (attention, MLP, MoE, Mamba-2): ops, per-rank parameters, saved activations.

Conventions: n = s*b tokens of one micro-batch, t = tensor-parallel size, dt = bytes per element.
Megatron shards weight matrices and heads by t (column/row parallel linears); under sequence
parallelism (SP) the norm / residual / dropout tensors are sharded by t along the sequence.
Activation bytes follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.1 and Table 2: per layer sbh(34 + 5as/h) / t with TP + SP, i.e. the
tensors each op saves for its backward, generalised here to GQA, any FFN size, gated MLPs, no
dropout and flash attention (which saves no s^2 score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import Arch
from dataclasses import replace

from .ops import Op, alltoall, collective, core, elementwise, matmul


@dataclass(frozen=True, kw_only=True, slots=True)
class Dims:
    """Shapes of one transformer stack (the LLM, or the vision encoder) under one parallel setting."""

    s: int
    b: int
    h: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    t: int
    sp: int
    dt: int
    gated: bool
    bias: bool
    layernorm: bool
    rope: bool
    causal: bool
    dropout: bool
    flash: bool

    @property
    def n(self) -> int:
        """Tokens of one micro-batch."""
        return self.s * self.b


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """Ops, per-rank parameter count and saved activation bytes of one block."""

    ops: tuple[Op, ...]
    params: int
    activation: int


def llm_dims(arch: Arch) -> Dims:
    """Dims of the language model."""
    return Dims(s=arch.seq_len, b=arch.micro_batch_size, h=arch.hidden, heads=arch.heads, groups=arch.groups,
                head_dim=arch.dhead, ffn=arch.ffn, t=arch.tp, sp=arch.sp_div, dt=arch.dtype_bytes,
                gated=arch.gated_mlp, bias=arch.bias, layernorm=arch.layernorm, rope=arch.rope, causal=True,
                dropout=arch.dropout, flash=arch.flash_attention)


def vision_dims(arch: Arch) -> Dims:
    """Dims of a ViT encoder (CLIP style: LayerNorm, biases, GELU MLP, bidirectional attention)."""
    return Dims(s=arch.vision_tokens // arch.vision_tiles, b=arch.micro_batch_size * arch.vision_tiles,
                h=arch.vision_hidden, heads=arch.vision_heads,
                groups=arch.vision_heads, head_dim=arch.vision_hidden // arch.vision_heads, ffn=arch.vision_ffn,
                t=arch.tp, sp=arch.sp_div, dt=arch.dtype_bytes, gated=False, bias=True, layernorm=True,
                rope=False, causal=False, dropout=arch.dropout, flash=arch.flash_attention)


def norm(d: Dims) -> tuple[Op, int, int]:
    """Pre-norm: (op, params, saved input bytes); reads x, writes y."""
    return (elementwise("norm", 2 * d.n * d.h * d.dt / d.sp), (2 if d.layernorm else 1) * d.h,
            d.n * d.h * d.dt // d.sp)


def tp_comm(d: Dims, name: str) -> list[Op]:
    """One all-reduce (or SP all-gather + reduce-scatter) of n*h per block: 2(t-1)/t * n*h*dt per rank
    (Shoeybi et al. 2019, Megatron-LM Fig. 3; Korthikanti et al. 2022 Sec. 4.2.2 for SP)."""
    if d.t == 1:
        return []
    return [collective(name, 2.0 * (d.t - 1) / d.t * d.n * d.h * d.dt)]


def attended_keys(s: int, causal: bool, window: int, flash: bool) -> float:
    """Mean keys each query attends to; flash kernels skip masked blocks, unfused attention computes s x s."""
    if not flash:
        return float(s)
    if not causal:
        return float(min(s, window) if window else s)
    if not window or window >= s:
        return (s + 1) / 2.0
    return (window * (window + 1) / 2.0 + (s - window) * window) / s


def attention(d: Dims, window: int = 0) -> Block:
    """Norm + self-attention (MHA/GQA, full or sliding window) + residual."""
    n, h, t, dt, sp = d.n, d.h, d.t, d.dt, d.sp
    q, kv = d.heads * d.head_dim, d.groups * d.head_dim
    norm_op, norm_params, norm_act = norm(d)
    keys = attended_keys(d.s, d.causal, window, d.flash)
    scores = d.b * (d.heads // t) * d.s * keys  # score-matrix entries per rank
    # QK^T and PV: 2 FLOPs per multiply-add each (Narayanan et al. 2021, Sec. 5.1: 4bs^2h).
    core_flops = 4.0 * scores * d.head_dim
    core_bytes = n * (2 * q + 2 * kv) / t * dt + (0 if d.flash else 4 * scores * dt)
    # FlashAttention-2 (Dao 2023, Sec. 3.1.2) recomputes QK^T in its backward: 5 matmuls vs 2, i.e. 2.5x.
    ops = [norm_op, *tp_comm(d, "attention all-reduce"), matmul("qkv", n, h, (q + 2 * kv) // t, dt)]
    if d.rope:
        ops.append(elementwise("rope", 2 * n * (q + kv) / t * dt))
    ops += [core("attention core", core_flops, core_bytes, 2.5 if d.flash else 2.0),
            matmul("out proj", n, q // t, h, dt), elementwise("residual", 3 * n * h * dt / sp)]
    params = h * (q + 2 * kv) // t + q // t * h + (((q + 2 * kv) // t + h) if d.bias else 0) + norm_params
    act = norm_act + n * h * dt // sp + n * (q + 2 * kv) * dt // t + n * q * dt // t  # qkv in, Q/K/V, out-proj in
    if not d.flash:  # softmax output kept, plus its dropout mask and output (Korthikanti's 5as^2b)
        act += int(scores * dt + (scores * (1 + dt) if d.dropout else 0))
    else:
        act += 4 * n * (d.heads // t)  # flash keeps only an fp32 log-sum-exp per query row
    if d.dropout:
        act += n * h // sp  # 1-byte mask after the output projection
    return Block(ops=tuple(replace(op, phase="attention") for op in ops), params=params, activation=act)


def mlp_ops(d: Dims, ffn: int, tokens: int, prefix: str = "") -> tuple[list[Op], int, int]:
    """fc1 -> (Sw/Ge)GLU or GELU -> fc2 on `tokens` tokens: (ops, params, saved bytes except fc1's input).

    Gated MLPs (Shazeer 2020, "GLU Variants Improve Transformer") have fc1 = [gate; up], 2 x ffn wide.
    """
    t, dt, h = d.t, d.dt, d.h
    up = (2 if d.gated else 1) * ffn // t
    act_bytes = (3 if d.gated else 2) * tokens * ffn / t * dt  # read gate (+up), write product
    ops = [matmul(prefix + "fc1", tokens, h, up, dt), elementwise(prefix + "activation", act_bytes),
           matmul(prefix + "fc2", tokens, ffn // t, h, dt)]
    params = h * up + ffn // t * h + ((up + h) if d.bias else 0)
    saved = tokens * up * dt + tokens * ffn // t * dt  # fc1 output (activation input), activation output
    return ops, params, saved


def mlp(d: Dims, ffn: int | None = None) -> Block:
    """Norm + MLP + residual."""
    norm_op, norm_params, norm_act = norm(d)
    ops, params, saved = mlp_ops(d, ffn or d.ffn, d.n)
    all_ops = [norm_op, *tp_comm(d, "mlp all-reduce"), *ops, elementwise("residual", 3 * d.n * d.h * d.dt / d.sp)]
    act = norm_act + d.n * d.h * d.dt // d.sp + saved + (d.n * d.h // d.sp if d.dropout else 0)
    return Block(ops=tuple(all_ops), params=norm_params + params, activation=act)


def moe(d: Dims, arch: Arch) -> Block:
    """Norm + router + top-k routed experts (grouped GEMM) + shared experts + residual (DeepSeek-V3 Sec. 2.1.2).

    Every tensor-parallel rank computes all n*top_k token copies on its 1/t slice of each expert (Megatron's
    all-gather dispatcher with expert-TP = t); with ep > 1 the routed copies go to their experts' ranks in a
    dispatch all-to-all before the experts and come back in a combine all-to-all after them (Megatron's alltoall
    dispatcher), each a communication phase of its own over the EP group's links (`ops.alltoall`: NVLink within
    a node, the inter-node link across `ep_nodes`). Ops carry the part they belong to (`Op.phase`).
    """
    n, h, t, dt, sp = d.n, d.h, d.t, d.dt, d.sp
    e, k, fe = arch.num_experts, arch.top_k, arch.expert_ffn
    local = e // arch.ep
    up = (2 if d.gated else 1) * fe // t
    copies = n * k
    norm_op, norm_params, norm_act = norm(d)
    ops = [norm_op, *tp_comm(d, "moe all-reduce"), matmul("router", n // sp, h, e, dt),
           elementwise("router softmax/top-k", 8.0 * n / sp * e), elementwise("permute", 2.0 * copies * h * dt)]
    ops = [replace(op, phase="router") for op in ops]
    routed = copies * h * dt
    if arch.ep > 1:
        ops.append(alltoall("dispatch", routed, arch.ep, arch.ep_nodes))
    ops += [replace(op, phase="experts") for op in (
        matmul("expert fc1", copies, h, up, dt, weights=local),
        elementwise("expert activation", (3 if d.gated else 2) * copies * fe / t * dt),
        matmul("expert fc2", copies, fe // t, h, dt, weights=local))]
    if arch.ep > 1:
        ops.append(alltoall("combine", routed, arch.ep, arch.ep_nodes))
    ops.append(replace(elementwise("unpermute", (2.0 * copies + n) * h * dt), phase="combine-out"))
    params = norm_params + h * e + local * (h * up + fe // t * h)
    act = norm_act + n * h * dt // sp + 4 * n * e // sp  # norm in, router/expert input, fp32 router probs
    act += copies * h * dt + copies * up * dt + copies * fe // t * dt + copies * h * dt  # per-copy tensors
    if arch.shared_experts:
        s_ops, s_params, s_saved = mlp_ops(d, arch.shared_experts * fe, n, prefix="shared ")
        ops += [replace(op, phase="shared experts") for op in s_ops]
        params += s_params
        act += s_saved
    ops.append(replace(elementwise("residual", 3 * n * h * dt / sp), phase="combine-out"))
    return Block(ops=tuple(ops), params=params, activation=act)
