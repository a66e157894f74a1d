"""A plan's per-layer memory choices (docs/formats.md, "Memory choices"): keep, recompute, selective, offload.

The plan's optional top-level `memory` maps a model layer index (a string key) to one choice:

- `"recompute"`: full recompute of the layer (only its input is kept; its forward re-runs before the backward),
- `"selective:<module>[,<module>]"`: recompute only the named sub-modules (Megatron-core 0.19's
  `--recompute-modules` names, `SELECTIVE_MODULES`),
- `"offload"`: its saved activation is copied to host memory after F and back before the backward,
- `"offload_w"`: where its backward is split, what W still reads is copied to host memory after I and back before W.

Layers not listed keep their activation on the device (today). This module reads and writes the field and checks
what the plan alone can check (a known choice, a known module, a layer index of the model); what needs the model
(a module the layer's kind has) and the cluster (host memory) is checked by `simulator/costs.py` `memory_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError

KEEP, RECOMPUTE, SELECTIVE, OFFLOAD, OFFLOAD_W = "keep", "recompute", "selective", "offload", "offload_w"
CHOICES = (RECOMPUTE, SELECTIVE, OFFLOAD, OFFLOAD_W)
# Megatron-core 0.19's --recompute-modules (transformer_config.py `recompute_modules`), what each re-runs:
SELECTIVE_MODULES = {
    "core_attn": "the core attention (QK^T, softmax, PV); frees what the attention kernel saves beyond Q, K, V",
    "moe_act": "the MoE experts' activation function; frees its output (the experts' fc2 input)",
    "layernorm": "the input_layernorm and pre_mlp_layernorm; frees their outputs (the qkv and fc1/router input)",
    "mla_up_proj": "the MLA up projection and RoPE (multi-latent attention only)",
    "mlp": "the dense MLP (fc1, activation, fc2); frees fc1's output and the activation's output",
    "moe": "the whole MoE layer (router, dispatch, experts, combine, shared experts); frees all but its input",
    "shared_experts": "the MoE layer's shared experts (their fc1, activation, fc2)",
}
# Modules a checkpoint of another already contains (Megatron wraps the whole MoE forward for "moe").
CONTAINS = {"moe": ("moe_act", "shared_experts")}


@dataclass(frozen=True, slots=True)
class MemoryChoice:
    """One layer's choice: `kind` (recompute, selective, offload, offload_w) and, for selective, the sub-modules."""

    kind: str
    modules: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The choice as the plan writes it: 'recompute', 'offload', 'offload_w' or 'selective:core_attn,mlp'."""
        return f"{SELECTIVE}:{','.join(self.modules)}" if self.kind == SELECTIVE else self.kind


def parse_choice(text) -> MemoryChoice:
    """A choice from its text; ValueError saying what is wrong."""
    if not isinstance(text, str):
        raise ValueError("a string")
    name, _, rest = text.partition(":")
    if name not in CHOICES:
        raise ValueError(f"unknown choice {name!r}")
    if name != SELECTIVE:
        if rest:
            raise ValueError(f"{name!r} takes no modules")
        return MemoryChoice(name)
    mods = tuple(m.strip() for m in rest.split(",")) if rest else ()
    if not mods:
        raise ValueError("selective needs at least one module")
    for m in mods:
        if m not in SELECTIVE_MODULES:
            raise ValueError(f"unknown module {m!r}")
    if len(set(mods)) != len(mods):
        raise ValueError("a module named twice")
    for outer, inner in CONTAINS.items():
        both = [m for m in inner if outer in mods and m in mods]
        if both:
            raise ValueError(f"{outer!r} already recomputes {', '.join(both)}")
    return MemoryChoice(SELECTIVE, tuple(sorted(mods)))


_EXPECTED = ("'recompute', 'offload', 'offload_w' or 'selective:<module>[,<module>]' with modules of "
             + ", ".join(SELECTIVE_MODULES))


def memory_from_dict(raw, src: str, num_layers: int | None = None) -> tuple[tuple[int, MemoryChoice], ...]:
    """The plan's `memory` field: (layer, choice) sorted by layer; refusals name the field and the fix."""
    if not isinstance(raw, dict):
        raise FormatError(src, "$.memory", "an object mapping layer indices to memory choices", raw)
    out = []
    for key, text in raw.items():
        path = f"$.memory.{key}"
        if not (isinstance(key, str) and key.isdigit()):
            raise FormatError(src, path, "a layer index (a non-negative integer as a string key)", key)
        layer = int(key)
        if num_layers is not None and layer >= num_layers:
            raise FormatError(src, path, f"a layer index of the model, 0..{num_layers - 1} (drop the entry or fix "
                              f"the index)", layer)
        try:
            choice = parse_choice(text)
        except ValueError as exc:
            raise FormatError(src, path, f"{_EXPECTED} ({exc})", text) from None
        out.append((layer, choice))
    return tuple(sorted(out))


def memory_to_dict(memory) -> dict:
    """The `memory` field of a plan document."""
    return {str(layer): choice.text for layer, choice in memory}


def memory_problem(memory, num_layers: int) -> str | None:
    """What is wrong with a plan's choices against a model of `num_layers` layers (None: nothing)."""
    for layer, _ in memory:
        if not 0 <= layer < num_layers:
            return (f"plan $.memory.{layer}: expected a layer index of the model (0..{num_layers - 1}), got {layer}; "
                    f"fix: drop the entry or fix the index")
    return None


def describe_choices(memory) -> str:
    """'recompute on 0-11, 14, selective:mlp on 12-13' (choices in layer order, runs of one choice joined)."""
    runs: list[list] = []
    for layer, choice in sorted(memory):
        if runs and runs[-1][0] == choice.text and runs[-1][2] == layer - 1:
            runs[-1][2] = layer
        else:
            runs.append([choice.text, layer, layer])
    by_text: dict[str, list[str]] = {}
    for text, a, b in runs:
        by_text.setdefault(text, []).append(f"{a}-{b}" if b > a else f"{a}")
    return ", ".join(f"{text} on {', '.join(spans)}" for text, spans in by_text.items())
