"""The executor runs memory choices (docs/formats.md, "Memory choices"): recompute through a non-reentrant
checkpoint, selective recompute of named sub-modules, offload through saved-tensor hooks; on 2 gloo ranks every
plan's loss and gradients equal the same plan without choices and the single-process reference (float64, rtol
1e-10), and a 1% scale error fails that comparison."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from octopipe_plugin.actions import Action
from octopipe_plugin.errors import OctoPipeError, PlanError
from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.executor.memory_choices import Offloader, apply_memory
from octopipe_plugin.formats import plan_to_dict
from octopipe_plugin.formats.memory import parse_choice
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for
from octopipe_plugin.testing.memory_checks import check_memory_plans_worker
from octopipe_plugin.testing.plans import make_plan
from octopipe_plugin.testing.toy import ToySpec, build_layers, stage_modules

SPEC = ToySpec(layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))
BOUNDS = [(0, 2), (2, 4), (4, 6), (6, 8)]
CHOICES = {1: "recompute", 2: "offload", 3: "selective:layernorm", 4: "selective:core_attn,layernorm",
           5: "offload", 6: "recompute"}


def _plan(name: str, v: int, m: int, memory: dict):
    devs = stage_devices_for(name, 2, v)
    bounds = BOUNDS if v == 2 else [(0, 4), (4, 8)]
    plan = make_plan(stage_devices=devs, bounds=bounds, num_devices=2, num_microbatches=m,
                     schedule=SCHEDULES[name].generate(devs, 2, m))
    return replace(plan, memory=tuple(sorted((k, parse_choice(c)) for k, c in memory.items())))


def _docs():
    docs = []
    for label, plan in [("1f1b mixed", _plan("1f1b", 1, 3, CHOICES)),
                        ("zb-v mixed (I/W)", _plan("zb-v", 2, 3, CHOICES)),
                        ("interleaved all offload", _plan("interleaved-1f1b", 2, 2, {i: "offload" for i in range(8)})),
                        ("gpipe all recompute", _plan("gpipe", 1, 2, {i: "recompute" for i in range(8)})),
                        ("zb-h1 offload_w (I->W)", _plan("zb-h1", 1, 4, {**{i: "offload_w" for i in range(8)},
                                                                         2: "offload", 5: "recompute"}))]:
        doc = plan_to_dict(plan)
        doc["meta"] = {"label": label}
        docs.append(doc)
    return docs


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_memory_choices_match_plain_plan_and_reference():
    spawn(check_memory_plans_worker, 2, _docs(), SPEC)


def test_offload_hooks_copy_saved_tensors_and_keep_parameters():
    off = Offloader()
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    off.current = (0, 0)
    with off.scope(lin.parameters()):
        y = torch.tanh(lin(x))
    packed = off.groups[(0, 0)]
    assert packed and all(h.host.data_ptr() not in {p.data_ptr() for p in lin.parameters()} for h in packed)
    y.sum().backward()
    ref = torch.nn.Linear(3, 3).double()
    ref.load_state_dict(lin.state_dict())
    x2 = x.detach().requires_grad_(True)
    torch.tanh(ref(x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=0)


def test_offload_w_sends_what_w_reads_away_after_i():
    """Deferred hooks: I reads the saved tensors on the device; `away` leaves host copies only; W's gradients are
    autograd's."""
    off = Offloader(deferred=True)
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    off.current = (0, 0)
    with off.scope(lin.parameters()):
        y = torch.tanh(lin(x))
    (dx,) = torch.autograd.grad(y.sum(), (x,), retain_graph=True)
    packed = off.groups[(0, 0)]
    assert packed and all(h.host is None and h.back is not None for h in packed)
    off.away(0, 0)
    assert all(h.host is not None and h.back is None for h in packed)
    y.sum().backward(inputs=list(lin.parameters()))
    ref = torch.nn.Linear(3, 3).double()
    ref.load_state_dict(lin.state_dict())
    x2 = x.detach().requires_grad_(True)
    torch.tanh(ref(x2)).sum().backward()
    torch.testing.assert_close(dx, x2.grad, rtol=1e-12, atol=0)
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def test_selective_module_the_layer_lacks_is_refused():
    layers = build_layers(SPEC)
    plan = _plan("1f1b", 1, 2, {1: "selective:core_attn"})  # layer 1 is an MLP block
    with pytest.raises(PlanError, match=r"\$\.memory\.1: selective:core_attn on layer 1 \(MLPBlock\).*fix"):
        apply_memory(stage_modules(layers, [(s.start, s.end) for s in plan.stages], [0]), plan)


