"""Properties of the analytic model over random architectures (bounded hypothesis examples)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe_plugin.costs import Arch, layer_cost
from octopipe_plugin.costs.arch import check_arch

KINDS = ("embedding", "dense", "dense_local", "moe", "mamba", "attention", "mlp", "mtp", "vision", "projector",
         "lm_head")


@st.composite
def archs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    hidden = heads * head_dim
    arch = Arch(name="r", num_layers=4, hidden=hidden, ffn=tp * draw(st.integers(16, 512)) * 4, heads=heads,
                kv_heads=tp, head_dim=head_dim, vocab=draw(st.integers(1000, 300_000)),
                seq_len=tp * 128 * draw(st.integers(1, 16)), micro_batch_size=draw(st.integers(1, 4)), tp=tp,
                num_experts=8, top_k=draw(st.integers(1, 8)), shared_experts=draw(st.integers(0, 2)),
                moe_ffn=tp * 64, sliding_window=draw(st.sampled_from([64, 256, 4096])), mamba_heads=tp * 8,
                mamba_groups=tp, mtp_depth=1, vision_layers=1, vision_hidden=256, vision_ffn=1024,
                vision_heads=tp * 2, vision_tokens=64, recompute=draw(st.booleans()))
    check_arch(arch)
    return arch


@settings(max_examples=25, deadline=None)
@given(archs())
def test_every_kind_has_finite_nonnegative_costs_and_backward_at_least_forward_flops(arch):
    for kind in KINDS:
        c = layer_cost(arch, kind)
        assert min(c.fwd_ms, c.bwd_ms, c.wgrad_ms) >= 0 and c.fwd_ms > 0
        assert c.state_bytes > 0 and c.activation_bytes > 0 and c.output_bytes > 0
        f, i, w = c.flops
        assert i + w >= f * 0.999 and w <= f * 1.001  # backward = 2x forward for weights, more for attention


@settings(max_examples=20, deadline=None)
@given(archs())
def test_doubling_the_micro_batch_doubles_flops_and_activations_but_not_state(arch):
    double = dataclasses.replace(arch, micro_batch_size=2 * arch.micro_batch_size)
    for kind in ("dense", "moe", "mamba", "lm_head", "vision"):
        one, two = layer_cost(arch, kind), layer_cost(double, kind)
        assert two.state_bytes == one.state_bytes
        assert abs(two.flops[0] - 2 * one.flops[0]) <= 1e-9 * two.flops[0]
        assert abs(two.activation_bytes - 2 * one.activation_bytes) <= 8
        assert two.fwd_ms > one.fwd_ms


@settings(max_examples=20, deadline=None)
@given(archs())
def test_full_recompute_trades_activation_memory_for_input_grad_time(arch):
    on, off = dataclasses.replace(arch, recompute=True), dataclasses.replace(arch, recompute=False)
    for kind in ("dense", "dense_local", "moe", "mamba", "attention", "mlp", "vision"):
        a, b = layer_cost(on, kind), layer_cost(off, kind)
        assert a.activation_bytes < b.activation_bytes
        assert abs(a.bwd_ms - (b.bwd_ms + b.fwd_ms)) < 1e-9
