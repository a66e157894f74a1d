"""Every zoo model builds, matches its published size, is heterogeneous in its family's way, and fits 8 H100s."""

import statistics

import pytest

from octopipe_plugin.costs import ZOO, get_gpu, layer_cost, layer_plan, load_arch, resolve_model
from octopipe_plugin.formats import model_from_dict, model_to_dict
from octopipe_plugin.graph import ModelGraph

FIRST = {"embedding", "vision", "projector"}
LAST = {"mtp", "lm_head"}


def by_kind(model):
    out = {}
    for layer in model.layers:
        out.setdefault(layer.kind, []).append(layer)
    return out


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_builds_with_positive_costs_and_round_trips(name):
    model = resolve_model(name, "H100")
    assert model.name == name and model.layers[-1].kind == "lm_head"
    for layer in model.layers:
        assert layer.fwd_ms > 0 and layer.bwd_ms >= 0 and layer.wgrad_ms > 0
        assert layer.state_bytes > 0 and layer.activation_bytes > 0 and layer.output_bytes > 0
    assert model_from_dict(model_to_dict(model)) == model


@pytest.mark.parametrize("name,published,tied", [
    ("llama2-7b", 6_738_415_616, False),  # Hugging Face meta-llama/Llama-2-7b-hf
    ("llama3-8b", 8_030_261_248, False),  # meta-llama/Meta-Llama-3-8B
    ("gemma3", 3.88e9, True),  # Gemma 3 4B language model (tied embeddings, counted once)
    ("nemotron-h", 8.1e9, False),  # Nemotron-H-8B
])
def test_parameter_count_matches_published_model(name, published, tied):
    arch = load_arch(name, tp=1)  # whole-model parameters (per-rank counts divide by tp)
    total = sum(layer_cost(arch, kind).params for _, kind in layer_plan(arch))
    if tied:
        total -= layer_cost(arch, "lm_head").params
    assert total == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", ["llama3-8b", "gemma3", "vlm", "nemotron-h"])
def test_large_vocabulary_head_costs_more_than_one_decoder_layer(name):
    kinds = by_kind(resolve_model(name))
    decoder = max(layers[0].total_ms for kind, layers in kinds.items() if kind not in FIRST | LAST)
    assert kinds["lm_head"][0].total_ms > decoder
    assert kinds["lm_head"][0].fwd_ms > decoder


def test_llama2_is_the_homogeneous_control():
    model = resolve_model("llama2-7b")
    kinds = by_kind(model)
    assert set(kinds) == {"embedding", "dense", "lm_head"}
    assert len({(x.fwd_ms, x.state_bytes) for x in kinds["dense"]}) == 1
    assert kinds["lm_head"][0].total_ms < kinds["dense"][0].total_ms  # 32k vocabulary: no heavy head
    assert ModelGraph(model).heaviest().ratio_to_median == pytest.approx(1.0)


def test_gemma3_five_local_to_one_global_and_global_costlier_at_long_sequence():
    model = resolve_model("gemma3")
    kinds = [x.kind for x in model.layers if x.kind in ("dense", "dense_local")]
    assert kinds[:6] == ["dense_local"] * 5 + ["dense"]
    assert kinds.count("dense") == 34 // 6 and len(kinds) == 34
    k = by_kind(model)
    assert k["dense"][0].fwd_ms > k["dense_local"][0].fwd_ms and k["dense"][0].bwd_ms > k["dense_local"][0].bwd_ms
    assert load_arch("gemma3").seq_len >= 8 * load_arch("gemma3").sliding_window
    assert load_arch("gemma3").vocab >= 256_000


def test_deepseek_mini_dense_first_then_moe_then_mtp():
    model = resolve_model("deepseek-v3-mini")
    kinds = [x.kind for x in model.layers]
    arch = load_arch("deepseek-v3-mini")
    assert kinds[1:1 + arch.first_dense_layers] == ["dense"] * arch.first_dense_layers
    assert set(kinds[1 + arch.first_dense_layers:-2]) == {"moe"}
    assert kinds[-2:] == ["mtp", "lm_head"]
    k = by_kind(model)
    assert k["moe"][0].state_bytes > 3 * k["dense"][0].state_bytes  # experts: many parameters, few active
    assert k["moe"][0].total_ms > k["dense"][0].total_ms
    # the shared output head of the main model and the MTP depth both run in lm_head (DeepSeek-V3 Sec. 2.2)
    assert k["lm_head"][0].total_ms > 5 * k["mtp"][0].total_ms > 5 * k["moe"][0].total_ms