def test_recompute_reruns_exactly_the_named_layers():
    from octopipe_plugin.testing.checks import toy_runner

    layers = build_layers(SPEC)
    calls = {i: 0 for i in range(len(SPEC.layers))}
    for i, layer in enumerate(layers):  # (module hooks do not fire in a checkpoint's recompute: count the calls)
        def counted(*args, _fwd=layer.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _fwd(*args, **kwargs)

        layer.forward = counted
    plan = make_plan(stage_devices=[0], bounds=[(0, 8)], num_devices=1, num_microbatches=1,
                     schedule=((Action.parse("0F0"), Action.parse("0B0")),))
    plan = replace(plan, memory=((1, parse_choice("recompute")), (2, parse_choice("offload"))))
    runner = toy_runner(SPEC, layers, plan, 0)
    runner.forward(0, 0, None)
    assert runner.memory.offloader.groups[(0, 0)]
    runner.backward(0, 0, None)
    assert calls == {i: 2 if i == 1 else 1 for i in range(8)}
    assert not runner.memory.offloader.groups and runner.pending() == 0


def test_dry_run_holds_recomputes_and_offloads_as_predicted():
    """The stand-ins hold each layer's (scaled) bytes and free them per the choices: recompute (the re-run slept in
    B), offload (copies on a host-link thread, the backward waiting for its copy-in); 2 ranks, ZB-H1 (I and W)."""
    from octopipe_plugin.executor.dryrun import dry_run
    from octopipe_plugin.formats import Cluster, Layer, Link, Model
    from octopipe_plugin.simulator import simulate

    gib = 2**30
    model = Model(name="m", layers=tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1,
                                               state_bytes=gib, activation_bytes=4 * gib, output_bytes=64 << 20,
                                               recompute_activation_bytes=64 << 20) for i in range(4)))
    link = Link(bandwidth_gb_per_s=400, latency_us=1)
    # 4 GiB take 2.1 ms each way, longer than a layer's F: the copies delay backwards
    cl = Cluster(num_devices=2, devices_per_node=2, memory_bytes=80 * gib, intra_node=link, inter_node=link,
                 host_link_gb_per_s=2000.0)
    memory = ((0, parse_choice("recompute")), (1, parse_choice("offload")), (3, parse_choice("offload")))
    for name in ("zb-h1",):
        plain = make_plan(stage_devices=[0, 1], bounds=[(0, 2), (2, 4)], num_devices=2, num_microbatches=4,
                          schedule=SCHEDULES[name].generate([0, 1], 2, 4))
        plan = replace(plain, memory=memory)
        rep = dry_run(model, plan, cl, target_ms=600.0, timeout_s=60.0)
        assert rep.peak_error <= 0.10, (name, rep.predicted_peak_bytes, rep.measured_peak_bytes)
        assert abs(rep.error) < 0.25, (name, rep.predicted_ms, rep.measured_ms)
        # the choices freed bytes: the predicted peaks are the plan's, below the plain plan's
        with_, without = simulate(model, cl, plan), simulate(model, cl, plain)
        with pytest.raises(OctoPipeError, match=r"dry run: plan \$\.memory: the stand-ins do not hold offload_w.*fix"):
            dry_run(model, replace(plain, memory=((2, parse_choice("offload_w")),)), cl, target_ms=600.0)
        assert with_.peak_memory_bytes[0] < without.peak_memory_bytes[0]
        assert with_.step_time_ms > without.step_time_ms  # recompute and the late copy-ins cost time
