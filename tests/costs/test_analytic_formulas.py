"""Analytic costs against values computed here, independently, from each formula's source."""

import dataclasses

import pytest

from octopipe_plugin.costs import Arch, get_gpu, layer_cost
from octopipe_plugin.costs.analytic import build_model, output_bytes
from octopipe_plugin.costs.mamba import ssd_flops

H100 = get_gpu("H100")


def gpt(**kw) -> Arch:
    """A GPT-3-style layer exactly as Korthikanti et al. / Narayanan et al. assume it."""
    base = dict(name="gpt", num_layers=2, hidden=1024, ffn=4096, heads=16, vocab=50257, seq_len=2048,
                micro_batch_size=2, gated_mlp=False, bias=True, layernorm=True, rope=False, dropout=True,
                flash_attention=False)
    base.update(kw)
    return Arch(**base)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_dense_activation_is_korthikanti_table2_with_sequence_parallel(t):
    a = gpt(tp=t)
    s, b, h, heads = a.seq_len, a.micro_batch_size, a.hidden, a.heads
    expected = s * b * h * (34 + 5 * heads * s / h) / t  # Korthikanti et al. 2022, Table 2, TP + SP
    assert layer_cost(a, "dense").activation_bytes == pytest.approx(expected, rel=0, abs=0.5)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_dense_activation_is_korthikanti_table2_without_sequence_parallel(t):
    a = gpt(tp=t, sequence_parallel=False)
    s, b, h, heads = a.seq_len, a.micro_batch_size, a.hidden, a.heads
    expected = s * b * h * (10 + 24 / t + 5 * heads * s / (h * t))  # Korthikanti et al. 2022, Table 2, TP only
    assert layer_cost(a, "dense").activation_bytes == pytest.approx(expected, rel=0, abs=0.5)


def test_flash_attention_drops_the_s_squared_term_and_full_recompute_keeps_only_the_input():
    a = gpt(flash_attention=True, tp=2)
    s, b, h, heads = a.seq_len, a.micro_batch_size, a.hidden, a.heads
    lse = 4 * s * b * heads // 2  # fp32 log-sum-exp per query row and head
    assert layer_cost(a, "dense").activation_bytes == s * b * h * 34 // 2 + lse
    rec = layer_cost(dataclasses.replace(a, recompute=True), "dense")
    assert rec.activation_bytes == 2 * s * b * h // 2  # 2sbh / t (Korthikanti Sec. 4.1)


def test_gpt_layer_parameters_are_12h2_plus_13h_and_state_is_18_bytes_each():
    a = gpt()
    h = a.hidden
    c = layer_cost(a, "dense")
    assert c.params == 12 * h * h + 13 * h  # Narayanan et al. 2021, Sec. 5.1
    assert c.state_bytes == 18 * c.params
    sharded = layer_cost(dataclasses.replace(a, dp=4), "dense")
    assert sharded.state_bytes == int((6 + 12 / 4) * c.params)  # Megatron distributed optimizer: 6 + 12/d


def test_gpt_layer_flops_are_narayanan_24bsh2_plus_4bs2h():
    a = gpt()
    s, b, h = a.seq_len, a.micro_batch_size, a.hidden
    f, i, w = layer_cost(a, "dense").flops
    assert f == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    assert w == pytest.approx(24 * b * s * h * h)  # only weight matmuls have a weight gradient
    assert i == pytest.approx(24 * b * s * h * h + 8 * b * s * s * h)  # attention's backward is all I
    assert f + i + w == pytest.approx(72 * b * s * h * h * (1 + s / (6 * h)))  # Narayanan eq. (3) without recompute


def llama(**kw) -> Arch:
    base = dict(name="small", num_layers=4, hidden=512, ffn=1376, heads=8, kv_heads=2, head_dim=64, vocab=32000,
                seq_len=1024, micro_batch_size=2)
    base.update(kw)
    return Arch(**base)


def _attention_flops(n, h, heads, groups, d, b, key_sum):
    qkv = 2 * n * h * (heads + 2 * groups) * d
    core = 4 * b * heads * d * key_sum  # QK^T and PV over every (query, attended key) pair
    proj = 2 * n * heads * d * h
    return qkv + proj, core


