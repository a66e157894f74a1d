"""Megatron arguments / TransformerConfig -> OctoPipe Model: kinds by Megatron's rules, costs of costs/."""

import pytest

from octopipe_plugin.adapters.megatron.graph import arch_from_megatron, layer_specs, model_from_megatron
from octopipe_plugin.costs import layer_cost, resolve_model
from octopipe_plugin.errors import OctoPipeError

from launch_helpers import parse

pytestmark = [pytest.mark.framework, pytest.mark.timeout(120)]

COST = ("kind", "fwd_ms", "bwd_ms", "wgrad_ms", "state_bytes", "activation_bytes", "output_bytes")

# The zoo's nemotron-h and deepseek-v3-mini written as the Megatron arguments that build them.
NEMOTRON = ("--hybrid-layer-pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- --hidden-size 4096 "
            "--ffn-hidden-size 21504 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
            "--kv-channels 128 --vocab-size 131072 --mamba-state-dim 128 --mamba-num-heads 128 --mamba-head-dim 64 "
            "--mamba-num-groups 8 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 "
            "--tensor-model-parallel-size 2 --sequence-parallel --bf16 --normalization RMSNorm "
            "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --position-embedding-type rope").split()
DEEPSEEK = ("--num-layers 24 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 128 "
            "--vocab-size 129280 --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 "
            "--moe-shared-expert-intermediate-size 2816 --moe-layer-freq ([0]*2+[1]*22) --mtp-num-layers 1 "
            "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --swiglu --bf16 "
            "--normalization RMSNorm --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
            "--position-embedding-type rope").split()


def costs(model):
    return [tuple(getattr(layer, f) for f in COST) for layer in model.layers]


def test_megatron_arguments_give_the_zoo_models_costs():
    # Independent oracle: the zoo's architecture files, costed by the same analytic model.
    nemo = model_from_megatron(parse(NEMOTRON, octopipe=False, validate=False), name="nemotron-h",
                               arch_overrides={"mamba_chunk": 128})
    assert costs(nemo) == costs(resolve_model("nemotron-h"))
    ds = model_from_megatron(parse(DEEPSEEK, world=1, octopipe=False), name="deepseek-v3-mini")
    assert costs(ds) == costs(resolve_model("deepseek-v3-mini"))
    assert [layer.name for layer in ds.layers][:3] == ["embedding", "decoder.layers.0", "decoder.layers.1"]
    assert [layer.name for layer in ds.layers][-2:] == ["mtp.layers.0", "output_layer"]


def test_parallel_sizes_change_the_costs_as_the_cost_model_says():
    args = parse(DEEPSEEK + ["--expert-model-parallel-size", "4", "--use-distributed-optimizer",
                             "--context-parallel-size", "2"], world=8, octopipe=False, validate=False)
    arch = arch_from_megatron(args)
    assert (arch.ep, arch.dp, arch.seq_len) == (4, 4, 2048)  # CP shards the sequence; dp = 8 / cp
    want = resolve_model("deepseek-v3-mini", ep=4, dp=4, seq_len=2048)
    assert costs(model_from_megatron(args, name="deepseek-v3-mini")) == costs(want)


def test_measured_costs_replace_analytic_ones_by_name_then_kind():
    args = parse(DEEPSEEK, octopipe=False)
    plain = model_from_megatron(args)
    measured = model_from_megatron(args, measured={"moe": {"fwd_ms": 1.5}, "decoder.layers.5": {"fwd_ms": 9.0}})
    # layers 0..2: embedding and the two dense layers; decoder.layers.2 (index 3) is the first MoE layer
    assert [layer.fwd_ms for layer in measured.layers[:3]] == [layer.fwd_ms for layer in plain.layers[:3]]
    assert measured.layers[3].fwd_ms == 1.5 and measured.layers[6].fwd_ms == 9.0  # decoder.layers.2 / .5
    assert measured.layers[3].bwd_ms == plain.layers[3].bwd_ms and measured.meta["cost_model"] == "analytic+measured"
    with pytest.raises(OctoPipeError, match="no such layer or kind"):
        model_from_megatron(args, measured={"decoder.layers.99": {"fwd_ms": 1.0}})
    with pytest.raises(OctoPipeError, match="unknown field"):
        model_from_megatron(args, measured={"moe": {"fwd": 1.0}})


def test_transformer_config_with_run_sizes_and_megatron_layer_rules():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 0, 1, 1],
                               window_size=(8, 0), window_attn_skip_freq=3, mtp_num_layers=1)
    kinds = [s.kind for s in layer_specs(config)]
    # MoE where moe_layer_freq says; window attention except every 3rd layer (Megatron's is_layer_window_attention)
    assert kinds == ["embedding", "dense_local", "moe", "moe", "dense_local", "moe", "moe", "mtp", "lm_head"]
    model = model_from_megatron(config, seq_length=32, micro_batch_size=2, vocab_size=256)
    assert model.num_layers == 9 and all(layer.fwd_ms > 0 for layer in model.layers)
    with pytest.raises(OctoPipeError, match="seq_length"):
        model_from_megatron(config, micro_batch_size=2, vocab_size=256)


def test_hybrid_pattern_with_moe_and_mtp_and_an_unpriced_symbol():
    args = parse(["--hybrid-layer-pattern", "M*-E/*-", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                  "--vocab-size", "128", "--num-experts", "4", "--moe-router-topk", "2",
                  "--position-embedding-type", "rope"], octopipe=False, validate=False)
    assert [s.kind for s in layer_specs(args)] == ["embedding", "mamba", "attention", "mlp", "moe", "mtp", "lm_head"]
    model = model_from_megatron(args)
    # the hybrid 'E' layer is priced as experts without attention: a GPT MoE layer minus its attention block
    arch = arch_from_megatron(args)
    want = layer_cost(arch, "moe", "H100").fwd_ms - layer_cost(arch, "attention", "H100").fwd_ms
    assert model.layers[4].fwd_ms == pytest.approx(want)
    args.hybrid_layer_pattern = "M*G-"
    with pytest.raises(OctoPipeError, match="'G'.*measured"):
        layer_specs(args)


def test_tied_embedding_and_output_weights_follow_megatrons_untie_flag_and_mtp_depth_prices_the_head():
    tied = model_from_megatron(parse(DEEPSEEK, world=1, octopipe=False), name="deepseek-v3-mini")
    assert tied.tied == ((0, tied.num_layers - 1),)  # Megatron's default shares them
    untied = model_from_megatron(parse(DEEPSEEK + ["--untie-embeddings-and-output-weights"], world=1, octopipe=False))
    assert untied.tied == ()
    # --mtp-num-layers 1: the output layer projects the main and the MTP hidden states (the shared head)
    arch = arch_from_megatron(parse(DEEPSEEK, world=1, octopipe=False))
    assert arch.mtp_depth == 1 and tied.layers[-2].output_bytes == 2 * tied.layers[-3].output_bytes
