"""The profiler charges B at its measured fused backward: each layer's fused_ratio is B / (I + W) of its medians."""

import pytest
import torch
from torch import nn

from octopipe_plugin.profile import ProfileSettings
from octopipe_plugin.profile.layer import ProfileLayer
from octopipe_plugin.profile.measure import LayerProfile
from octopipe_plugin.profile.profiler import fused_ratio, profile_layers
from octopipe_plugin.profile.timing import Timing
from octopipe_plugin.simulator.costs import kind_durations, stage_costs
from octopipe_plugin.actions import Kind
from octopipe_plugin.formats import Stage


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, p25_ms=ms, p75_ms=ms, samples=3)


def profile(i: float, w: float, b: float) -> LayerProfile:
    return LayerProfile(fwd=timing(1.0), bwd=timing(i), wgrad=timing(w), fused=timing(b), activation_bytes=0,
                        output_bytes=4, params=0, state_bytes=0, input={}, output={})


def test_ratio_is_fused_over_split_medians():
    assert fused_ratio(profile(6.0, 4.0, 9.0)) == pytest.approx(0.9)
    assert fused_ratio(profile(0.0, 0.0, 1.0)) is None  # nothing to scale
    assert fused_ratio(profile(2.0, 1.0, 0.0)) is None  # B not measured
    assert fused_ratio(profile(1e-6, 0.0, 1.0)) == 10.0  # clipped to what the format accepts


def test_profiled_layers_charge_b_at_their_own_measured_figure(tmp_path):
    torch.manual_seed(0)
    layers = [ProfileLayer(name=f"l{k}", kind="mlp", build=lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                                                 nn.Linear(64, 32)),
                           example_input=(lambda dev: torch.randn(4, 16, 32, device=dev)) if k == 0 else None)
              for k in range(2)]
    res = profile_layers(layers, settings=ProfileSettings(device="cpu", warmup=1, repeats=3,
                                                          cache_dir=str(tmp_path)))
    for layer, prof in zip(res.model.layers, res.profiles):
        assert layer.fused_ratio == pytest.approx(prof.fused.median_ms / (prof.bwd.median_ms + prof.wgrad.median_ms))
    # the simulator's B of a stage holding both layers is the sum of their measured fused backwards
    sc = stage_costs(res.model, (Stage(start=0, end=2, device=0),))
    assert kind_durations(sc)[Kind.B][0] == pytest.approx(sum(p.fused.median_ms for p in res.profiles))
    # a second run reads the cache and gives the same ratios
    again = profile_layers(layers, settings=ProfileSettings(device="cpu", warmup=1, repeats=3,
                                                            cache_dir=str(tmp_path)))
    assert again.stats.cache_hits >= 1
    assert [l.fused_ratio for l in again.model.layers] == [l.fused_ratio for l in res.model.layers]


def test_timing_at_names_the_median_or_the_lower_quartile():
    t = Timing(median_ms=2.0, p25_ms=1.5, p75_ms=3.0, samples=8)
    assert t.at("median") == 2.0 and t.at("p25") == 1.5
    with pytest.raises(ValueError, match="median, p25, mean"):
        t.at("p90")


def test_profile_statistic_p25_charges_every_phase_and_b_at_the_lower_quartile(tmp_path):
    torch.manual_seed(0)
    layers = [ProfileLayer(name="l0", kind="mlp", build=lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                                              nn.Linear(64, 32)),
                           example_input=lambda dev: torch.randn(4, 16, 32, device=dev))]
    res = profile_layers(layers, settings=ProfileSettings(device="cpu", warmup=1, repeats=5, cache_dir=str(tmp_path),
                                                          statistic="p25"))
    layer, prof = res.model.layers[0], res.profiles[0]
    assert (layer.fwd_ms, layer.bwd_ms, layer.wgrad_ms) == (prof.fwd.p25_ms, prof.bwd.p25_ms, prof.wgrad.p25_ms)
    assert layer.fused_ratio == pytest.approx(prof.fused.p25_ms / (prof.bwd.p25_ms + prof.wgrad.p25_ms))
    assert res.model.meta["profile"]["statistic"] == "p25"
    # the cache keeps every quantile: the median profile of the same layer reads it back, nothing measured again
    again = profile_layers(layers, settings=ProfileSettings(device="cpu", warmup=1, repeats=5,
                                                            cache_dir=str(tmp_path)))
    assert again.stats.cache_hits == 1 and again.model.layers[0].fwd_ms == prof.fwd.median_ms


def test_profile_refuses_an_unknown_statistic():
    from octopipe_plugin.errors import OctoPipeError

    layers = [ProfileLayer(name="l0", kind="mlp", build=lambda: nn.Linear(4, 4),
                           example_input=lambda dev: torch.randn(2, 4, device=dev))]
    with pytest.raises(OctoPipeError, match="statistic must be one of median, p25"):
        profile_layers(layers, settings=ProfileSettings(device="cpu", use_cache=False, statistic="min"))