@pytest.mark.parametrize("window", [0, 128])
def test_gqa_causal_flash_layer_flops(window):
    a = llama(sliding_window=window)
    kind = "dense_local" if window else "dense"
    s, b, h, f = a.seq_len, a.micro_batch_size, a.hidden, a.ffn
    key_sum = sum(min(i + 1, window) if window else i + 1 for i in range(s))
    weights, core = _attention_flops(s * b, h, a.heads, a.kv_heads, a.head_dim, b, key_sum)
    mlp = 2 * s * b * h * 2 * f + 2 * s * b * f * h  # SwiGLU: gate and up, then down
    fi, ii, wi = layer_cost(a, kind).flops
    assert fi == pytest.approx(weights + core + mlp)
    assert ii == pytest.approx(weights + mlp + 2.5 * core)  # FlashAttention-2 backward: 2.5x its forward
    assert wi == pytest.approx(weights + mlp)


def test_global_attention_costs_more_than_local_at_long_sequence():
    a = llama(seq_len=8192, sliding_window=512)
    glob, loc = layer_cost(a, "dense"), layer_cost(a, "dense_local")
    assert glob.fwd_ms > loc.fwd_ms and glob.bwd_ms > loc.bwd_ms
    assert glob.wgrad_ms == pytest.approx(loc.wgrad_ms)  # same weights


def test_moe_layer_flops_and_parameters():
    a = llama(num_experts=8, top_k=2, shared_experts=1, moe_ffn=256)
    s, b, h = a.seq_len, a.micro_batch_size, a.hidden
    n, e, k, fe = s * b, 8, 2, 256
    weights, core = _attention_flops(n, h, a.heads, a.kv_heads, a.head_dim, b, sum(i + 1 for i in range(s)))
    routed = 2 * (n * k) * h * 2 * fe + 2 * (n * k) * fe * h  # each token through top-k SwiGLU experts
    shared = 2 * n * h * 2 * fe + 2 * n * fe * h
    router = 2 * n * h * e
    f, _, w = layer_cost(a, "moe").flops
    assert f == pytest.approx(weights + core + router + routed + shared)
    assert w == pytest.approx(weights + router + routed + shared)
    attn_params = h * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * h + h
    expected = attn_params + h + h * e + e * 3 * h * fe + 3 * h * fe
    assert layer_cost(a, "moe").params == expected


