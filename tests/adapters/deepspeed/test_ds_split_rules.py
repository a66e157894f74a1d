"""The single-process rules of a split LM head under DeepSpeed: which list entry is the head (an untied Linear, or a
head tied to the embedding whose forward_fn a probe shows is the projection), and the loss terms read from the user's
loss_fn (targets and coefficients), checked against autograd on whole logits."""

import pytest
import torch
from torch import nn

from octopipe_plugin.adapters.deepspeed.head_split import head_entry, head_placement
from octopipe_plugin.adapters.deepspeed.loss_terms import IGNORE, head_terms
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.testing.plans import make_plan

pytestmark = pytest.mark.framework

V, HID = 11, 5


def _plan(num_layers, split_devices=(0, 1), shares=(0.5, 0.5), layer=None):
    plan = make_plan(stage_devices=[0, 1], bounds=[(0, 2), (2, num_layers)], num_devices=2, num_microbatches=1,
                     schedule=[[], []])
    from dataclasses import replace

    split = SplitLayer(layer=num_layers - 1 if layer is None else layer, devices=tuple(split_devices),
                       shares=tuple(shares))
    return replace(plan, splits=(split,))


def _specs(head):
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(nn.Embedding, V, HID), LayerSpec(nn.Linear, HID, HID), LayerSpec(nn.Linear, HID, HID), head]


def test_the_head_is_the_last_list_entry_an_untied_linear_without_bias():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    plan = _plan(4)
    place = head_placement(plan, _specs(LayerSpec(nn.Linear, HID, V, bias=False)), None, 1)
    assert (place.index, place.vocab, place.hidden, place.rows, place.owner_device) == (3, V, HID, (6, 11), 1)
    assert head_placement(plan, _specs(LayerSpec(nn.Linear, HID, V, bias=False)), None, 0).rows == (0, 6)
    with pytest.raises(OctoPipeError, match="TiedLayerSpec 'embed'\\): its key names no earlier entry"):
        head_placement(plan, _specs(TiedLayerSpec("embed", nn.Embedding, V, HID, forward_fn=lambda m, x: x)),
                       None, 0)
    with pytest.raises(OctoPipeError, match="with a bias"):
        head_placement(plan, _specs(LayerSpec(nn.Linear, HID, V)), None, 0)
    with pytest.raises(OctoPipeError, match="is LayerNorm"):
        head_placement(plan, _specs(LayerSpec(nn.LayerNorm, HID)), None, 0)
    # layer_of_spec maps two entries onto the split layer: not one head
    with pytest.raises(OctoPipeError, match=r"list entries \[2, 3\]"):
        head_entry(_plan(3), [0, 1, 2, 2])
    with pytest.raises(OctoPipeError, match="without the device 1 of its owner stage"):
        head_entry(_plan(4, split_devices=(0,), shares=(1.0,)), None)
    assert head_entry(_plan(4, layer=0), None) is None  # the embedding's split: embedding_placement's


def test_the_embedding_is_the_first_list_entry_an_untied_plain_embedding():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from octopipe_plugin.adapters.deepspeed.head_split import embedding_entry, embedding_placement

    plan, head = _plan(4, split_devices=(1,), shares=(1.0,), layer=0), LayerSpec(nn.Linear, HID, V, bias=False)
    place = embedding_placement(plan, _specs(head), None, 1)
    assert (place.index, place.vocab, place.hidden, place.rows, place.owner_device, place.side) == (
        0, V, HID, (0, V), 0, "input")
    assert embedding_placement(plan, _specs(head), None, 0).rows is None  # stage 0's rank need not hold rows
    for first, why in ((TiedLayerSpec("embed", nn.Embedding, V, HID), "tied to the LM head is not supported"),
                       (LayerSpec(nn.Embedding, V, HID, padding_idx=0), "with padding_idx=0"),
                       (LayerSpec(nn.Linear, V, HID), "is Linear")):
        with pytest.raises(OctoPipeError, match=why):
            embedding_placement(plan, [first, *_specs(head)[1:]], None, 0)
    with pytest.raises(OctoPipeError, match=r"list entries \[0, 1\]"):
        embedding_entry(_plan(3, layer=0), [0, 0, 1, 2])


def _tied(forward_fn, **kwargs):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    head = TiedLayerSpec("embed", nn.Embedding, V, HID, forward_fn=forward_fn, **kwargs)
    blocks = [LayerSpec(nn.Linear, HID, HID), LayerSpec(nn.Linear, HID, HID)]
    return [TiedLayerSpec("embed", nn.Embedding, V, HID), *blocks, head]


