"""What the profiler records for W's graph walk: the nodes a layer adds, and a walk figure where W walks."""

import pytest
import torch
from torch import nn

from octopipe_plugin.costs import load_arch
from octopipe_plugin.profile import measure_layer
from octopipe_plugin.profile.measure import LayerProfile, graph_nodes
from octopipe_plugin.profile.profiler import profiled_layer
from octopipe_plugin.profile.torch_layers import builders, hidden_input, token_input

CPU = torch.device("cpu")
ARCH = load_arch("deepseek-v3-mini", hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=0, seq_len=16,
                 micro_batch_size=1, vocab=256, num_layers=2, num_experts=4, top_k=2, shared_experts=1, moe_ffn=32,
                 first_dense_layers=1, moe_layer_freq=1, mtp_depth=0)


def test_graph_nodes_count_each_node_once_and_add_up_over_a_stack():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    # AddmmBackward, TBackward and the weight's and the bias's accumulators; the input's own is not counted
    assert graph_nodes(lin(x), x) == 4
    make = builders(ARCH)["moe"]
    a, b = make(), make()
    h = hidden_input(ARCH, torch.float32)(CPU).requires_grad_(True)
    one = graph_nodes(a(h), h)
    assert graph_nodes(b(a(h)), h) == one + graph_nodes(b(h), h)  # what a layer above a stack walks over
    assert graph_nodes(b(h), h) == one  # routing is per token, the graph's shape is not


def test_a_float_fed_layer_with_weights_records_both_figures_and_they_reach_the_model():
    prof = measure_layer(builders(ARCH)["moe"](), hidden_input(ARCH, torch.float32)(CPU), CPU, warmup=1,
                         repeats=2, walk_nodes=50)
    assert prof.graph_nodes > 50 and prof.walk_ms_per_node is not None and prof.walk_ms_per_node >= 0
    layer = profiled_layer("l", "moe", prof)
    assert (layer.graph_nodes, layer.walk_ms_per_node) == (prof.graph_nodes, prof.walk_ms_per_node)
    back = LayerProfile.from_dict(prof.to_dict())  # the cache's record keeps them
    assert (back.graph_nodes, back.walk_ms_per_node) == (prof.graph_nodes, prof.walk_ms_per_node)


@pytest.mark.parametrize("case", ["token ids", "no weights", "walk off"])
def test_no_walk_figure_where_w_walks_nothing_or_it_is_off(case):
    if case == "token ids":  # the executor runs an integer-fed stage's whole backward as one W pass
        prof = measure_layer(builders(ARCH)["embedding"](), token_input(ARCH)(CPU), CPU, warmup=0, repeats=1)
        assert prof.graph_nodes is None and prof.walk_ms_per_node is None
        return
    module = nn.GELU() if case == "no weights" else builders(ARCH)["dense"]()
    prof = measure_layer(module, hidden_input(ARCH, torch.float32)(CPU), CPU, warmup=0, repeats=1,
                         walk_nodes=0 if case == "walk off" else 50)
    assert prof.walk_ms_per_node is None and prof.graph_nodes is not None
