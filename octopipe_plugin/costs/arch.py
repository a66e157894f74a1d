"""Architecture hyper-parameters of a model (Megatron-style names) and the layer sequence they imply."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from ..errors import FormatError
from .. import limits as L
from ..formats.fields import Said, check_value

ARCH_FORMAT = "octopipe-arch/1"
HYBRID_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp"}  # Nemotron-H hybrid_override_pattern
DECODER_KINDS = ("dense", "dense_local", "moe", "mamba", "attention", "mlp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Arch:
    """Hyper-parameters of one model and one parallel setting; derived sizes are properties."""

    name: str
    num_layers: int  # decoder layers (ignored when hybrid_pattern is set: its length counts)
    hidden: int
    ffn: int
    heads: int
    vocab: int
    kv_heads: int = 0  # 0: = heads (MHA); fewer: GQA
    head_dim: int = 0  # 0: hidden // heads
    seq_len: int = 4096
    micro_batch_size: int = 1
    tp: int = 1
    sequence_parallel: bool = True  # Megatron's --sequence-parallel (only matters with tp > 1)
    dp: int = 1  # data-parallel size sharding the optimizer (Megatron distributed optimizer)
    ep: int = 1  # expert-parallel size sharding the experts
    # nodes the expert-parallel group spans (ep / ep_nodes ranks in each): its all-to-alls cross the inter-node
    # link when > 1 (DeepSeek-V3's cross-node EP), stay on NVLink at 1
    ep_nodes: int = 1
    recompute: bool = False  # full activation recomputation of every decoder / vision layer
    dtype_bytes: int = 2
    gated_mlp: bool = True  # SwiGLU / GeGLU: three weight matrices instead of two
    bias: bool = False
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm
    rope: bool = True
    dropout: bool = False  # hidden/attention dropout masks kept for backward
    flash_attention: bool = True
    # MoE (DeepSeek-V3 style)
    num_experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    moe_ffn: int = 0  # 0: = ffn
    moe_layer_freq: int = 1
    first_dense_layers: int = 0
    # attention pattern (Gemma-3 style)
    sliding_window: int = 0  # 0: every layer global
    local_per_global: int = 0  # e.g. 5: five sliding-window layers, then one global; 0 with a window: all local
    # Mamba-2 (Nemotron-H style)
    hybrid_pattern: str = ""
    mamba_state: int = 128
    mamba_heads: int = 0  # 0: 2 * hidden // mamba_head_dim
    mamba_head_dim: int = 64
    mamba_groups: int = 8
    mamba_conv: int = 4
    mamba_chunk: int = 256
    # multi-token prediction (DeepSeek-V3)
    mtp_depth: int = 0
    tie_embeddings: bool = False  # the LM head reuses the embedding's weight (Gemma; Megatron's default)
    # vision encoder + projector (LLaVA style); vision_tokens of the LLM sequence are image tokens
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_ffn: int = 0
    vision_heads: int = 0
    vision_tokens: int = 0  # image tokens per sample, all tiles together
    vision_tiles: int = 1  # image tiles per sample, each a separate ViT sequence (LLaVA-NeXT any-res)

    @property
    def groups(self) -> int:
        """KV heads (query groups)."""
        return self.kv_heads or self.heads

    @property
    def dhead(self) -> int:
        """Head dimension."""
        return self.head_dim or self.hidden // self.heads

    @property
    def expert_ffn(self) -> int:
        """FFN size of one routed expert."""
        return self.moe_ffn or self.ffn

    @property
    def ssm_heads(self) -> int:
        """Mamba-2 heads (d_inner = ssm_heads * mamba_head_dim)."""
        return self.mamba_heads or 2 * self.hidden // self.mamba_head_dim

    @property
    def padded_vocab(self) -> int:
        """Vocabulary padded to a multiple of 128 * tp (Megatron `_vocab_size_with_padding`)."""
        unit = 128 * self.tp
        return -(-self.vocab // unit) * unit

    @property
    def sp_div(self) -> int:
        """Divisor of sequence-sharded tensors: tp under sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch in the language model (s * b)."""
        return self.seq_len * self.micro_batch_size


def decoder_kinds(arch: Arch) -> list[str]:
    """Kind of each decoder layer in order (dense / dense_local / moe / mamba / attention / mlp)."""
    if arch.hybrid_pattern:
        return [HYBRID_SYMBOLS[c] for c in arch.hybrid_pattern]
    kinds = []
    for i in range(arch.num_layers):
        moe = arch.num_experts > 0 and i >= arch.first_dense_layers and (
            (i - arch.first_dense_layers) % arch.moe_layer_freq == 0)
        local = arch.sliding_window > 0 and (
            arch.local_per_global == 0 or (i + 1) % (arch.local_per_global + 1) != 0)
        kinds.append("moe" if moe else "dense_local" if local else "dense")
    return kinds


def layer_plan(arch: Arch) -> list[tuple[str, str]]:
    """(name, kind) of every partitioning unit in execution order: vision, projector, embedding, decoder, MTP, head."""
    plan = [(f"vision{i}", "vision") for i in range(arch.vision_layers)]
    if arch.vision_layers:
        plan.append(("projector", "projector"))
    plan.append(("embedding", "embedding"))
    plan += [(f"layer{i}", k) for i, k in enumerate(decoder_kinds(arch))]
    plan += [(f"mtp{i}", "mtp") for i in range(arch.mtp_depth)]
    plan.append(("lm_head", "lm_head"))
    return plan


_BOOL_FIELDS = {f.name for f in dataclasses.fields(Arch) if f.type in ("bool", bool)}
_REQUIRED = ("name", "num_layers", "hidden", "ffn", "heads", "vocab")


def arch_from_dict(data: dict, src: str = "<dict>") -> Arch:
    """Build an Arch from a parsed architecture file, naming file, field and expectation on bad input."""
    known = {f.name: f for f in dataclasses.fields(Arch)}
    values = {}
    for key, value in data.items():
        if key in ("format", "base", "description"):
            continue
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise FormatError(src, f"$.{key}", f"a known architecture field{hint}", key)
        values[key] = _check_field(key, value, src)
    if data.get("hybrid_pattern") and "num_layers" not in values:
        values["num_layers"] = len(data["hybrid_pattern"])
    for key in _REQUIRED:
        if key not in values:
            raise FormatError(src, f"$.{key}", f"a {'string' if key == 'name' else 'positive integer'} (field is missing)")
    arch = Arch(**values)
    check_arch(arch, src)
    return arch


def _check_field(key: str, value, src: str):
    path = f"$.{key}"
    if key in ("name", "hybrid_pattern"):
        text = check_value(value, src, path, str)
        if len(text) > L.MAX_LAYERS:
            raise FormatError(src, path, f"at most {L.MAX_LAYERS} characters", Said(f"{len(text)} characters"))
        return text
    if key in _BOOL_FIELDS:
        return check_value(value, src, path, bool)
    positive = key in _REQUIRED[1:] + ("seq_len", "micro_batch_size", "tp", "dp", "ep", "dtype_bytes",
                                       "ep_nodes", "moe_layer_freq", "mamba_state", "mamba_head_dim", "mamba_groups",
                                       "mamba_conv", "mamba_chunk", "vision_tiles")
    most = L.MAX_LAYERS if key in ("num_layers", "vision_layers", "mtp_depth") else L.MAX_ARCH_INT
    return check_value(value, src, path, int, minimum=1 if positive else 0, maximum=most)


def _require(ok: bool, src: str, path: str, expected: str, got) -> None:
    if not ok:
        raise FormatError(src, path, expected, got)


def check_arch(arch: Arch, src: str = "<arch>") -> None:
    """Refuse combinations Megatron would refuse (divisibility by tp, top-k vs experts, pattern symbols)."""
    t = arch.tp
    _require(arch.heads % t == 0, src, "$.heads", f"a multiple of tp={t}", arch.heads)
    _require(arch.heads % arch.groups == 0, src, "$.kv_heads", f"a divisor of heads={arch.heads}", arch.kv_heads)
    _require(arch.groups % t == 0, src, "$.kv_heads", f"a multiple of tp={t}", arch.groups)
    _require(arch.ffn % t == 0, src, "$.ffn", f"a multiple of tp={t}", arch.ffn)
    _require(arch.seq_len % t == 0 or not arch.sequence_parallel, src, "$.seq_len",
             f"a multiple of tp={t} under sequence parallelism", arch.seq_len)
    _require(arch.dtype_bytes in (1, 2, 4), src, "$.dtype_bytes", "1, 2 or 4", arch.dtype_bytes)
    bad = sorted(set(arch.hybrid_pattern) - set(HYBRID_SYMBOLS))
    _require(not bad, src, "$.hybrid_pattern", "only 'M' (Mamba), '*' (attention) and '-' (MLP)", "".join(bad))
    if arch.hybrid_pattern:
        _require(arch.num_layers == len(arch.hybrid_pattern), src, "$.num_layers",
                 f"{len(arch.hybrid_pattern)} (the length of hybrid_pattern)", arch.num_layers)
        _require(arch.ssm_heads % t == 0, src, "$.mamba_heads", f"a multiple of tp={t}", arch.ssm_heads)
    if arch.num_experts:
        _require(0 < arch.top_k <= arch.num_experts, src, "$.top_k", f"1..num_experts={arch.num_experts}", arch.top_k)
        _require(arch.num_experts % arch.ep == 0, src, "$.ep", f"a divisor of num_experts={arch.num_experts}", arch.ep)
        _require(arch.ep % arch.ep_nodes == 0, src, "$.ep_nodes", f"a divisor of ep={arch.ep} (the EP group's "
                 f"ranks spread evenly over its nodes)", arch.ep_nodes)
        _require(arch.expert_ffn % t == 0, src, "$.moe_ffn", f"a multiple of tp={t}", arch.expert_ffn)
    else:
        _require(arch.top_k == 0 and arch.shared_experts == 0, src, "$.num_experts",
                 "> 0 when top_k or shared_experts is set", arch.num_experts)
    if arch.vision_layers:
        for key in ("vision_hidden", "vision_ffn", "vision_heads", "vision_tokens"):
            _require(getattr(arch, key) > 0, src, f"$.{key}", "a positive integer when vision_layers > 0",
                     getattr(arch, key))
        _require(arch.vision_tokens % arch.vision_tiles == 0, src, "$.vision_tokens",
                 f"a multiple of vision_tiles={arch.vision_tiles}", arch.vision_tokens)
        _require(arch.vision_heads % t == 0, src, "$.vision_heads", f"a multiple of tp={t}", arch.vision_heads)
        _require(arch.vision_tokens < arch.seq_len, src, "$.vision_tokens",
                 f"fewer than seq_len={arch.seq_len} (image tokens are part of the LLM sequence)", arch.vision_tokens)
