"""Selective recompute from the analytic blocks: what each of Megatron's `--recompute-modules` frees and re-runs.

Megatron-core 0.19 (`transformer_config.py` `recompute_modules`) checkpoints sub-modules of a transformer layer:
`core_attn` (normal checkpoint of the core attention: Q, K, V are its inputs and stay saved, what the kernel
saves beyond them is freed: flash's log-sum-exp, or the s x s softmax and dropout of unfused attention),
`layernorm` (output-discarding checkpoint of input_layernorm and pre_mlp_layernorm: their outputs, the qkv and
fc1 / router inputs, are freed; their inputs stay), `mlp` (the dense MLP: fc1's output and the activation's output
freed, its input kept), `moe_act` (output-discarding checkpoint of the experts' activation: its output, the
experts' fc2 input, freed), `shared_experts` (the shared experts' fc1 output and activation output), `moe` (the whole
MoE layer: everything it saves but its input: router probabilities, permuted copies, expert tensors, shared
experts) and `mla_up_proj` (multi-latent attention, which the analytic model does not build: no kind has it).

Each term below is one of `blocks.py`'s saved-activation terms (Korthikanti et al. 2022, Table 2, as blocks.py
writes them); the re-run forward is the F time of the block ops the module holds. Both are returned as shares of
the kind's activation and F, so a layer whose figures were scaled (a stand-in model) keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .arch import Arch
from .blocks import llm_dims, vision_dims
from .ops import op_times

# Block ops each module re-runs (blocks.py op names; "norm" is every pre-norm of the layer).
_OPS = {
    "core_attn": ("attention core",),
    "layernorm": ("norm",),
    "mlp": ("fc1", "activation", "fc2"),
    "moe_act": ("expert activation",),
    "shared_experts": ("shared fc1", "shared activation", "shared fc2"),
    "moe": ("router", "router softmax/top-k", "permute", "dispatch", "expert fc1", "expert activation",
            "expert fc2", "combine", "unpermute", "shared fc1", "shared activation", "shared fc2"),
}
# Which parts a layer kind is made of (costs/analytic.py `kind_block`).
_PARTS = {"dense": ("attention", "mlp"), "dense_local": ("attention", "mlp"), "vision": ("attention", "mlp"),
          "moe": ("attention", "moe"), "attention": ("attention",), "mlp": ("mlp",), "moe_mlp": ("moe",)}
# The modules each part can hold (what `_freed_bytes` counts per part; shared_experts only where the arch has them).
_PART_MODULES = {"attention": ("core_attn", "layernorm"), "mlp": ("layernorm", "mlp"),
                 "moe": ("layernorm", "moe_act", "shared_experts", "moe")}


def kind_modules(kind: str) -> tuple[str, ...]:
    """The selective modules a layer of `kind` may have (its parts'; none for a kind without parts, e.g. a head):
    what `octopipe profile` looks for in a built layer."""
    return tuple(dict.fromkeys(m for part in _PARTS.get(kind, ()) for m in _PART_MODULES[part]))


@dataclass(frozen=True, slots=True)
class ModuleShare:
    """One module of one layer kind: the share of the layer's activation bytes it frees and of its F it re-runs."""

    freed: float
    rerun: float


def _freed_bytes(arch: Arch, kind: str) -> dict[str, int]:
    """Per module the saved bytes it frees in one layer of `kind` (blocks.py's terms)."""
    d = vision_dims(arch) if kind == "vision" else llm_dims(arch)
    n, h, t, dt, sp = d.n, d.h, d.t, d.dt, d.sp
    out: dict[str, int] = {}
    parts = _PARTS[kind]
    if "attention" in parts:
        scores = d.b * (d.heads // t) * d.s * _keys(d, arch, kind)
        if d.flash:
            core = 4 * n * (d.heads // t)
        else:
            core = int(scores * dt + (scores * (1 + dt) if d.dropout else 0))
        out["core_attn"] = core
        out["layernorm"] = out.get("layernorm", 0) + n * h * dt // sp
    if "mlp" in parts:
        up = (2 if d.gated else 1) * d.ffn // t
        out["layernorm"] = out.get("layernorm", 0) + n * h * dt // sp
        out["mlp"] = n * up * dt + n * d.ffn // t * dt
    if "moe" in parts:
        e, k, fe = arch.num_experts, arch.top_k, arch.expert_ffn
        up = (2 if d.gated else 1) * fe // t
        copies = n * k
        out["layernorm"] = out.get("layernorm", 0) + n * h * dt // sp
        out["moe_act"] = copies * fe // t * dt
        shared = 0
        if arch.shared_experts:
            s_ffn = arch.shared_experts * fe
            shared = n * ((2 if d.gated else 1) * s_ffn // t) * dt + n * s_ffn // t * dt
            out["shared_experts"] = shared
        out["moe"] = 4 * n * e // sp + copies * h * dt + copies * up * dt + copies * fe // t * dt + copies * h * dt \
            + shared
    return out


def _keys(d, arch: Arch, kind: str) -> float:
    from .blocks import attended_keys

    window = arch.sliding_window if kind == "dense_local" else 0
    return attended_keys(d.s, d.causal, window, d.flash)


def module_shares(arch: Arch, kind: str, gpu) -> dict[str, ModuleShare]:
    """The modules a layer of `kind` has, each with its shares (empty: the kind has no selective recompute)."""
    if kind not in _PARTS:
        return {}
    from .analytic import kind_block

    block = kind_block(arch, kind)
    times = [(op.name, op_times(op, gpu)[0]) for op in block.ops]
    total_f = sum(f for _, f in times) or 1.0
    total_b = block.activation or 1
    out = {}
    for module, freed in _freed_bytes(arch, kind).items():
        rerun = sum(f for name, f in times if name in _OPS[module])
        out[module] = ModuleShare(freed=freed / total_b, rerun=rerun / total_f)
    return out


def arch_of(meta: dict) -> Arch | None:
    """The Arch an analytic model was built from (its meta), None when it records none."""
    raw = meta.get("arch") if isinstance(meta, dict) else None
    if not isinstance(raw, dict):
        return None
    names = {f.name for f in fields(Arch)}
    try:
        return Arch(**{k: v for k, v in raw.items() if k in names})
    except (TypeError, ValueError):
        return None
