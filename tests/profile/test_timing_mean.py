"""The profile keeps each phase's mean beside its quartiles, and a prediction summing many actions wants it."""

import random
import statistics

import pytest

from octopipe_plugin.profile.measure import LayerProfile
from octopipe_plugin.profile.profiler import profiled_layer
from octopipe_plugin.profile.timing import STATISTICS, Timing, summarise


def test_summarise_keeps_the_mean_and_it_survives_the_json_form():
    t = summarise([1.0, 2.0, 3.0, 10.0])
    assert t.mean_ms == pytest.approx(4.0)
    assert t.at("mean") == pytest.approx(4.0)
    assert t.at("median") == pytest.approx(2.5)
    assert Timing.from_dict(t.to_dict()) == t
    assert summarise([7.0]).at("mean") == 7.0
    assert "mean" in STATISTICS


def test_a_record_cached_before_the_mean_reads_and_names_the_fix():
    old = Timing.from_dict({"median_ms": 2.0, "p25_ms": 1.5, "p75_ms": 3.0, "samples": 8})
    assert old.mean_ms is None and old.at("p25") == 1.5
    assert "mean_ms" not in old.to_dict()  # written back as it was read
    with pytest.raises(ValueError, match="--no-cache"):
        old.at("mean")


def test_profiled_layer_charges_the_mean_when_asked():
    def t(samples):
        return summarise(samples)

    prof = LayerProfile(fwd=t([1.0, 1.0, 4.0]), bwd=t([2.0, 2.0, 5.0]), wgrad=t([1.0, 1.0, 1.0]),
                        fused=t([3.0, 3.0, 3.0]), activation_bytes=0, output_bytes=4, params=0, state_bytes=0,
                        input={}, output={})
    layer = profiled_layer("l0", "mlp", prof, "mean")
    assert (layer.fwd_ms, layer.bwd_ms, layer.wgrad_ms) == pytest.approx((2.0, 3.0, 1.0))
    assert layer.fused_ratio == pytest.approx(3.0 / 4.0)  # B over I + W, both by the mean


def test_the_sum_of_many_actions_sits_at_the_sum_of_their_means_not_of_their_quartiles():
    """Why "mean" exists: a step of 32 actions, each 10 ms plus now and then a preemption (skewed, as a shared
    machine's samples are). The steps' lower quartile lies near 32 x the actions' mean; 32 x the actions' lower
    quartile falls short of it by several percent, which a profile by the lower quartile then reports as the
    plan running slower than predicted."""
    rng = random.Random(0)

    def action() -> float:
        return 10.0 * (1 + 0.03 * rng.random()) + (rng.expovariate(1 / 4.0) if rng.random() < 0.2 else 0.0)

    samples = [action() for _ in range(2000)]
    steps = [sum(action() for _ in range(32)) for _ in range(400)]
    step_p25 = summarise(steps).at("p25")
    by_mean, by_p25 = 32 * summarise(samples).at("mean"), 32 * summarise(samples).at("p25")
    assert abs(step_p25 - by_mean) / step_p25 < 0.03
    assert (step_p25 - by_p25) / step_p25 > 0.05
    assert statistics.median(samples) < statistics.fmean(samples)  # skewed: the median falls short too
