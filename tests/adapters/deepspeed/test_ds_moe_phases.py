"""DeepSpeed MoE entries as phases (adapters/deepspeed/moe_pairs.py), in one process: the phases compute what
`MoE.forward` computes (outputs, l_aux, gradients), the LayerSpec list's model gives MoE entries their
communication phases (graph.py) so a pair of their stages hides time, and what the engine refuses beside pairs.
The 4-rank equality with DeepSpeed's own engine at EP 2 is test_ds_engine_4ranks.py's `moe_` scenarios."""

import re
from types import SimpleNamespace

import pytest
import torch

import ds_moe_harness as MH

pytestmark = pytest.mark.framework


def _moe(**kw):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    args = dict(num_experts=4, ep_size=1, k=1, capacity_factor=1.0, min_capacity=2, use_rts=False)
    args.update(kw)
    return MoE(MH.HID, MH.expert(), **args)


def test_moe_phases_compute_what_moe_forward_computes():
    from octopipe_plugin.adapters.deepspeed.moe_pairs import moe_phases

    moe = _moe()
    for i, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):  # distinct experts: routing shows
        for p in ex.parameters():
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(i))
    x = torch.randn(MH.MBS, MH.SEQ, MH.HID, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, l_aux, counts = moe(x)
    (out.square().sum() + l_aux).backward()
    theirs = {n: p.grad.clone() for n, p in moe.named_parameters()}
    dx = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    phases = moe_phases(moe, entry=1)
    assert [p.comm for p in phases] == [False, False, False]  # EP 1: no exchange
    value = (x,)
    for ph in phases:
        value = ph.fn(*value)
        value = value if isinstance(value, tuple) else (value,)
    out2, l_aux2, counts2 = value
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    assert torch.equal(counts2, counts) and float(l_aux2.detach()) == float(l_aux.detach())
    (out2.square().sum() + l_aux2).backward()
    for n, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, theirs[n], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, dx, rtol=0, atol=0)
    assert moe.deepspeed_moe.l_aux is l_aux2  # as MOELayer.forward leaves them
    moe2 = _moe(ep_size=2)  # EP 2: the two exchanges between gate, experts and combine
    moe2.deepspeed_moe.ep_group = object()
    assert [p.comm for p in moe_phases(moe2, entry=1)] == [False, True, False, True, False]


def test_layer_list_model_gives_moe_entries_phases_a_pair_hides():
    from octopipe_plugin.adapters.deepspeed.graph import model_from_specs
    from octopipe_plugin.adapters.deepspeed.moe_pairs import moe_entries
    from octopipe_plugin.adapters.deepspeed.plan_check import RunShape, check_plan
    from octopipe_plugin.formats.plan import plan_from_dict
    from octopipe_plugin.simulator.pairs import hidden_ms, stage_phases

    with torch.device("meta"):
        specs = MH.layer_specs()
    assert moe_entries(specs) == frozenset(MH.MOE_ENTRIES)
    from octopipe_plugin.adapters.deepspeed.moe_pairs import expert_groups

    assert expert_groups(specs) == [(MH.EP, False)]  # made on every rank (module.set_deepspeed_parallelism)
    model = model_from_specs(specs, seq_len=4096)
    for j, layer in enumerate(model.layers):
        if j in MH.MOE_ENTRIES:
            assert layer.kind == "moe"
            assert [p.resource for p in layer.phases] == ["compute", "comm", "compute", "comm", "compute"]
            assert layer.fwd_ms == pytest.approx(sum(p.fwd_ms for p in layer.phases))
        else:
            assert not layer.phases
    plan = plan_from_dict(MH.plan_doc(split=False, m=4))
    phases = stage_phases(model, plan.stages)
    a, b = plan.pairs[0]
    assert hidden_ms(phases, a, b) > 0  # a pair of MoE stages hides part of its all-to-alls
    check_plan(plan, RunShape(len(specs), None, 2, 4, 4, moe_entries(specs)))
    with torch.device("meta"):
        ep1 = [MH.layer_specs()[0], _spec_ep1()]
    assert not model_from_specs(ep1, seq_len=64).layers[1].phases  # EP 1: nothing to hide


def _spec_ep1():
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import LayerSpec

    return LayerSpec(MoE, MH.HID, MH.expert(), num_experts=2, ep_size=1)


def _module(funcs, *, interval=0):
    return SimpleNamespace(_stage_starts={0: 0}, _stage_funcs={0: funcs}, local_stages=(0,),
                           activation_checkpoint_interval=interval)


def _plan(**kw):
    from octopipe_plugin.actions import Action, Kind

    return SimpleNamespace(pairs=((Action(0, Kind.F, 1), Action(0, Kind.B, 0)),), memory=kw.get("memory", ()),
                           splits=kw.get("splits", ()))


def test_what_the_engine_refuses_beside_pairs():
    from octopipe_plugin.adapters.deepspeed.moe_pairs import pairs_problem

    class Wrapped(torch.nn.Module):  # a MoE inside another module: its all-to-alls run inside that forward
        def __init__(self):
            super().__init__()
            self.moe = _moe()

    assert pairs_problem(_module([_moe()]), _plan()) is None
    cases = [
        (_module([torch.nn.Linear(2, 2), Wrapped()]), _plan(),
         r"list entry 1 \(Wrapped\) holds a deepspeed\.moe\.layer\.MoE inside its own forward on a paired stage 0.*"
         r"give the MoE layer its own LayerSpec\(MoE, \.\.\.\) entry"),
        (_module([_moe(use_residual=True)]), _plan(), r"list entry 0: deepspeed\.moe\.layer\.MoE\(use_residual=True\)"),
        (_module([_moe()], interval=2), _plan(), r"drop PipelineModule\(activation_checkpoint_interval=2\)"),
        (_module([_moe()]), _plan(memory=((0, "recompute"),)), r"per-layer memory choices"),
        (_module([_moe()]), _plan(splits=(SimpleNamespace(layer=0),)), r"beside split layers \[0\]"),
    ]
    for module, plan, message in cases:
        problem = pairs_problem(module, plan)
        assert problem is not None and "\n" not in problem
        assert re.search(message, problem), problem
