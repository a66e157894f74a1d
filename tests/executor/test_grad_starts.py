"""A stage on token ids splits its backward like any other: I walks the activation chain down to the
embedding's output (`grad_starts`), W the weights; the gradients equal one autograd backward exactly."""

import copy

import pytest
import torch
from torch import nn

from octopipe_plugin.executor.grad_starts import recorded_starts
from octopipe_plugin.executor.stage_core import InputGradDone, WeightDoesAll
from octopipe_plugin.executor.torch_stage import TorchStages


class _Mark(torch.autograd.Function):
    """Identity whose backward records the phase it ran in (the oracle of where the chain's work went)."""

    log: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Mark.log.append(_Mark.phase)
        return g


class _Marked(nn.Module):
    def forward(self, x):
        return _Mark.apply(x)


class _Embeddings(nn.Module):
    """Word + position embeddings inside one module (nested starts: the inner lookups are the starts)."""

    def __init__(self):
        super().__init__()
        self.word, self.pos = nn.Embedding(40, 8), nn.Embedding(6, 8)

    def forward(self, ids):
        return self.word(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class _Bias(nn.Module):
    """Hands out its own parameter: a leaf, not a start."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self):
        return self.bias


class _Stage(nn.Module):
    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.emb, self.extra = _Embeddings(), _Bias()
        self.body = nn.Sequential(nn.LayerNorm(8), _Marked(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, ids):
        if self.functional:  # no module of its own computes from the ids: the stage's output is the only start
            h = nn.functional.embedding(ids, self.emb.word.weight)
        else:
            h = self.emb(ids)
        return self.body(h + self.extra())


def _split_run(model, ids, dy):
    runner = TorchStages(modules={0: model}, num_stages=2, num_microbatches=1, load_input=lambda mb: ids)
    runner.forward(0, 0, None)
    _Mark.phase = "I"
    assert runner.backward_input(0, 0, dy) is None  # the first stage gives no input gradient
    state = runner.state.get(0, 0, InputGradDone, WeightDoesAll)
    assert all(p.grad is None for p in model.parameters()), "I must not write parameter gradients"
    _Mark.phase = "W"
    runner.backward_weight(0, 0)
    assert runner.pending() == 0
    return state


@pytest.mark.parametrize("functional", [False, True])
def test_token_ids_stage_splits_at_the_embedding_and_matches_autograd(functional):
    torch.manual_seed(0)
    model = _Stage(functional)
    ref = copy.deepcopy(model)
    ids, dy = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, 8)
    _Mark.log = []
    state = _split_run(model, ids, dy)
    assert isinstance(state, InputGradDone)
    # the activation chain (the marker sits between the embedding and the first linear) ran at I, once
    assert _Mark.log == (["W"] if functional else ["I"])
    _Mark.phase = "ref"
    ref(ids).backward(dy)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_only_the_innermost_data_only_calls_are_starts():
    torch.manual_seed(0)
    model = _Stage()
    ids = torch.randint(0, 40, (2, 6))
    with recorded_starts() as starts:
        model(ids)
    names = sorted(type(t.grad_fn).__name__ for t in starts)
    assert names == ["EmbeddingBackward0", "EmbeddingBackward0"], names  # word and position; not _Embeddings', _Bias'
    with recorded_starts() as starts, torch.no_grad():
        model(ids)
    assert starts == []


def test_a_stage_without_a_start_leaves_the_whole_backward_to_w():
    torch.manual_seed(0)
    stage = nn.Module()
    stage.table, stage.lin = nn.Parameter(torch.randn(40, 8)), nn.Linear(8, 8)
    # run through `call`: no module call takes the ids, so F finds no start
    runner = TorchStages(modules={0: stage}, num_stages=2, num_microbatches=1,
                         load_input=lambda mb: torch.tensor([[1, 2]]),
                         call=lambda s, m, x, b: m.lin(nn.functional.embedding(x, m.table)))
    out = runner.forward(0, 0, None)
    runner.backward_input(0, 0, torch.ones_like(out))
    assert isinstance(runner.state.get(0, 0, InputGradDone, WeightDoesAll), WeightDoesAll)
    runner.backward_weight(0, 0)
    assert stage.table.grad is not None and stage.lin.weight.grad is not None
