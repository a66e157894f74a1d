"""Megatron layers for the profiler: TransformerLayer / MoE / MambaLayer built from megatron-core's specs.

Each kind of an Arch becomes one real Megatron module on one tensor-parallel rank (tp = 1 here:
the profiler measures one rank's share), built from megatron-core's local spec
(`get_gpt_layer_local_spec`, plain torch modules, no Transformer Engine) with a one-layer
TransformerConfig, so the profile measures the code a Megatron run executes; on a GPU with
Transformer Engine installed, from its TE spec instead (what production runs use). Megatron needs its
model-parallel state: `ensure_model_parallel` initialises it on a one-rank group when no
process group exists (NCCL on a GPU; at start-up of an integration that already has one, it is
left alone).
Mamba layers need the mamba-ssm kernels (CUDA only): without them the kind has no builder and
the profiler falls back to the analytic model for it.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...costs.arch import Arch
from ...errors import OctoPipeError
from .wgrad import Phase, enable_wgrad_split, input_pass, te_modules_of, weight_pass

log = logging.getLogger(__name__)


def ensure_model_parallel(device: torch.device, seed: int = 1234) -> None:
    """Initialise torch.distributed (one-rank gloo) and Megatron's parallel state if nobody has."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        from ...executor.launch import free_port

        # one rank: NCCL on a GPU (Megatron's collectives then see CUDA tensors on a CUDA group), gloo on CPU
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def transformer_config(arch: Arch, dtype: torch.dtype, device: torch.device, **extra):
    """A one-layer TransformerConfig with the Arch's sizes (tp = 1, no dropout, flash-style causal mask)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.top_k, moe_ffn_hidden_size=arch.expert_ffn,
               moe_shared_expert_intermediate_size=arch.expert_ffn * arch.shared_experts or None,
               moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none") \
        if arch.num_experts else {}
    return TransformerConfig(
        num_layers=1, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, kv_channels=arch.dhead, gated_linear_unit=arch.gated_mlp,
        add_bias_linear=arch.bias, normalization="LayerNorm" if arch.layernorm else "RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=device.type != "cuda",
        perform_initialization=True, **moe, **extra)


class MegatronSplit:
    """I and W of a profiled Megatron module as its stage runner runs them (the measure's `octopipe_split_backward`).

    Megatron's linears are one autograd Function computing both GEMMs; made split-capable here
    (wgrad.enable_wgrad_split, the runner's path), I runs their input GEMM only and W their weight
    GEMM only, so the profile shows I + W = B instead of I + W = 2B. TE linears deferring their weight
    GEMM (delay_wgrad_compute) run TE's queue at W, as the runner does."""

    def __init__(self, module: nn.Module):
        self.phase = Phase()
        self.linears = enable_wgrad_split(module, self.phase)
        self.te = te_modules_of(module)

    def backward_input(self, outputs, grad_outputs, inputs, params):
        """I: input gradients only; returns them and the work W needs."""
        return input_pass(outputs, grad_outputs, inputs, params, self.phase, self.te)

    def backward_weight(self, work, sink: str = "autograd") -> None:
        """W: the deferred weight gradients through AccumulateGrad (the runner's only sink)."""
        weight_pass(work)


def with_split_backward(module: nn.Module) -> nn.Module:
    """`module` timed through its stage runner's I / W (MegatronSplit); returns it."""
    module.octopipe_split_backward = MegatronSplit(module)
    return module


class LayerModule(nn.Module):
    """A Megatron TransformerLayer / MambaLayer as a one-tensor module: [s, b, h] -> [s, b, h]."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's hidden states (its second output, the cross-attention context, is dropped)."""
        out = self.layer(hidden, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


class EmbeddingModule(nn.Module):
    """Megatron's LanguageModelEmbedding: token ids [b, s] -> [s, b, h] (RoPE: no position table)."""

    def __init__(self, config, arch: Arch):
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

        self.embedding = LanguageModelEmbedding(config=config, vocab_size=arch.padded_vocab,
                                                max_sequence_length=arch.seq_len,
                                                position_embedding_type="rope" if arch.rope else "learned_absolute")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed the micro-batch's tokens."""
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        return self.embedding(input_ids=ids, position_ids=pos)


class HeadModule(nn.Module):
    """Final norm, Megatron's ColumnParallelLinear output layer and vocab-parallel cross-entropy (mean loss)."""

    def __init__(self, config, arch: Arch, seed: int = 0):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.spec_utils import build_module

        norm_spec = get_gpt_layer_local_spec(normalization=config.normalization).submodules.input_layernorm
        self.norm = build_module(norm_spec, config=config, hidden_size=arch.hidden, eps=config.layernorm_epsilon)
        self.output = ColumnParallelLinear(arch.hidden, arch.padded_vocab, config=config,
                                           init_method=config.init_method,
                                           bias=False, gather_output=False)
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, arch.vocab, (arch.seq_len, arch.micro_batch_size), generator=g)
        self.register_buffer("labels", labels, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Mean token loss of the micro-batch ([s, b, h] in)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits, _ = self.output(self.norm(hidden))
        return vocab_parallel_cross_entropy(logits.float(), self.labels).mean()


def use_transformer_engine(spec: str, device: torch.device) -> bool:
    """Whether to build from the Transformer Engine spec: 'te', or 'auto' on a GPU where TE imports."""
    if spec not in ("auto", "local", "te"):
        raise OctoPipeError(f"megatron profile: spec must be 'auto', 'local' or 'te', got {spec!r}")
    if spec != "auto":
        return spec == "te"
    if device.type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _layer_spec(arch: Arch, kind: str, config, te: bool):
    """megatron-core's ModuleSpec of one decoder kind, local or Transformer Engine (attention-only / MLP-only
    kinds drop the other half, as Megatron's hybrid stack builds them)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp

    experts = arch.num_experts if kind == "moe" else None
    if te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False)
    else:
        spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                              normalization=config.normalization)
    spec = copy.deepcopy(spec)
    if kind == "attention":
        spec.submodules.pre_mlp_layernorm, spec.submodules.mlp = IdentityOp, IdentityOp
    elif kind == "mlp":
        spec.submodules.input_layernorm, spec.submodules.self_attention = IdentityOp, IdentityOp
    return spec


def _mamba_builder(arch: Arch, dtype: torch.dtype, device: torch.device) -> Callable[[], nn.Module] | None:
    """A MambaLayer factory from megatron-core's mamba stack spec, or None without the mamba-ssm kernels."""
    try:
        import mamba_ssm  # noqa: F401  (the SSD kernels MambaMixer calls)
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
        from megatron.core.transformer.spec_utils import build_module
    except ImportError as exc:
        log.info("megatron profile: no Mamba layer (%s): analytic figures for kind 'mamba'", exc)
        return None
    if device.type != "cuda":
        return None

    def build() -> nn.Module:
        config = transformer_config(arch, dtype, device, mamba_state_dim=arch.mamba_state,
                                    mamba_head_dim=arch.mamba_head_dim, mamba_num_groups=arch.mamba_groups,
                                    mamba_num_heads=arch.ssm_heads)
        return with_split_backward(LayerModule(build_module(mamba_stack_spec.submodules.mamba_layer, config=config,
                                                            layer_number=1)))

    return build


def megatron_builders(arch: Arch, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                      spec: str = "auto") -> dict[str, Callable[[], nn.Module]]:
    """kind -> factory of a real Megatron layer of that kind for the profiler (kinds without one are absent).

    `spec`: 'local' (megatron-core's plain torch modules), 'te' (Transformer Engine, what GPU runs use)
    or 'auto' (TE on a GPU where it imports, else local).
    """
    from megatron.core.transformer.spec_utils import build_module

    device = torch.device(device)
    te = use_transformer_engine(spec, device)
    if arch.tp != 1:
        raise OctoPipeError(f"megatron profile: layers are built on one rank with tp = 1, got tp = {arch.tp}; "
                            "profile with --tp 1 (per-rank costs at larger tp come from the analytic model)")
    ensure_model_parallel(device)

    def decoder(kind: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            extra = {"window_size": (arch.sliding_window, 0)} if kind == "dense_local" else {}
            config = transformer_config(arch, dtype, device, **extra)
            return with_split_backward(LayerModule(build_module(_layer_spec(arch, kind, config, te), config=config,
                                                                layer_number=1)))

        return build

    out = {k: decoder(k) for k in ("dense", "attention", "mlp")}
    if arch.sliding_window:
        out["dense_local"] = decoder("dense_local")
    if arch.num_experts:
        out["moe"] = decoder("moe")
    out["embedding"] = lambda: with_split_backward(EmbeddingModule(transformer_config(arch, dtype, device), arch))
    out["lm_head"] = lambda: with_split_backward(HeadModule(transformer_config(arch, dtype, device), arch))
    mamba = _mamba_builder(arch, dtype, device)
    if mamba is not None:
        out["mamba"] = mamba
    return out


def megatron_inputs(arch: Arch, dtype: torch.dtype) -> dict[str, Callable[[torch.device], torch.Tensor]]:
    """Example inputs in Megatron's layout: hidden states [s, b, h], token ids [b, s]."""
    s, b, h = arch.seq_len, arch.micro_batch_size, arch.hidden

    def hidden(device: torch.device) -> torch.Tensor:
        return torch.randn((s, b, h), generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)

    def tokens(device: torch.device) -> torch.Tensor:
        return torch.randint(0, arch.vocab, (b, s), generator=torch.Generator().manual_seed(0)).to(device)

    kinds = ("dense", "dense_local", "moe", "attention", "mlp", "mamba", "lm_head")
    return {**{k: hidden for k in kinds}, "embedding": tokens}
