"""A deep heterogeneous model for the scale benchmark: Nemotron-H's Mamba/attention/MLP hybrid grown to
~200 layers with a DeepSeek-style MoE block every few layers and a 256k vocabulary."""

from __future__ import annotations

from dataclasses import replace

from octopipe_plugin.costs.analytic import layer_cost
from octopipe_plugin.costs.zoo import load_arch
from octopipe_plugin.formats import Layer, Model

UNIT = "M-M*-M-E-"  # Mamba, MLP, attention, MoE ('E'), repeated


def deep_model(num_layers: int = 194, vocab: int = 262144, gpu: str = "H100") -> Model:
    """Embedding, `num_layers` decoder layers cycling through UNIT, LM head; costs from the analytic model."""
    base = load_arch("nemotron-h", vocab=vocab, tp=8, seq_len=4096, hidden=8192, ffn=32768, heads=64, mamba_heads=256)
    moe = replace(base, hybrid_pattern="", num_experts=64, top_k=4, shared_experts=2, moe_ffn=2816, ep=8)
    kinds = {"M": (base, "mamba"), "*": (base, "attention"), "-": (base, "mlp"), "E": (moe, "moe")}
    cost = {sym: layer_cost(a, k, gpu) for sym, (a, k) in kinds.items()}
    cost["emb"] = layer_cost(base, "embedding", gpu)
    cost["head"] = layer_cost(base, "lm_head", gpu)

    def mk(name, c):
        return Layer(name=name, kind=c.kind, fwd_ms=c.fwd_ms, bwd_ms=c.bwd_ms, wgrad_ms=c.wgrad_ms,
                     state_bytes=c.state_bytes, activation_bytes=c.activation_bytes, output_bytes=c.output_bytes,
                     recompute_activation_bytes=c.recompute_activation_bytes)

    layers = [mk("embedding", cost["emb"])]
    layers += [mk(f"layer{i}", cost[UNIT[i % len(UNIT)]]) for i in range(num_layers)]
    layers.append(mk("lm_head", cost["head"]))
    return Model(name=f"deep-hybrid-{num_layers}", layers=tuple(layers), meta={"cost_model": "analytic"})
