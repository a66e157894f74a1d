"""A tiny Megatron HybridModel (attention and MLP layers) on CPU/gloo for the hybrid placement tests.

The arguments go through Megatron's own parser and validation (`--hybrid-layer-pattern` with '|'
between stages: validate_args derives the virtual pipeline size from the segments) and the config
through `core_transformer_config_from_args`. Mamba layers need GPU kernels (mamba-ssm, causal-conv1d):
the pattern holds attention ('*') and MLP ('-') layers only; the builder and placement path
(HybridModel -> select_pipeline_segment -> HybridStack) is the one a Mamba model takes. Parameters are
seeded by global name (megatron_harness.seed_by_global_name), so any split computes the same function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

import megatron_harness as H



def _import_example():
    """examples/megatron/train_hybrid.py, with its folder on sys.path only while it imports (as launch.py puts it).

    Its sibling `train_gpt` must not stay in sys.modules: examples/deepspeed has a `train_gpt` too, which tests
    later in the same process import by that name."""
    folder = str(Path(__file__).resolve().parents[3] / "examples" / "megatron")
    before = {name: sys.modules.get(name) for name in ("train_gpt", "train_hybrid")}
    sys.path.insert(0, folder)
    try:
        import train_hybrid as module
    finally:
        sys.path.remove(folder)
        for name, old in before.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


train_hybrid = _import_example()  # the example's model definition is the one the tests build


@dataclass(frozen=True, kw_only=True)
class TinyHybrid:
    """Shape of the tiny hybrid model and its data (the fields megatron_harness's batches and steps read)."""

    pattern: str = "*-*-*-*-"  # Megatron hybrid symbols, no '|': the plan (or the Megatron layout) sets the stages
    hidden: int = 32
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    mbs: int = 2
    tied: bool = False
    three_tuple_loss: bool = True

    def graph(self):
        """The OctoPipe model graph, as adapters.megatron.graph names a hybrid model's layers (kinds in order)."""
        from octopipe_plugin.adapters.megatron.graph import HYBRID_KINDS
        from octopipe_plugin.formats import Layer, Model

        cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
        kinds = ["embedding"] + [HYBRID_KINDS[c][0] for c in self.pattern] + ["lm_head"]
        return Model(name="tiny-hybrid", layers=tuple(Layer(name=f"l{i}", kind=k, **cost) for i, k in enumerate(kinds)))


def staged_pattern(spec: TinyHybrid, bounds) -> str:
    """`spec.pattern` with '|' at the given stage boundaries (graph layer ranges; layer 0 is the embedding)."""
    n = len(spec.pattern)
    return "|".join(spec.pattern[max(a - 1, 0):max(min(b - 1, n), 0)] for a, b in bounds)


def hybrid_argv(spec: TinyHybrid, pp: int, global_batch: int, pattern: str) -> list[str]:
    """Megatron command-line arguments of the tiny hybrid model (CUDA-only switches off, as megatron_harness)."""
    argv = ["--hybrid-layer-pattern", pattern, "--hidden-size", str(spec.hidden),
            "--num-attention-heads", str(spec.heads), "--ffn-hidden-size", str(2 * spec.hidden),
            "--seq-length", str(spec.seq), "--max-position-embeddings", str(spec.seq),
            "--micro-batch-size", str(spec.mbs), "--global-batch-size", str(global_batch),
            "--pipeline-model-parallel-size", str(pp), "--position-embedding-type", "rope",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec.vocab),
            "--lr", "0.01", "--min-lr", "0.01", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--train-iters", "3", "--use-distributed-optimizer",
            *H.CUDA_ONLY_ARGS, *H.ORACLE_ARGS]
    if not spec.tied:
        argv.append("--untie-embeddings-and-output-weights")
    return argv


def make_config(spec: TinyHybrid, pp: int, pattern: str):
    """(TransformerConfig, parsed arguments) through Megatron's parser, validation and config builder."""
    from megatron.training.arguments import core_transformer_config_from_args

    dp = (dist.get_world_size() if dist.is_initialized() else 1) // pp
    args = H.megatron_args(hybrid_argv(spec, pp, spec.mbs * dp, pattern))
    config = core_transformer_config_from_args(args)
    config.batch_p2p_comm = False  # gloo: Megatron's batched isend/irecv gives wrong results (megatron_harness)
    return config, args


def local_hybrid_stack_spec():
    """examples/megatron/train_hybrid.py's HybridStack spec of Megatron-Core's local (non-TE) attention and MLP
    layers (Megatron's own hybrid_stack_spec uses Transformer Engine, which needs CUDA; so does the TENorm
    HybridStack builds as its final norm, switched off there for every split alike)."""
    return train_hybrid.local_hybrid_stack_spec()


def build_chunk(spec: TinyHybrid, config, pattern: str, pre_process: bool, post_process: bool,
                vp_stage: int | None):
    """One HybridModel chunk (its segment chosen by Megatron's select_pipeline_segment), seeded by global name."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    model = HybridModel(config=config, hybrid_stack_spec=local_hybrid_stack_spec(), vocab_size=spec.vocab,
                        max_sequence_length=spec.seq, hybrid_layer_pattern=pattern, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=spec.tied,
                        position_embedding_type="rope", vp_stage=vp_stage)
    H.seed_by_global_name(model, spec.tied)
    return model
