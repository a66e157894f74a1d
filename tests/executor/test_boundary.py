"""Single-process checks of boundary values, the handshake, the data source, forward-only plans and split W."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from octopipe_plugin.errors import PlanError
from octopipe_plugin.executor import ExecutorError, TensorMeta, check_runnable, forward_plan
from octopipe_plugin.executor.boundary import (
    decode_meta, encode_meta, flatten, meta_of, mismatch, pack_grads, same_meta, unflatten, unpack_grads,
)
from octopipe_plugin.executor.data import StepData
from octopipe_plugin.executor.split_backward import backward_input, backward_weight
from octopipe_plugin.formats import validate_plan
from octopipe_plugin.actions import Kind
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for
from octopipe_plugin.testing.plans import make_plan

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]


@st.composite
def _values(draw, depth: int = 0):
    """Nested tuple / list / dict structures of small tensors."""
    if depth >= 2 or draw(st.booleans()):
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        t = torch.zeros(shape, dtype=dtype)
        if dtype.is_floating_point and draw(st.booleans()):
            t.requires_grad_(True)
        return t
    kind = draw(st.sampled_from(["tuple", "list", "dict"]))
    items = draw(st.lists(_values(depth + 1), min_size=0, max_size=3))
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(items)}
    return tuple(items) if kind == "tuple" else items


@settings(max_examples=60, deadline=None)
@given(value=_values())
def test_meta_survives_the_handshake_and_grads_pack_only_leaves_that_need_them(value):
    meta = meta_of(value)
    back = decode_meta(encode_meta(meta))
    assert same_meta(meta, back) and mismatch(meta, back, check_grad=True) is None
    leaves, structure = flatten(value)
    assert flatten(unflatten(leaves, structure))[1] == structure
    grads = unflatten([torch.ones_like(t) if t.requires_grad else None for t in leaves], structure)
    packed = pack_grads(back, grads)
    assert len(packed) == sum(t.requires_grad for t in leaves)
    rebuilt, _ = flatten(unpack_grads(back, packed))
    assert [g is not None for g in rebuilt] == [t.requires_grad for t in leaves]


def test_mismatch_names_what_differs():
    h = TensorMeta(shape=(2, 3), dtype=torch.float32)
    mask = TensorMeta(shape=(2,), dtype=torch.int64, requires_grad=False)
    assert not mask.needs_grad and not TensorMeta(shape=(1,), dtype=torch.int64).needs_grad
    value = (torch.zeros(2, 3, requires_grad=True), torch.zeros(2, dtype=torch.int64))
    assert mismatch((h, mask), meta_of(value), check_grad=True) is None
    assert "structure" in mismatch(h, meta_of(value), check_grad=True)
    assert "leaf 0: (2, 4)" in mismatch((h, mask), meta_of((torch.zeros(2, 4), value[1])), check_grad=True)
    frozen = (TensorMeta(shape=(2, 3), dtype=torch.float32, requires_grad=False), mask)
    assert "would be dropped" in mismatch(frozen, meta_of(value), check_grad=True)
    assert mismatch(frozen, meta_of(value), check_grad=False) is None  # forward-only steps send no gradient


def test_a_shared_data_source_is_read_once_per_microbatch_whatever_the_order():
    reads = []

    def source():
        for k in range(3):
            reads.append(k)
            yield f"batch{k}"

    data = StepData(source(), stages=[0, 3], num_microbatches=3)
    assert data.get(3, 2) == "batch2" and data.get(0, 0) == "batch0" and data.get(0, 2) == "batch2"
    assert data.get(3, 0) == "batch0" and reads == [0, 1, 2]
    per_stage = StepData({0: iter("ab"), 2: None}, stages=[0, 2], num_microbatches=2)
    assert per_stage.get(0, 1) == "b" and per_stage.get(2, 0) is None
    with pytest.raises(ExecutorError, match="ended after 2 micro-batches, the plan has 3"):
        StepData(iter("ab"), stages=[0], num_microbatches=3).get(0, 2)


def test_forward_only_plan_keeps_each_device_order_and_is_accepted():
    devs = stage_devices_for("zb-v", 2, 2)
    plan = make_plan(stage_devices=devs, bounds=[(0, 1), (1, 2), (2, 3), (3, 4)], num_devices=2, num_microbatches=3,
                     schedule=SCHEDULES["zb-v"].generate(devs, 2, 3))
    fwd = forward_plan(plan)
    for full, only in zip(plan.schedule, fwd.schedule):
        assert list(only) == [a for a in full if a.kind is Kind.F]
    check_runnable(fwd)
    with pytest.raises(PlanError, match="0B0"):
        validate_plan(fwd)  # a training plan still needs every backward
    with pytest.raises(PlanError, match="runs forwards only, it has"):
        validate_plan(plan, forward_only=True)


def test_split_backward_reaches_parameters_on_a_branch_off_the_input_path_once():
    # stage output (f(x), emb(tokens)): the embedding's weight never meets the input's path
    calls = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g

    lin = torch.nn.Linear(3, 3).double()
    emb = torch.nn.Embedding(5, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    outs = [lin(x), Probe.apply(emb(torch.tensor([1, 4])))]
    grads = [torch.ones(2, 3, dtype=torch.float64), torch.full((2, 3), 2.0, dtype=torch.float64)]
    params = list(lin.parameters()) + list(emb.parameters())
    counts = {id(p): 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: counts.__setitem__(id(q), counts[id(q)] + 1))
    (dx,), work = backward_input(outs, grads, [x], params)
    assert dx is not None and calls == [] and all(p.grad is None for p in params)
    backward_weight(work, "autograd")
    assert calls == [1] and all(c == 1 for c in counts.values())
    expected = torch.zeros(5, 3, dtype=torch.float64)
    expected[[1, 4]] = 2.0
    torch.testing.assert_close(emb.weight.grad, expected)


@pytest.mark.parametrize("split", [False, True])
def test_direct_sink_never_keeps_a_received_gradient_buffer_as_a_parameter_gradient(split):
    from octopipe_plugin.executor import TorchStages

    class AddBias(torch.nn.Module):
        """out = x + b with b of the output's shape: autograd hands b the output gradient itself."""

        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))

        def forward(self, x):
            return x * 2 + self.b

    run = TorchStages(modules={0: AddBias()}, num_stages=2, num_microbatches=1, grad_sink="direct",
                      load_input=lambda mb: torch.ones(2, 3, dtype=torch.float64))
    run.forward(0, 0, None)
    received = torch.full((2, 3), 3.0, dtype=torch.float64)  # stands for the executor's kept receive buffer
    if split:
        run.backward_input(0, 0, received)
        run.backward_weight(0, 0)
    else:
        run.backward(0, 0, received)
    b = run.modules[0].b
    assert b.grad.untyped_storage().data_ptr() != received.untyped_storage().data_ptr()
    received.fill_(0.0)  # the next step's receive rewrites the buffer
    assert torch.equal(b.grad, torch.full((2, 3), 3.0, dtype=torch.float64))
