"""Pretrain a hybrid (Mamba / attention / MLP) model with megatron.training.pretrain: the shape of pretrain_mamba.py.

Megatron-LM's pretrain_mamba.py builds a HybridModel from `--hybrid-layer-pattern` (M Mamba,
* attention, - MLP, E MoE; '|' between pipeline stages); this script does the same for
megatron-core 0.19.x without a Megatron-LM checkout, reusing train_gpt.py's batch, loss and
mock-data datasets (the data path is the same for both models):

    torchrun --nproc-per-node 8 examples/megatron/launch.py examples/megatron/train_hybrid.py \
        --hybrid-layer-pattern "M-M*-M-M*-" <Megatron arguments> --mock-data \
        --pipeline-schedule octopipe --octopipe-plan plan.json
    python examples/megatron/cpu_run.py --nproc 2 examples/megatron/train_hybrid.py \
        --hybrid-layer-pattern "*-*-*-" --transformer-impl local ...   # on CPU: attention and MLP layers only

Under `--pipeline-schedule octopipe` the pattern has no '|': the plan sets the stages, under any
stage->rank map (V-shape included). With `--transformer-impl transformer_engine` (the GPU default)
the model is Megatron's `hybrid_stack_spec`. `--transformer-impl local` builds the attention and MLP
layers from Megatron-Core's local modules (Megatron ships no local hybrid spec; Mamba layers need
the mamba-ssm GPU kernels either way), and — because HybridStack builds its final norm from
Transformer Engine whatever the spec says — no final norm: a CPU check of a launch, not a model to keep.
"""

from __future__ import annotations

import train_gpt


def local_hybrid_stack_spec():
    """HybridStack spec of Megatron-Core's local (non-TE) attention and MLP layers, without the TE final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    sub = get_gpt_layer_local_spec().submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=sub.input_layernorm, self_attention=sub.self_attention, self_attn_bda=sub.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda))
    return ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                      submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One HybridModel chunk: its segment of --hybrid-layer-pattern (Megatron's select_pipeline_segment)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack_spec
    else:
        stack_spec = local_hybrid_stack_spec()
    return HybridModel(config=config, hybrid_stack_spec=stack_spec, vocab_size=args.padded_vocab_size,
                       max_sequence_length=args.max_position_embeddings,
                       hybrid_layer_pattern=args.hybrid_layer_pattern, pre_process=pre_process,
                       post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                       parallel_output=True,
                       share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                       position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                       rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection)


def main() -> None:
    """Parse and validate the arguments, then Megatron's pretrain (train_gpt.py's data, batch and loss)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    datasets = train_gpt.train_valid_test_datasets_provider
    datasets.is_distributed = True  # every rank builds (core datasets)
    pretrain(pretrain_cfg_container_from_args(args), datasets, ModelType.encoder_or_decoder, train_gpt.forward_step,
             model_provider=model_provider)


if __name__ == "__main__":
    main()
