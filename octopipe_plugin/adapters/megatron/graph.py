"""A Megatron run's model as an OctoPipe Model: layers in pipeline order with analytic or measured costs.

The source is what Megatron itself holds: the parsed training arguments (an argparse
Namespace from `megatron.training.arguments.parse_args`) or a `TransformerConfig` plus the
few run sizes a config lacks (sequence length, micro-batch size, vocabulary). Per-layer kinds
follow Megatron's own rules (its hybrid-pattern parser, `moe_layer_freq`, window attention
per layer); costs come from `octopipe_plugin.costs` (the architecture maps onto `costs.Arch`)
unless `measured` gives them: a mapping from layer name or kind to the Layer fields a
profiler measured, which replace the analytic ones field by field.

Layer names are Megatron's module paths (`embedding`, `decoder.layers.3`, `mtp.layers.0`,
`output_layer`), so measured costs and plans line up with checkpoint keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ...costs import Arch, get_gpu, layer_cost
from ...costs.analytic import layer_output_bytes, tied_pair
from ...costs.arch import check_arch
from ...errors import OctoPipeError
from ...formats.model import Layer, Model

# Megatron hybrid symbols -> (our layer kind, the analytic cost kind that prices it).
# 'E' in a hybrid pattern is an MoE MLP without attention; layout.py maps kind "moe" back to 'E'.
HYBRID_KINDS = {"M": ("mamba", "mamba"), "*": ("attention", "attention"), "-": ("mlp", "mlp"),
                "E": ("moe", "moe_mlp")}
COST_FIELDS = ("fwd_ms", "bwd_ms", "wgrad_ms", "state_bytes", "activation_bytes", "output_bytes",
               "recompute_activation_bytes")
# what a measurement may give on top (the analytic model has none): the fused B over I + W (Layer.fused_ratio),
# and the split W's graph walk (Layer.graph_nodes, Layer.walk_ms_per_node: simulator/costs.py walk_ms)
WALK_FIELDS = ("graph_nodes", "walk_ms_per_node")
MEASURED_FIELDS = (*COST_FIELDS, "fused_ratio", *WALK_FIELDS)
# Megatron argument name -> TransformerConfig attribute where the two differ.
_ALIASES = {"num_experts": "num_moe_experts", "swiglu": "gated_linear_unit"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayerSpec:
    """One partitioning unit of a Megatron model: its module path, our kind and the cost kind pricing it."""

    name: str
    kind: str
    cost_kind: str


def _get(src, name: str, default=None):
    """An argument by its Megatron argument name, falling back to the TransformerConfig attribute."""
    value = getattr(src, name, None)
    if value is None and name in _ALIASES:
        value = getattr(src, _ALIASES[name], None)
    return default if value is None else value


def hybrid_pattern(src) -> str | None:
    """The run's hybrid layer pattern (--hybrid-layer-pattern, or the deprecated --hybrid-override-pattern)."""
    return _get(src, "hybrid_layer_pattern") or _get(src, "hybrid_override_pattern")


def layer_specs(src) -> list[LayerSpec]:
    """Every partitioning unit in execution order: embedding, decoder layers, MTP layers, output layer."""
    specs = [LayerSpec(name="embedding", kind="embedding", cost_kind="embedding")]
    pattern = hybrid_pattern(src)
    if pattern:
        from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

        parsed = parse_hybrid_pattern(pattern)
        main = (parsed.main_pattern or "").replace("|", "")
        for i, sym in enumerate(main):
            if sym not in HYBRID_KINDS:
                raise OctoPipeError(f"hybrid layer pattern {pattern!r}: layer {i} is {sym!r}, which OctoPipe has no "
                                    f"cost formula for (known: {''.join(HYBRID_KINDS)}); pass its measured costs "
                                    f"for layer 'decoder.layers.{i}' (model_from_megatron(measured=...))")
            kind, cost_kind = HYBRID_KINDS[sym]
            specs.append(LayerSpec(name=f"decoder.layers.{i}", kind=kind, cost_kind=cost_kind))
    else:
        specs += _gpt_decoder(src)
    specs += [LayerSpec(name=f"mtp.layers.{j}", kind="mtp", cost_kind="mtp") for j in range(mtp_depths(src))]
    specs.append(LayerSpec(name="output_layer", kind="lm_head", cost_kind="lm_head"))
    return specs