def test_nemotron_h_hybrid_pattern_mamba_differs_from_attention():
    model = resolve_model("nemotron-h")
    k = by_kind(model)
    assert (len(k["mamba"]), len(k["attention"]), len(k["mlp"])) == (24, 4, 24)
    mamba, attn = k["mamba"][0], k["attention"][0]
    assert mamba.state_bytes > attn.state_bytes and mamba.activation_bytes > attn.activation_bytes
    assert attn.bwd_ms / attn.fwd_ms > mamba.bwd_ms / mamba.fwd_ms  # attention's scores have no weight grad


def test_vlm_vision_branch_feeds_the_first_decoder_layer():
    model = resolve_model("vlm")
    g = ModelGraph(model)
    emb = next(i for i, x in enumerate(model.layers) if x.kind == "embedding")
    proj = next(i for i, x in enumerate(model.layers) if x.kind == "projector")
    assert not g.is_chain and g.sources() == [0, emb]
    assert set(g.graph.predecessors(emb + 1)) == {proj, emb}
    assert g.cut_bytes(emb + 1) == model.layers[proj].output_bytes + model.layers[emb].output_bytes
    k = by_kind(model)
    assert k["vision"][0].total_ms * 10 < k["dense"][0].total_ms


def even_split(model, stages):
    """Megatron's default: first-stage extras, last-stage extras, decoder layers as even as possible."""
    idx = [i for i, x in enumerate(model.layers) if x.kind not in FIRST | LAST]
    first = [i for i, x in enumerate(model.layers) if x.kind in FIRST]
    last = [i for i, x in enumerate(model.layers) if x.kind in LAST]
    q, r = divmod(len(idx), stages)
    groups, start = [], 0
    for s in range(stages):
        size = q + (1 if s < r else 0)
        groups.append(idx[start:start + size])
        start += size
    groups[0] = first + groups[0]
    groups[-1] = groups[-1] + last
    return groups


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("gpus_per_stage", ["one", "tp"])
def test_even_split_on_eight_h100_fits_with_1f1b_activations(name, gpus_per_stage):
    model, memory = resolve_model(name, "H100"), get_gpu("H100").memory_bytes
    p = 8 if gpus_per_stage == "one" else 8 // load_arch(name).tp  # 8 pipeline ranks, or 8 GPUs in all
    for s, group in enumerate(even_split(model, p)):
        state = sum(model.layers[i].state_bytes for i in group)
        act = sum(model.layers[i].activation_bytes for i in group)
        assert state + (p - s) * act < 0.85 * memory, (name, s)  # 1F1B: stage s holds p - s micro-batches


def test_overrides_change_costs_as_expected():
    base = by_kind(resolve_model("llama3-8b"))["dense"][0]
    short = by_kind(resolve_model("llama3-8b", seq_len=4096))["dense"][0]
    assert short.activation_bytes < base.activation_bytes and short.fwd_ms < base.fwd_ms
    rec = by_kind(resolve_model("llama3-8b", recompute=True))["dense"][0]
    assert rec.activation_bytes == 8192 * 4096 * 2 and rec.bwd_ms == pytest.approx(base.bwd_ms + base.fwd_ms)
    sharded = by_kind(resolve_model("llama3-8b", dp=8))["dense"][0]
    assert sharded.state_bytes == pytest.approx(base.state_bytes * (6 + 12 / 8) / 18, rel=1e-6)
    meds = [statistics.median(x.total_ms for x in resolve_model("llama3-8b", gpu=g).layers) for g in ("A100", "B200")]
    assert meds[0] > meds[1]


def test_tied_models_name_their_embedding_and_head_pair():
    gemma = resolve_model("gemma3")
    assert gemma.tied == ((0, gemma.num_layers - 1),)
    assert resolve_model("llama3-8b").tied == () and resolve_model("deepseek-v3-mini").tied == ()
    assert resolve_model("gemma3", tie_embeddings=False).tied == ()
