"""MoE layers' phases in the analytic model: the all-to-all's time from the EP group's links, by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.costs.analytic import build_model, layer_cost
from octopipe_plugin.costs.arch import arch_from_dict
from octopipe_plugin.costs.zoo import load_arch
from octopipe_plugin.errors import FormatError
from octopipe_plugin.gpus import get_gpu


def _moe(arch):
    return layer_cost(arch, "moe", "H100", calibrated=False)


def test_no_phases_without_expert_parallelism():
    arch = load_arch("deepseek-v3-mini")
    assert _moe(arch).phases == ()
    assert all(not layer.phases for layer in build_model(arch, "H100").layers)


@pytest.mark.parametrize("ep,nodes", [(8, 1), (8, 2), (4, 4)])
def test_alltoall_phases_by_hand(ep, nodes):
    arch = replace(load_arch("deepseek-v3-mini"), ep=ep, ep_nodes=nodes)
    cost, gpu = _moe(arch), get_gpu("H100")
    names = [p.name for p in cost.phases]
    assert names == ["attention+router", "dispatch", "experts", "combine", "combine-out+shared experts"]
    assert [p.resource for p in cost.phases] == ["compute", "comm", "compute", "comm", "compute"]
    routed = arch.tokens * arch.top_k * arch.hidden * arch.dtype_bytes  # every routed copy, its own share included
    per_node = ep // nodes
    intra = routed * (per_node - 1) / ep / (gpu.nvlink_gb_per_s * 1e9)
    inter = routed * (ep - per_node) / ep / (gpu.ib_gb_per_s * 1e9)
    want = max(intra, inter) * 1e3
    for p in (cost.phases[1], cost.phases[3]):
        assert p.fwd_ms == pytest.approx(want) and p.bwd_ms == pytest.approx(want)
    assert cost.fwd_ms == pytest.approx(sum(p.fwd_ms for p in cost.phases))
    assert cost.bwd_ms == pytest.approx(sum(p.bwd_ms for p in cost.phases))
    # the compute phases are the layer without expert parallelism (the experts' weights read aside)
    alone = _moe(replace(arch, ep=1, ep_nodes=1))
    compute = sum(p.fwd_ms for p in cost.phases if p.resource == "compute")
    assert compute == pytest.approx(alone.fwd_ms, rel=0.02)


def test_recompute_adds_each_phase_forward_to_its_backward():
    arch = replace(load_arch("deepseek-v3-mini"), ep=8, ep_nodes=2)
    plain, rec = _moe(arch), _moe(replace(arch, recompute=True))
    for a, b in zip(plain.phases, rec.phases):
        assert b.bwd_ms == pytest.approx(a.bwd_ms + a.fwd_ms)
    assert rec.bwd_ms == pytest.approx(plain.bwd_ms + plain.fwd_ms)


def test_ep_nodes_must_divide_ep():
    base = {"name": "x", "num_layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 1000,
            "num_experts": 8, "top_k": 2, "ep": 4}
    assert arch_from_dict({**base, "ep_nodes": 2}).ep_nodes == 2
    with pytest.raises(FormatError, match=r"\$\.ep_nodes.*divisor of ep=4"):
        arch_from_dict({**base, "ep_nodes": 3})
