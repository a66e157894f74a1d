"""Real weight-gradient deferral in Megatron's linears: exact gradients, each GEMM once, hooks once, none at I."""

import tempfile

import pytest
import torch

from octopipe_plugin.executor.launch import spawn

pytestmark = [pytest.mark.framework]


def _check(rank, world, port, out_path):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    from octopipe_plugin.adapters.megatron.wgrad import (Phase, _function_class, enable_wgrad_split, input_pass,
                                                         weight_pass)
    from octopipe_plugin.testing.megatron_wgrad import MLPStack, _inputs, counting_gemms, run_split
    from octopipe_plugin.executor.launch import init_gloo

    init_gloo(rank, world, port)
    parallel_state.initialize_model_parallel(1, 1)
    whole = {"calls": 0}
    plain_backward = layers.LinearWithGradAccumulationAndAsyncCommunication.backward

    def counting(ctx, grad):
        whole["calls"] += 1
        return plain_backward(ctx, grad)

    layers.LinearWithGradAccumulationAndAsyncCommunication.backward = staticmethod(counting)
    ref = MLPStack(32, 3)
    x, dy = _inputs(32, 8, 2, 1)
    out = ref(x)
    (dx_ref,) = torch.autograd.grad([out], [x], [dy], retain_graph=True)
    torch.autograd.backward([out], [dy])
    plain = MLPStack(32, 3)
    whole["calls"] = 0
    run_split(plain, x, dy, None)
    plain_calls = whole["calls"]

    model, phase = MLPStack(32, 3), Phase()
    assert enable_wgrad_split(model, phase) == 6
    fired = {}
    params = [p for p in model.parameters()]
    for i, p in enumerate(params):
        acc = p.view_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *a, i=i: fired.__setitem__(i, fired.get(i, 0) + 1))
        p._keep_acc = acc  # hooks live on the accumulator: keep it alive
    results = {}
    with counting_gemms() as gemms:
        for mb in range(2):  # two micro-batches: gradients accumulate, hooks fire once per micro-batch
            out = model(x)
            (dx,), work = input_pass([out], [dy], [x], params, phase)
            results.setdefault("fired_after_I", []).append(sum(fired.values()))
            weight_pass(work)
            results.setdefault("fired_after_W", []).append(dict(fired))
            torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-6, atol=1e-7, msg=name)
    with counting_gemms() as fused:  # phase None: the split linears run Megatron's own fused backward (B)
        torch.autograd.backward([model(x)], [dy])
    results["fused"] = (fused.forward_calls, fused.input_gemms, fused.weight_gemms)
    results["counter_left_installed"] = "apply" in vars(_function_class())
    results.update(plain_calls=plain_calls, phase=(gemms.forward_calls, gemms.input_gemms, gemms.weight_gemms),
                   nparams=len(params))
    torch.save(results, out_path)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_split_linears_compute_each_gemm_once(tmp_path):
    """I runs only input GEMMs (no parameter gradient yet), W only weight GEMMs; the sum equals B exactly."""
    path = tmp_path / "wgrad.pt"
    spawn(_check, 1, str(path))
    r = torch.load(path)
    assert r["plain_calls"] == 12, "the plain graph split runs Megatron's whole linear backward at I and again at W"
    assert r["phase"] == (12, 12, 12)  # 6 linears x 2 micro-batches: one input GEMM and one weight GEMM each
    assert r["fused"] == (6, 6, 6), "a fused B counts one input and one weight GEMM per linear"
    assert not r["counter_left_installed"], "counting_gemms must restore the SplitLinear class"
    assert r["fired_after_I"] == [0, r["nparams"]], "I must not produce parameter gradients"
    assert r["fired_after_W"][0] == {i: 1 for i in range(r["nparams"])}
    assert r["fired_after_W"][1] == {i: 2 for i in range(r["nparams"])}
