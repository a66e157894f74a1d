"""megatron_split against its stated rules, balanced_split against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe_plugin.errors import PlanError
from octopipe_plugin.formats import Layer, Model
from octopipe_plugin.partition import balanced_split, megatron_split


def make(kinds, costs=None) -> Model:
    costs = costs or [1.0] * len(kinds)
    return Model(name="x", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=c, bwd_ms=0.0, wgrad_ms=0.0, state_bytes=0, activation_bytes=0,
              output_bytes=0) for i, (k, c) in enumerate(zip(kinds, costs))))


def decoder_counts(model, bounds):
    pinned = {"embedding", "vision", "projector", "mtp", "lm_head"}
    return [sum(model.layers[i].kind not in pinned for i in range(a, b)) for a, b in bounds]


def test_even_split_pins_embedding_and_head():
    m = make(["embedding"] + ["dense"] * 8 + ["lm_head"])
    assert megatron_split(m, 4) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert megatron_split(m, 1) == [(0, 10)]


def test_vlm_prefix_and_mtp_suffix_stay_at_the_ends():
    m = make(["vision", "vision", "projector", "embedding"] + ["dense"] * 6 + ["mtp", "lm_head"])
    bounds = megatron_split(m, 3)
    assert bounds[0][0] == 0 and bounds[0][1] == 6 and bounds[-1] == (8, 12)
    assert decoder_counts(m, bounds) == [2, 2, 2]


def test_remainder_goes_to_interior_stages_first():
    m = make(["embedding"] + ["mamba"] * 10 + ["lm_head"])
    assert decoder_counts(m, megatron_split(m, 4)) == [2, 3, 3, 2]
    assert decoder_counts(m, megatron_split(m, 3)) == [3, 4, 3]
    assert decoder_counts(make(["dense"] * 5), megatron_split(make(["dense"] * 5), 2)) == [3, 2]


def test_first_and_last_stage_counts():
    m = make(["embedding"] + ["dense"] * 10 + ["lm_head"])
    assert decoder_counts(m, megatron_split(m, 4, first_stage_layers=1, last_stage_layers=3)) == [1, 3, 3, 3]
    assert decoder_counts(m, megatron_split(m, 4, first_stage_layers=4)) == [4, 2, 2, 2]
    with pytest.raises(PlanError, match="do not fit"):
        megatron_split(m, 2, first_stage_layers=4, last_stage_layers=4)


def test_more_stages_than_layers_leaves_empty_stages():
    m = make(["embedding", "dense", "lm_head"])
    bounds = megatron_split(m, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 3 and len(bounds) == 4
    assert all(a <= b for a, b in bounds)


def brute_force(costs, k):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        b = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[b[i]:b[i + 1]]) for i in range(k)))
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=9), st.integers(1, 5))
def test_balanced_split_is_optimal(costs, k):
    m = make(["dense"] * len(costs), [float(c) for c in costs])
    bounds = balanced_split(m, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
    got = max(sum(costs[a:b]) for a, b in bounds)
    assert got == brute_force(costs, k)


def test_balanced_split_uses_f_plus_i_plus_w_or_weights():
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=b, wgrad_ms=0.0, state_bytes=0,
                         activation_bytes=0, output_bytes=0) for i, b in enumerate([0, 0, 0, 6]))
    m = Model(name="x", layers=layers)
    assert balanced_split(m, 2) == [(0, 3), (3, 4)]
    assert balanced_split(m, 2, weights=[1, 1, 1, 1]) == [(0, 2), (2, 4)]
    with pytest.raises(PlanError):
        balanced_split(m, 2, weights=[1, 1])


def test_balanced_split_spreads_the_rest_when_one_heavy_layer_sets_the_maximum():
    # The head (20) alone fixes the min-max optimum; every split of the other ten layers ties on it.
    m = make(["dense"] * 10 + ["lm_head"], [1.0] * 10 + [20.0])
    bounds = balanced_split(m, 4)
    assert bounds[-1] == (10, 11)
    light = [b - a for a, b in bounds[:-1]]
    assert sum(light) == 10 and min(light) >= 3 and max(light) - min(light) <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=4, max_size=9), st.integers(2, 4))
def test_balanced_split_leaves_no_stage_empty_when_layers_suffice(costs, k):
    m = make(["dense"] * len(costs), [float(c) for c in costs])
    bounds = balanced_split(m, k)
    assert all(b > a for a, b in bounds)