def mtp_depths(src) -> int:
    """MTP depths of the run: the hybrid pattern's (after its '/') or --mtp-num-layers."""
    pattern = hybrid_pattern(src)
    if pattern:
        from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

        return int(parse_hybrid_pattern(pattern).mtp_num_depths or 0)
    return int(_get(src, "mtp_num_layers", 0) or 0)


def _tied(src) -> bool:
    """Whether the run shares the embedding and output weights: the training arguments' default (pretrain_gpt's
    `share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights`); a TransformerConfig
    does not say, and GPTModel's own default is untied."""
    untie = getattr(src, "untie_embeddings_and_output_weights", None)
    return untie is not None and not untie


def _gpt_decoder(src) -> list[LayerSpec]:
    """GPT decoder layers: MoE where Megatron's moe_layer_freq puts experts, window attention where it applies."""
    from megatron.core.transformer.utils import is_layer_window_attention

    n = int(_get(src, "num_layers"))
    experts = int(_get(src, "num_experts", 0) or 0)
    freq = _get(src, "moe_layer_freq", 1)
    if not experts:
        moe = [0] * n
    elif isinstance(freq, int):  # megatron/core/models/gpt/gpt_layer_specs.py: layer i is MoE when i % freq == 0
        moe = [int(i % freq == 0) for i in range(n)]
    else:
        moe = list(freq)
        if len(moe) != n:
            raise OctoPipeError(f"moe_layer_freq has {len(moe)} entries but the model has {n} layers")
    window = _get(src, "window_size")
    skip = _get(src, "window_attn_skip_freq")
    out = []
    for i in range(n):
        local = is_layer_window_attention(window, skip, i + 1)
        kind = "moe" if moe[i] else "dense_local" if local else "dense"
        out.append(LayerSpec(name=f"decoder.layers.{i}", kind=kind, cost_kind=kind))
    return out


