"""LayerSpec list -> OctoPipe model: analytic costs from octopipe_plugin.costs, refusals, supplied costs."""

import pytest
import torch
from torch import nn

from octopipe_plugin.adapters.deepspeed.graph import model_from_specs
from octopipe_plugin.costs.analytic import layer_cost
from octopipe_plugin.costs.arch import Arch
from octopipe_plugin.costs.ops import matmul, total_times
from octopipe_plugin.gpus import get_gpu
from octopipe_plugin.errors import OctoPipeError

pytestmark = pytest.mark.framework


class Opaque(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))


def _specs():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("emb", nn.Embedding, 32000, 1024),
            LayerSpec(nn.TransformerEncoderLayer, 1024, 16, dim_feedforward=4096),
            lambda x: x,
            LayerSpec(nn.LayerNorm, 1024),
            LayerSpec(nn.Linear, 1024, 1024, bias=False),
            TiedLayerSpec("emb", nn.Embedding, 32000, 1024, forward_fn=lambda m, x: x @ m.weight.t())]


def test_layer_specs_costed_with_the_analytic_model():
    model = model_from_specs(_specs(), seq_len=512, micro_batch_size=2, gpu="H100")
    assert [l.kind for l in model.layers] == ["embedding", "dense", "function", "norm", "linear", "lm_head"]
    arch = Arch(name="x", num_layers=1, hidden=1024, ffn=4096, heads=16, vocab=32000, seq_len=512, micro_batch_size=2,
                gated_mlp=False, layernorm=True, bias=True, rope=False, flash_attention=False)
    dense = layer_cost(arch, "dense", "H100")
    assert (model.layers[1].fwd_ms, model.layers[1].bwd_ms, model.layers[1].wgrad_ms) == (dense.fwd_ms, dense.bwd_ms,
                                                                                            dense.wgrad_ms)
    f, i, w = total_times([matmul("x", 1024, 1024, 1024, 2)], get_gpu("H100"))
    assert (model.layers[4].fwd_ms, model.layers[4].bwd_ms, model.layers[4].wgrad_ms) == (f, i, w)
    assert model.layers[2].total_ms == 0 and model.layers[2].output_bytes == model.layers[1].output_bytes
    assert model.layers[5].fwd_ms > model.layers[0].fwd_ms  # the head's matmul over the vocabulary


def test_unknown_layer_named_and_supplied_costs_used():
    from deepspeed.pipe import LayerSpec

    specs = _specs()[:2] + [LayerSpec(Opaque, 8)]
    with pytest.raises(OctoPipeError, match=r"layer 2 \(Opaque\): the analytic cost model does not recognise.*costs="):
        model_from_specs(specs)
    measured = dict(fwd_ms=1.5, bwd_ms=1.0, wgrad_ms=0.5, state_bytes=10, activation_bytes=20, output_bytes=30)
    by_index = model_from_specs(specs, costs={2: measured})
    by_type = model_from_specs(specs, costs={"Opaque": lambda spec, j: measured})
    assert by_index.layers[2].fwd_ms == by_type.layers[2].fwd_ms == 1.5
    assert by_index.layers[2].source == "measured"
