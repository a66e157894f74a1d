"""A split layer's shard weights sit in the parameter groups of the weight they are rows of.

Megatron's LanguageModule marks the output layer's and the word embedding's weights
`is_embedding_or_output_parameter` (and, under MuP, `is_embedding_parameter`); --decoupled-lr's
optimizer override (`ParamKey(attr="is_embedding_or_output_parameter")`), Muon's and MuP's grouping
read it. A HeadShard / EmbeddingShard replaces those modules before the optimizer is built, so its
weight must carry the same marks, or its rows train at the hidden layers' learning rate.
Oracle: Megatron's own ParamKey matching on its real optimizer config override.
"""

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.framework

pytest.importorskip("megatron.core")


def _config(**over):
    return SimpleNamespace(**{"params_dtype": torch.float32, "use_cpu_initialization": True, "use_mup": False, **over})


@pytest.mark.parametrize("mup", [False, True])
def test_shard_weights_match_megatron_s_decoupled_lr_key(mup):
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    from octopipe_plugin.adapters.megatron.split_embedding import EmbeddingShard
    from octopipe_plugin.adapters.megatron.vocab_shards import HeadShard

    overrides = get_standard_config_overrides(OptimizerConfig(lr=1e-3, decoupled_lr=5e-4))
    keys = [k for k, v in overrides.items() if v.get("max_lr") == 5e-4]
    assert keys, overrides  # Megatron's own --decoupled-lr override
    config = _config(use_mup=mup)
    for shard, name in ((HeadShard(config, vocab_size=16, hidden_size=4, rows=(4, 12)), "output_layer.weight"),
                        (EmbeddingShard(config, vocab_size=16, hidden_size=4, rows=(0, 4)),
                         "embedding.word_embeddings.weight")):
        assert any(k.matches(shard.weight, name) for k in keys), name
        assert getattr(shard.weight, "is_embedding_parameter", False) is mup
    hidden = torch.nn.Parameter(torch.zeros(4, 4))
    assert not any(k.matches(hidden, "decoder.layers.0.mlp.linear_fc1.weight") for k in keys)
