"""Analytic per-layer costs: F / I / W time, state, activation and output bytes of every layer kind.

FLOPs: a matmul [m,k]x[k,n] costs 2mkn; its backward costs 2x that, split evenly into the input
gradient (I: dY W^T) and the weight gradient (W: X^T dY) (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", Sec. 5.1; Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", Sec. 2). Attention scores and context and the SSD scan multiply two
activations and have no weights: their whole backward is I. Element-wise kernels are
memory-bound and timed on HBM bandwidth (ops.py). All numbers are per tensor-parallel rank.

State (Megatron mixed precision with Adam, docs "Distributed Optimizer"): per parameter 2 bytes
of bf16 weight + 4 of fp32 gradient (main_grad) + 4 fp32 master weight + 4 Adam m + 4 Adam v =
18 bytes; the distributed optimizer shards the 12 optimizer bytes over dp: 6 + 12/dp.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from .arch import DECODER_KINDS, Arch, layer_plan
from .calibration import kind_scale
from .blocks import Block, Dims, attention, llm_dims, mlp, moe, norm, tp_comm, vision_dims
from ..gpus import GpuSpec, get_gpu
from .mamba import mamba
from .ops import Op, elementwise, matmul, op_times, total_flops, total_times
from ..formats.model import Layer, Model, Phase

RECOMPUTED_KINDS = frozenset(DECODER_KINDS) | {"vision", "moe_mlp"}  # Megatron recomputes transformer-block layers only
# Unfused vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py): per logit, the bf16
# read and fp32 copy, then max, subtract, exp, sum and divide passes over fp32; it keeps the fp32 softmax.
CE_FWD_BYTES = 38
CE_BWD_BYTES = 10  # per logit: read the saved fp32 softmax, write the fp32 grad, cast to bf16


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """Costs of one layer kind for one micro-batch on one tensor-parallel rank."""

    kind: str
    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    params: int
    state_bytes: int
    activation_bytes: int
    recompute_activation_bytes: int
    output_bytes: int
    flops: tuple[float, float, float]  # F, I, W
    phases: tuple[Phase, ...] = ()  # sub-layer phases where the layer communicates on its own link (ep > 1)


def state_bytes_per_param(arch: Arch) -> float:
    """Weight + fp32 grad + optimizer bytes per parameter: 18 in bf16, 6 + 12/dp with the distributed optimizer."""
    return adam_state_bytes_per_param(arch.dtype_bytes, arch.dp)


def adam_state_bytes_per_param(dtype_bytes: int, dp: int = 1) -> float:
    """Mixed-precision Adam bytes per parameter of `dtype_bytes` weights, optimizer sharded over `dp`."""
    optimizer = 12 if dtype_bytes < 4 else 8  # fp32 master copy only when training in lower precision
    return dtype_bytes + 4 + optimizer / dp


def embedding_block(d: Dims, arch: Arch, text_tokens: int) -> Block:
    """Vocab-parallel lookup (megatron/core/tensor_parallel/layers.py VocabParallelEmbedding): memory-bound
    gather, partial outputs all-reduced over TP; W builds a dense V/t x h grad and adds it to fp32 main_grad."""
    v, h, dt = arch.padded_vocab // d.t, d.h, d.dt
    gather = 2.0 * text_tokens * h * dt
    wgrad = v * h * (2.0 * dt + 8.0) + text_tokens * h * dt  # zero-fill + scatter-add, then main_grad += grad
    ops = [elementwise("embedding gather", gather, i_bytes=0.0, w_bytes=wgrad), *tp_comm(d, "embedding all-reduce")]
    return Block(ops=tuple(ops), params=v * h, activation=8 * text_tokens)  # int64 token ids


def head_block(d: Dims, arch: Arch) -> Block:
    """Final norm + output matmul h x V/t + vocab-parallel cross-entropy (fp32 softmax kept for backward)."""
    n, h, dt, v = d.n, d.h, d.dt, arch.padded_vocab // d.t
    norm_op, norm_params, norm_act = norm(d)
    ce = Op(name="cross-entropy", f_bytes=CE_FWD_BYTES * n * v, i_bytes=CE_BWD_BYTES * n * v)
    ops = (norm_op, *tp_comm(d, "head all-gather"), matmul("output", n, h, v, dt), ce)
    act = norm_act + n * h * dt // d.sp + 4 * n * v
    return Block(ops=ops, params=norm_params + h * v, activation=act)


def projector_block(arch: Arch) -> Block:
    """LLaVA-1.5 projector: Linear(vision_hidden, h) -> GELU -> Linear(h, h) on the image tokens."""
    vd = vision_dims(arch)
    d = llm_dims(arch)
    n, t, dt = vd.n, d.t, d.dt
    ops = [matmul("proj fc1", n, vd.h, d.h // t, dt), elementwise("gelu", 2.0 * n * d.h / t * dt),
           matmul("proj fc2", n, d.h // t, d.h, dt), *tp_comm(replace(d, s=arch.vision_tokens), "proj all-reduce")]
    params = vd.h * d.h // t + d.h // t * d.h + 2 * d.h
    act = n * vd.h * dt // d.sp + 2 * n * d.h // t * dt + n * d.h // t * dt
    return Block(ops=tuple(ops), params=params, activation=act)


def lm_head_block(d: Dims, arch: Arch) -> Block:
    """The LM head layer: the output head of the main model and of every MTP depth, one weight for all.

    DeepSeek-V3 (Sec. 2.2) shares the output head between the main model and its MTP modules, so the
    vocabulary projection and loss of each of the 1 + mtp_depth hidden states run here, where the
    weight is (and where a split head spreads all of them over its shards): a final norm,
    the h x V/t matmul and the cross-entropy per hidden state, logits kept per hidden state.
    """
    one = head_block(d, arch)
    k = 1 + arch.mtp_depth
    norm_params = norm(d)[1]
    return Block(ops=one.ops * k, params=one.params + (k - 1) * norm_params, activation=k * one.activation)


def mtp_block(d: Dims, arch: Arch, text_tokens: int) -> Block:
    """DeepSeek-V3 MTP module (Sec. 2.2) without its output head: embed the shifted tokens, norm both inputs,
    project 2h -> h, one transformer layer (MoE when the model has experts). Its output head and loss are
    the shared head's (`lm_head_block`): this layer sends its hidden states on to the LM head."""
    emb = embedding_block(d, arch, text_tokens)
    layer = [attention(d), moe(d, arch) if arch.num_experts else mlp(d)]
    n, h, dt, sp = d.n, d.h, d.dt, d.sp
    norm_op, norm_params, norm_act = norm(d)
    proj = matmul("eh proj", n, 2 * h, h // d.t, dt)
    ops = [*emb.ops, norm_op, norm_op, proj, *layer[0].ops, *layer[1].ops]
    # the embedding is a copy on this stage (Megatron keeps one per MTP stage and sums the tied gradients)
    params = emb.params + 2 * norm_params + 2 * h * h // d.t + layer[0].params + layer[1].params
    act = emb.activation + 2 * norm_act + 2 * n * h * dt // sp + layer[0].activation + layer[1].activation
    return Block(ops=tuple(ops), params=params, activation=act)


def kind_block(arch: Arch, kind: str) -> Block:
    """Ops, parameters and saved activations of one layer of `kind`."""
    d = llm_dims(arch)
    text = (arch.seq_len - arch.vision_tokens) * arch.micro_batch_size
    builders = {
        "dense": lambda: (attention(d), mlp(d)),
        "dense_local": lambda: (attention(d, arch.sliding_window), mlp(d)),
        "moe": lambda: (attention(d), moe(d, arch)),
        "mamba": lambda: (mamba(d, arch),),
        "attention": lambda: (attention(d),),
        "mlp": lambda: (mlp(d),),
        "moe_mlp": lambda: (moe(d, arch),),  # a hybrid model's MoE layer ('E'): experts without attention
        "vision": lambda: (attention(vision_dims(arch)), mlp(vision_dims(arch))),
        "projector": lambda: (projector_block(arch),),
        "embedding": lambda: (embedding_block(d, arch, text),),
        "mtp": lambda: (mtp_block(d, arch, text),),
        "lm_head": lambda: (lm_head_block(d, arch),),
    }
    if kind not in builders:
        raise ValueError(f"unknown layer kind {kind!r}; expected one of {sorted(builders)}")
    parts = builders[kind]()
    return Block(ops=tuple(op for p in parts for op in p.ops), params=sum(p.params for p in parts),
                 activation=sum(p.activation for p in parts))


def output_bytes(arch: Arch, kind: str, depth: int = 0) -> int:
    """Bytes of the activation a layer sends on (per rank: sequence-sharded under SP); `depth`: an MTP layer's.

    An MTP layer of depth k (0-based) sends the main hidden states and those of depths 0..k on: the
    shared output head (the `lm_head` layer) takes all 1 + mtp_depth of them.
    """
    dt, sp, b = arch.dtype_bytes, arch.sp_div, arch.micro_batch_size
    if kind == "vision":
        return arch.vision_tokens * b * arch.vision_hidden * dt // sp
    if kind == "projector":
        return arch.vision_tokens * b * arch.hidden * dt // sp
    if kind == "embedding":
        return (arch.seq_len - arch.vision_tokens) * b * arch.hidden * dt // sp
    if kind == "lm_head":
        return 4 * arch.tokens // sp  # fp32 per-token loss, never sent on
    if kind == "mtp":
        return (2 + depth) * arch.tokens * arch.hidden * dt // sp
    return arch.tokens * arch.hidden * dt // sp


def layer_cost(arch: Arch, kind: str, gpu: GpuSpec | str = "H100", *, calibrated: bool = True) -> LayerCost:
    """Analytic costs of one layer of `kind` (full recompute adds F to I and keeps only the input).

    `calibrated` applies the measured efficiency scales of costs/calibration.json for this GPU and kind.
    """
    gpu = get_gpu(gpu)
    block = kind_block(arch, kind)
    # measured efficiency of this kind on this GPU (costs/calibration.json), 1.0 where never measured; it scales
    # compute, not a link's communication phase
    sc = kind_scale(gpu.name, kind) if calibrated else None
    phases = block_phases(block.ops, gpu, sc, arch.recompute and kind in RECOMPUTED_KINDS)
    f, i, w = total_times(list(block.ops), gpu)
    if sc is not None:
        f, i, w = f / sc.fwd, i / sc.bwd, w / sc.wgrad
    if phases:  # the layer is the sum of its phases (formats/model.py checks it)
        f, i = sum(p.fwd_ms for p in phases), sum(p.bwd_ms for p in phases)
    out = output_bytes(arch, kind)
    recomputed = kind in RECOMPUTED_KINDS
    # Full recompute keeps only the layer input (Korthikanti et al. 2022, Sec. 4.1: 2sbh, /t under SP),
    # which is what the previous layer of the same stack (ViT or decoder) sends on.
    input_bytes = output_bytes(arch, "vision" if kind == "vision" else "dense")
    rec_act = input_bytes if recomputed else block.activation
    if arch.recompute and recomputed and not phases:
        i += f  # the forward is re-run right before the input-gradient pass (block_phases adds it per phase)
    return LayerCost(kind=kind, fwd_ms=f, bwd_ms=i, wgrad_ms=w, params=block.params,
                     state_bytes=int(block.params * state_bytes_per_param(arch)),
                     activation_bytes=rec_act if arch.recompute else block.activation,
                     recompute_activation_bytes=rec_act, output_bytes=out, flops=total_flops(list(block.ops)),
                     phases=phases)


def block_phases(ops, gpu: GpuSpec, scale=None, recompute: bool = False) -> tuple[Phase, ...]:
    """A block's ops grouped into phases: each link op (`Op.on_link`, an all-to-all) one communication phase, the
    compute ops between them one compute phase each, named for the parts they hold; () when no op is on a link.

    `scale` (a calibration KindScale) divides compute times; `recompute` adds each phase's F to its I (the
    recomputed forward before the backward, on the same resources)."""
    if not any(op.on_link for op in ops):
        return ()
    groups: list[tuple[bool, list[str], float, float]] = []
    for op in ops:
        f, i, _ = op_times(op, gpu)
        if not op.on_link and scale is not None:
            f, i = f / scale.fwd, i / scale.bwd
        label = op.phase or "compute"
        if groups and not op.on_link and not groups[-1][0]:
            link, names, gf, gi = groups[-1]
            groups[-1] = (link, names if label in names else names + [label], gf + f, gi + i)
        else:
            groups.append((op.on_link, [label], f, i))
    return tuple(Phase(name="+".join(names), resource="comm" if link else "compute", fwd_ms=gf,
                       bwd_ms=gi + (gf if recompute else 0.0)) for link, names, gf, gi in groups)


def layer_output_bytes(arch: Arch, kind: str, name: str, default: int) -> int:
    """A layer's `output_bytes` by position: an MTP layer's depth is the number its name ends in (`mtp1`,
    `mtp.layers.1`), every other layer sends what its kind does (`default`)."""
    if kind != "mtp":
        return default
    tail = re.search(r"(\d+)$", name)
    return output_bytes(arch, kind, int(tail.group(1)) if tail else 0)


def build_model(arch: Arch, gpu: GpuSpec | str = "H100", *, calibrated: bool = True) -> Model:
    """The cost-annotated Model of an architecture: one Layer per partitioning unit, branches in `inputs`."""
    gpu = get_gpu(gpu)
    plan = layer_plan(arch)
    kinds = sorted({k for _, k in plan})
    costs = {kind: layer_cost(arch, kind, gpu, calibrated=calibrated) for kind in kinds}
    layers = tuple(
        Layer(name=name, kind=kind, fwd_ms=c.fwd_ms, bwd_ms=c.bwd_ms, wgrad_ms=c.wgrad_ms, state_bytes=c.state_bytes,
              activation_bytes=c.activation_bytes, output_bytes=layer_output_bytes(arch, kind, name, c.output_bytes),
              recompute_activation_bytes=c.recompute_activation_bytes, phases=c.phases)
        for name, kind in plan for c in (costs[kind],)
    )
    inputs = {}
    if arch.vision_layers:
        # tokens -> embedding; image -> vision encoder -> projector; both feed the first decoder layer
        emb, proj = arch.vision_layers + 1, arch.vision_layers
        inputs = {emb: (), emb + 1: (proj, emb)}
    meta = {"cost_model": "analytic", "gpu": gpu.name, "arch": asdict(arch)}
    fitted = [k for k in kinds if calibrated and kind_scale(gpu.name, k).samples]
    if fitted:
        meta["calibrated_kinds"] = fitted
    return Model(name=arch.name, layers=layers, inputs=inputs, meta=meta, tied=tied_pair(arch, plan))


def tied_pair(arch: Arch, plan) -> tuple[tuple[int, int], ...]:
    """`Model.tied` of a layer plan ((name, kind) in order): the embedding and the LM head when `tie_embeddings`."""
    kinds = [kind for _, kind in plan]
    if not arch.tie_embeddings or "embedding" not in kinds or kinds[-1] != "lm_head":
        return ()
    return ((kinds.index("embedding"), len(kinds) - 1),)
