"""Pretrain a GPT with megatron.training.pretrain: model provider, mock-data datasets, forward step, 3-tuple loss.

The shape of Megatron-LM's pretrain_gpt.py, written for megatron-core 0.19.x so OctoPipe's
examples and tests can run `pretrain()` without a Megatron-LM checkout:

    torchrun --nproc-per-node 8 examples/megatron/launch.py examples/megatron/train_gpt.py \
        <Megatron arguments> --mock-data --pipeline-schedule octopipe --octopipe-plan plan.json
    python examples/megatron/cpu_run.py --nproc 2 examples/megatron/train_gpt.py ...   # on CPU processes

Megatron's own parser and validation read the arguments (`parse_and_validate_args`, which the
launcher extends with OctoPipe's); the model's config comes from
`core_transformer_config_from_args`; `pretrain` runs Megatron's training loop, evaluation,
checkpointing and logging. Only `--mock-data` datasets are built here (Megatron's
MockGPTDataset); a real corpus goes through Megatron-LM's own pretrain_gpt.py.
"""

from __future__ import annotations

from functools import partial

import torch


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One GPTModel chunk: local or Transformer Engine layers, MoE and MTP as the arguments say."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        layer_spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                      normalization=args.normalization, vp_stage=vp_stage)
    elif te:
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        layer_spec = specs.get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    mtp_spec = None
    if args.mtp_num_layers:
        base = layer_spec.layer_specs[-1] if hasattr(layer_spec, "layer_specs") else layer_spec
        mtp_spec = specs.get_gpt_mtp_block_spec(config, base, use_transformer_engine=te, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, mtp_block_spec=mtp_spec, vp_stage=vp_stage,
                    pg_collection=pg_collection)


def get_batch(data_iterator, vp_stage=None):
    """This chunk's micro-batch: read where Megatron says the chunk is first or last, broadcast over TP."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    if not is_first_or_last_pipeline_stage(vp_stage):
        return {k: None for k in keys}
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
    # as Megatron's own get_batch passes them: the rank-level first / last stage answers
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=bool(args.mtp_num_layers) and mpu.is_pipeline_last_stage(),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return {k: batch.get(k) for k in keys}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of the token losses, number of tokens, report): Megatron divides by the tokens of the step."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """The chunk's forward: the batch where it reads data, the model, and the loss function (under
    --overlap-moe-expert-parallel-comm Megatron's combined step asks for the chunk's schedule plan instead, as
    pretrain_gpt.py's forward_step gives it)."""
    from megatron.core.utils import get_attr_wrapped_model

    b = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    call = model.build_schedule_plan if return_schedule_plan else model
    out = call(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"])
    return out, partial(loss_func, b["loss_mask"])


def is_dataset_built_on_rank(vp_stage=None):
    """Datasets are built where a chunk reads data (first or last stage) on tensor-parallel rank 0."""
    from megatron.core import parallel_state as mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's MockGPTDataset splits (--mock-data)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    if not args.mock_data:
        raise SystemExit("train_gpt.py builds mock data only: pass --mock-data (for a corpus use Megatron-LM's "
                         "pretrain_gpt.py)")
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                              blend_per_split=None, split=args.split, tokenizer=get_tokenizer(),
                              reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask,
                              eod_mask_loss=args.eod_mask_loss,
                              create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         partial(is_dataset_built_on_rank, vp_stage=vp_stage), config).build()


def main() -> None:
    """Parse and validate the arguments, then Megatron's pretrain."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    train_valid_test_datasets_provider.is_distributed = True  # every rank builds (core datasets)
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=model_provider)


if __name__ == "__main__":
    main()