def arch_from_megatron(src, *, name: str = "megatron", vocab_size: int | None = None, seq_length: int | None = None,
                       micro_batch_size: int | None = None, data_parallel_size: int | None = None,
                       arch_overrides: Mapping | None = None) -> Arch:
    """The costs.Arch of a Megatron run (arguments or TransformerConfig plus the given run sizes).

    `arch_overrides` sets Arch fields Megatron's arguments do not carry (e.g. mamba_chunk, flash_attention).
    """
    vocab = vocab_size or _get(src, "padded_vocab_size") or _get(src, "vocab_size")
    seq = seq_length or _get(src, "seq_length")
    mbs = micro_batch_size or _get(src, "micro_batch_size")
    missing = [k for k, v in (("vocab_size", vocab), ("seq_length", seq), ("micro_batch_size", mbs)) if not v]
    if missing:
        raise OctoPipeError(f"Megatron model: {', '.join(missing)} unknown; pass them (a TransformerConfig does not "
                            "hold them; the training arguments do once --vocab-size or a tokenizer is set)")
    cp = int(_get(src, "context_parallel_size", 1))
    tp = int(_get(src, "tensor_model_parallel_size", 1))
    # before validate_args sets data_parallel_size, derive it as Megatron will (world / (tp * pp * cp))
    dp = data_parallel_size or _get(src, "data_parallel_size") or max(
        1, int(_get(src, "world_size", 1)) // (tp * int(_get(src, "pipeline_model_parallel_size", 1)) * cp))
    heads = int(_get(src, "num_attention_heads"))
    hidden = int(_get(src, "hidden_size"))
    ffn = int(_get(src, "ffn_hidden_size", 4 * hidden))  # validate_args' default
    groups = _get(src, "num_query_groups") if _get(src, "group_query_attention", True) else None
    experts = int(_get(src, "num_experts", 0) or 0)
    moe_ffn = int(_get(src, "moe_ffn_hidden_size", 0) or 0)
    shared = int(_get(src, "moe_shared_expert_intermediate_size", 0) or 0)
    window = _get(src, "window_size")
    pattern = (hybrid_pattern(src) or "")
    fields = dict(
        name=name, hidden=hidden, ffn=ffn, heads=heads,
        vocab=int(vocab), kv_heads=int(groups or 0), head_dim=int(_get(src, "kv_channels", 0) or 0),
        # Context parallelism shards the sequence: each rank runs s/cp tokens through every layer (its
        # ring attention also reads the other ranks' keys, which this per-rank view leaves out).
        seq_len=int(seq) // cp, micro_batch_size=int(mbs), tp=tp,
        sequence_parallel=bool(_get(src, "sequence_parallel", False)),
        dp=int(dp) if _get(src, "use_distributed_optimizer", False) else 1,
        ep=int(_get(src, "expert_model_parallel_size", 1)),
        recompute=_get(src, "recompute_granularity") == "full",
        dtype_bytes=2 if (_get(src, "bf16", False) or _get(src, "fp16", False)) else 4,
        gated_mlp=bool(_get(src, "swiglu", False)), bias=bool(_get(src, "add_bias_linear", False)),
        layernorm=_get(src, "normalization", "LayerNorm") == "LayerNorm",
        rope=_get(src, "position_embedding_type", "rope") == "rope",
        dropout=float(_get(src, "hidden_dropout", 0.0)) > 0 or float(_get(src, "attention_dropout", 0.0)) > 0,
        num_experts=experts, top_k=int(_get(src, "moe_router_topk", 0) or 0) if experts else 0,
        moe_ffn=moe_ffn, shared_experts=round(shared / (moe_ffn or ffn)) if shared else 0,
        sliding_window=int(window[0]) if window else 0,
        mamba_state=int(_get(src, "mamba_state_dim", 128)), mamba_heads=int(_get(src, "mamba_num_heads", 0) or 0),
        mamba_head_dim=int(_get(src, "mamba_head_dim", 64)), mamba_groups=int(_get(src, "mamba_num_groups", 8)),
        num_layers=int(_get(src, "num_layers", 0) or len(pattern.split("/")[0].replace("|", "")) or 1),
        mtp_depth=mtp_depths(src),  # the LM head's cost counts the shared output head of every depth
        tie_embeddings=_tied(src),
    )
    arch = Arch(**{**fields, **dict(arch_overrides or {})})
    check_arch(arch, f"Megatron arguments of {name!r}")
    return arch


def model_from_megatron(src, *, gpu: str = "H100", name: str = "megatron",
                        measured: Mapping[str, Mapping[str, float]] | None = None, **run) -> Model:
    """The cost-annotated Model of a Megatron run; `measured` (by layer name or kind) overrides analytic costs.

    `run` takes vocab_size, seq_length, micro_batch_size, data_parallel_size where `src` lacks them, and
    arch_overrides (see arch_from_megatron).
    """
    specs = layer_specs(src)
    arch = arch_from_megatron(src, name=name, **run)
    measured = dict(measured or {})
    _check_measured(measured, specs)
    gpu_spec = get_gpu(gpu)
    analytic: dict[str, dict] = {}
    layers = []
    for spec in specs:
        given = {**measured.get(spec.kind, {}), **measured.get(spec.name, {})}
        if spec.cost_kind not in analytic:
            analytic[spec.cost_kind] = _analytic(arch, spec.cost_kind, gpu_spec)
        costs = {**analytic[spec.cost_kind], **given}
        if given.keys() & {"fwd_ms", "bwd_ms"}:  # measured times: the analytic phases no longer sum to them
            costs.pop("phases", None)
        if "output_bytes" not in given:  # an MTP layer sends on the hidden states of every depth so far
            costs["output_bytes"] = layer_output_bytes(arch, spec.kind, spec.name, costs["output_bytes"])
        layers.append(Layer(name=spec.name, kind=spec.kind, **costs))
    meta = {"cost_model": "analytic+measured" if measured else "analytic", "gpu": gpu_spec.name,
            "arch": dataclasses.asdict(arch), "source": "megatron"}
    return Model(name=name, layers=tuple(layers), meta=meta, tied=tied_pair(arch, [(s.name, s.kind) for s in specs]))


def _analytic(arch: Arch, cost_kind: str, gpu) -> dict:
    c = layer_cost(arch, cost_kind, gpu)
    # a MoE layer at EP > 1: its sub-layer phases (all-to-alls on the link), which pairs overlap (docs/formats.md)
    return {k: getattr(c, k) for k in COST_FIELDS} | ({"phases": c.phases} if c.phases else {})


def _check_measured(measured: Mapping, specs: list[LayerSpec]) -> None:
    """Refuse measured costs for a layer or kind the model lacks, or for a field a Layer lacks."""
    known = {s.name for s in specs} | {s.kind for s in specs}
    for key, values in measured.items():
        if key not in known:
            raise OctoPipeError(f"measured costs for {key!r}: the model has no such layer or kind; layer names are "
                                f"like 'decoder.layers.0', kinds are {sorted({s.kind for s in specs})}")
        bad = sorted(set(values) - set(MEASURED_FIELDS))
        if bad:
            raise OctoPipeError(f"measured costs for {key!r}: unknown field(s) {bad}; expected among {MEASURED_FIELDS}")

