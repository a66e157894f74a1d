"""The stage life cycle written once (executor/stage_core.py): typed per-(stage, micro-batch) states, the
first stage's "W does it all", and the one weight-gradient walk with its sinks."""

import pytest
import torch

from octopipe_plugin.executor.split_backward import backward_input, backward_weight
from octopipe_plugin.executor.stage_core import Forwarded, InputGradDone, WeightDoesAll
from octopipe_plugin.executor.torch_stage import TorchStages


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids)).sum()


def _runner(model, inputs):
    return TorchStages(modules={0: model}, num_stages=1, num_microbatches=1, load_input=lambda mb: inputs,
                       loss_fn=lambda out, mb: out)


@pytest.mark.parametrize("float_input", [True, False])
def test_states_follow_the_actions_and_split_equals_fused(float_input):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)) if float_input \
        else _Embed()
    x = torch.randn(2, 4) if float_input else torch.tensor([1, 2, 3])
    fused = _runner(model, x)
    fused.forward(0, 0, None)
    fused.backward(0, 0, None)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    split = _runner(model, x)
    split.forward(0, 0, None)
    assert isinstance(split.state.get(0, 0, Forwarded), Forwarded)
    assert split.backward_input(0, 0, None) is None  # the first stage gives no input gradient
    # a float input is walked at I; on token ids I stops at the embedding's output (test_grad_starts.py)
    assert isinstance(split.state.get(0, 0, InputGradDone, WeightDoesAll), InputGradDone)
    assert all(p.grad is None for p in model.parameters()), "I must not write parameter gradients"
    split.backward_weight(0, 0)
    assert split.pending() == 0
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


def test_an_action_before_its_dependency_names_the_pair():
    runner = _runner(torch.nn.Linear(4, 1), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="stage 0, micro-batch 3: expected the state of InputGradDone or "
                                           "WeightDoesAll, found nothing"):
        runner.backward_weight(0, 3)


@pytest.mark.parametrize("sink", ["direct", "autograd"])
def test_the_weight_walk_gives_the_fused_gradients_through_either_sink(sink):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    side = torch.nn.Parameter(torch.randn(2))  # on no path from the input: walked from the outputs
    x = torch.randn(3, 4, requires_grad=True)
    dy, dside = torch.randn(3, 2), torch.randn(2)
    params = list(model.parameters()) + [side]
    torch.autograd.backward([model(x), side * 3.0], [dy, dside])
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    fired = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.__setitem__(i, fired.get(i, 0) + 1))
    (dx,), work = backward_input([model(x), side * 3.0], [dy, dside], [x], params)
    assert dx is not None and all(p.grad is None for p in params)
    assert work.rest and work.rest[2] == (side,), "the side branch is walked from the outputs"
    backward_weight(work, sink)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)
    assert fired == ({i: 1 for i in range(len(params))} if sink == "autograd" else {})