def test_a_head_tied_to_the_embedding_splits_when_its_forward_fn_is_the_projection():
    from deepspeed.pipe import TiedLayerSpec

    plan = _plan(4)
    for fn in (lambda m, x: nn.functional.linear(x, m.weight), lambda m, x: (x.float() @ m.weight.float().t())):
        place = head_placement(plan, _tied(fn), None, 0)
        assert (place.index, place.vocab, place.hidden, place.rows) == (3, V, HID, (0, 6))
        assert (place.tied.key, place.tied.attr, place.tied.entries, place.tied.full_device,
                place.tied.file_entry, place.tied.dtype) == ("embed", "weight", (0,), 0, 0, torch.float32)
    refused = {  # forward_fn -> what the refusal says it computes instead
        "scaled": (lambda m, x: x @ m.weight.t() / m.embedding_dim ** 0.5, r"times 0\.447214 \(a scaled projection\)"),
        "biased": (lambda m, x: nn.functional.linear(x, m.weight) + 1.0, "something other than x @ weight"),
        "a lookup": (None, "has no forward_fn: it runs the tied module's own forward"),
        "the module": (lambda m, x: m(x), "its forward_fn on \\(module, x\\) raised RuntimeError"),
        "the identity": (lambda m, x: x, r"returns \(2, 3, 5\) where x @ weight\^T is \(2, 3, 11\)"),
    }
    for name, (fn, why) in refused.items():
        with pytest.raises(OctoPipeError, match=f"list entry 3 \\(the split LM head, TiedLayerSpec 'embed'\\).*{why}.*"
                                                "F.linear\\(x, m.weight\\)"):
            head_placement(plan, _tied(fn), None, 0)
    with pytest.raises(OctoPipeError, match=r"tied_weight_attr \['weight', 'other'\]: a split tied head ties one"):
        head_placement(plan, _tied(lambda m, x: x @ m.weight.t(), tied_weight_attr=["weight", "other"]), None, 0)
    # the whole weight on two pipeline ranks (entries 0 and 2): the tie needs one holder
    specs = _tied(lambda m, x: x @ m.weight.t())
    specs[2] = TiedLayerSpec("embed", nn.Embedding, V, HID)
    with pytest.raises(OctoPipeError, match=r"held whole by pipeline ranks \[0, 1\] \(entries \[0, 2\]\)"):
        head_placement(plan, specs, None, 0)


def _reference(loss_fn, logits, labels):
    """d(loss_fn)/d(logits) on whole logits, and the logits as [tokens, V] float64."""
    leaf = logits.detach().requires_grad_(True)
    root = loss_fn(leaf, labels)
    (g,) = torch.autograd.grad(root, leaf)
    z = logits.reshape(-1, V).double()
    return g.reshape(-1, V), z


LOSS_FNS = {
    "mean": lambda z, y: nn.functional.cross_entropy(z.float().reshape(-1, V), y.reshape(-1)),
    "sum, ignore_index 0": lambda z, y: nn.functional.cross_entropy(z.float().reshape(-1, V), y.reshape(-1),
                                                                    ignore_index=0, reduction="sum"),
    "shifted labels, -100 masked": lambda z, y: nn.functional.cross_entropy(
        z[:, :-1].float().reshape(-1, V), torch.where(y[:, 1:] % 4 == 0, -100, y[:, 1:]).reshape(-1)),
}


@pytest.mark.parametrize("name", sorted(LOSS_FNS))
def test_loss_terms_give_the_unsplit_gradient_and_loss(name):
    loss_fn = LOSS_FNS[name]
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, HID, generator=gen)
    labels = torch.randint(0, V, (2, 6), generator=gen)
    logits = torch.randn(2, 6, V, generator=gen)
    terms = head_terms(loss_fn, hidden, labels, vocab=V, check=True)
    g, z = _reference(loss_fn, logits, labels)
    # what the shards compute from the terms: c_t (softmax - onehot(target)), Σ c_t ℓ_t
    valid = terms.targets != IGNORE
    onehot = torch.zeros_like(z)
    onehot[valid, terms.targets[valid]] = 1.0
    want = terms.raw_coef.double()[:, None] * (torch.softmax(z, dim=1) - onehot)
    torch.testing.assert_close(g.double(), want, atol=1e-6, rtol=1e-5)
    per_token = torch.logsumexp(z, 1) - z.gather(1, terms.targets.clamp(min=0)[:, None])[:, 0]
    loss = float((terms.raw_coef.double() * per_token * valid).sum())
    assert loss == pytest.approx(float(loss_fn(logits, labels)), rel=1e-5)


@pytest.mark.parametrize("loss_fn, why", [
    (lambda z, y: nn.functional.cross_entropy(z.float().reshape(-1, V), y.reshape(-1), label_smoothing=0.1),
     "gradient at random logits"),
    (lambda z, y: nn.functional.cross_entropy(z.float().reshape(-1, V), y.reshape(-1))
     + 1e-2 * torch.logsumexp(z.float(), -1).pow(2).mean(), "gradient at zero logits"),
    (lambda z, y: (nn.functional.cross_entropy(z.float().reshape(-1, V), y.reshape(-1)), {}), "returned tuple"),
])
def test_a_loss_that_is_no_weighted_cross_entropy_is_refused_by_name(loss_fn, why):
    hidden = torch.zeros(2, 3, HID)
    labels = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(OctoPipeError, match=f"loss_fn under a split LM head: .*{why}"):
        head_terms(loss_fn, hidden, labels, vocab=V, check=True)