def test_mamba2_layer_flops_and_parameters():
    a = llama(hybrid_pattern="M*-", num_layers=3, mamba_state=64, mamba_heads=16, mamba_head_dim=64,
              mamba_groups=2, mamba_chunk=256)
    s, b, h = a.seq_len, a.micro_batch_size, a.hidden
    n, heads, p, g, st, q = s * b, 16, 64, 2, 64, 256
    di = heads * p
    # SSD per chunk and head (Dao and Gu 2024, Sec. 6): CB^T, masked (CB^T)X, chunk states, state output
    ssd = b * (s // q) * heads * (2 * q * q * st + 2 * q * q * p + 2 * q * st * p + 2 * q * st * p)
    assert ssd_flops(s, heads, p, st, q) * b == pytest.approx(ssd)
    in_proj = 2 * n * h * (2 * di + 2 * g * st + heads)
    conv = 2 * n * (di + 2 * g * st) * a.mamba_conv
    out_proj = 2 * n * di * h
    f, i, w = layer_cost(a, "mamba").flops
    assert f == pytest.approx(in_proj + conv + ssd + out_proj)
    assert w == pytest.approx(in_proj + out_proj)
    params = h + h * (2 * di + 2 * g * st + heads) + (di + 2 * g * st) * (a.mamba_conv + 1) + 3 * heads + di + di * h
    assert layer_cost(a, "mamba").params == params


def test_embedding_is_memory_bound_gather_with_vocab_state():
    a = llama()
    c = layer_cost(a, "embedding")
    n, h = a.tokens, a.hidden
    assert c.params == 32000 * h and c.state_bytes == 18 * 32000 * h
    assert c.fwd_ms == pytest.approx(2 * n * h * 2 / H100.hbm_bytes_per_s * 1e3)  # read + write n*h bf16
    assert c.bwd_ms == 0  # token ids have no gradient
    assert c.wgrad_ms > c.fwd_ms


def test_lm_head_matmul_and_fp32_softmax():
    a = llama(vocab=50257, tp=2)
    assert a.padded_vocab == 50432  # Megatron pads to a multiple of 128 * tp
    assert llama(vocab=50257).padded_vocab == 50304
    c = layer_cost(a, "lm_head")
    n, h, v = a.tokens, a.hidden, 50432 // 2
    assert c.flops[0] == pytest.approx(2 * n * h * v) and c.flops[2] == pytest.approx(2 * n * h * v)
    assert c.activation_bytes == 2 * (n * h * 2 // 2) + 4 * n * v  # norm and matmul inputs (SP), fp32 softmax
    assert c.params == h + h * v


def test_vision_layer_is_bidirectional_and_projector_is_two_matmuls():
    a = llama(vision_layers=2, vision_hidden=256, vision_ffn=1024, vision_heads=4, vision_tokens=512,
              vision_tiles=2)
    b, sv, hv = a.micro_batch_size * 2, 256, 256
    nv = b * sv
    weights = 2 * nv * hv * 3 * hv + 2 * nv * hv * hv
    core = 4 * b * 4 * (hv // 4) * sv * sv  # every patch attends to every patch of its tile
    mlp = 2 * nv * hv * 1024 * 2
    assert layer_cost(a, "vision").flops[0] == pytest.approx(weights + core + mlp)
    assert layer_cost(a, "projector").flops[0] == pytest.approx(2 * 1024 * hv * a.hidden + 2 * 1024 * a.hidden ** 2)


def test_mtp_holds_a_transformer_layer_and_the_lm_head_every_depths_output_head():
    # DeepSeek-V3 Sec. 2.2: the MTP modules share the main model's output head, so its projection and loss
    # for every depth's hidden states are the lm_head layer's work (one weight, 1 + depth hidden inputs)
    a = llama(num_experts=8, top_k=2, moe_ffn=256, mtp_depth=1)
    plain = dataclasses.replace(a, mtp_depth=0)
    mtp, head, moe = (layer_cost(a, k) for k in ("mtp", "lm_head", "moe"))
    one = layer_cost(plain, "lm_head")
    n, h = a.tokens, a.hidden
    assert mtp.flops[0] == pytest.approx(moe.flops[0] + 2 * n * 2 * h * h)  # + the eh projection 2h -> h
    assert mtp.fwd_ms > moe.fwd_ms
    assert head.flops == pytest.approx(tuple(2 * f for f in one.flops))
    assert head.fwd_ms == pytest.approx(2 * one.fwd_ms) and head.activation_bytes == 2 * one.activation_bytes
    assert one.state_bytes < head.state_bytes < 1.001 * one.state_bytes  # one weight; a final norm per depth
    # the MTP layer of depth k sends the main hidden states and those of depths 0..k on to the head
    assert mtp.output_bytes == 2 * n * h * a.dtype_bytes
    assert output_bytes(dataclasses.replace(a, mtp_depth=2), "mtp", 1) == 3 * n * h * a.dtype_bytes
    deep = build_model(dataclasses.replace(a, mtp_depth=2))
    assert [x.output_bytes // (n * h * a.dtype_bytes) for x in deep.layers[-3:-1]] == [2, 3]
    assert deep.layers[-1].fwd_ms == pytest.approx(3 * one.fwd_ms)


def test_roofline_bounds_and_recompute_moves_forward_into_input_grad():
    a = llama(seq_len=4096)
    c = layer_cost(a, "dense")
    assert c.fwd_ms >= c.flops[0] / H100.flops * 1e3
    assert c.wgrad_ms == pytest.approx(c.flops[2] / H100.flops * 1e3, rel=0.05)
    r = layer_cost(dataclasses.replace(a, recompute=True), "dense")
    assert r.bwd_ms == pytest.approx(c.bwd_ms + c.fwd_ms) and r.fwd_ms == c.fwd_ms and r.wgrad_ms == c.wgrad_ms
    head = layer_cost(dataclasses.replace(a, recompute=True), "lm_head")
    assert head.activation_bytes == layer_cost(a, "lm_head").activation_bytes  # Megatron recomputes blocks only


def test_tensor_parallel_halves_weights_and_adds_communication():
    one, two = llama(seq_len=4096), llama(seq_len=4096, tp=2)
    c1, c2 = layer_cost(one, "dense"), layer_cost(two, "dense")
    assert c2.params == pytest.approx(c1.params / 2, rel=0.01)
    assert c1.fwd_ms / 2 < c2.fwd_ms < c1.fwd_ms
    assert c2.output_bytes == c1.output_bytes // 2  # sequence-parallel p2p sends s/t * b * h


def test_faster_gpus_are_faster():
    a = llama(seq_len=4096)
    times = [layer_cost(a, "dense", g).fwd_ms for g in ("A100", "H100", "H200", "B200")]
    assert times[0] > times[1] >= times[2] > times[3]
