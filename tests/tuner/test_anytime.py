"""Anytime: the progress feed only improves, and Ctrl-C returns the plan in hand instead of nothing."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import validate_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.compare import best_builtin_ms

from tuner_helpers import cluster, hetero_model


class _StopAfter:
    """A progress callback that records the feed and raises KeyboardInterrupt at report number `at`."""

    def __init__(self, at: int | None):
        self.at, self.seen = at, []

    def __call__(self, p):
        self.seen.append(p)
        if self.at is not None and len(self.seen) == self.at:
            raise KeyboardInterrupt


def test_progress_shows_a_best_so_far_that_never_worsens():
    model, cl = hetero_model(12), cluster(4, memory_gib=40)
    feed = _StopAfter(None)
    r = tune(model, cl, 8, iterations=40, seed=2, progress=feed)
    best = [p.best_ms for p in feed.seen]
    assert best and all(b <= a + 1e-9 for a, b in zip(best, best[1:]))
    assert best[-1] >= r.step_ms - 1e-9  # the final pick (empty stages dropped) is no slower
    assert {p.phase for p in feed.seen} >= {"built-ins", "search"}


@pytest.mark.parametrize("at", [1, 5, 40])
def test_ctrl_c_returns_the_plan_in_hand(at):
    """Interrupted during the built-ins (1), the seeds (5) or the search (40): a valid plan, never worse than in hand."""
    model, cl = hetero_model(12), cluster(4, memory_gib=40)
    feed = _StopAfter(at)
    r = tune(model, cl, 8, iterations=200, seed=2, progress=feed)
    assert r.stopped_by == "interrupted"
    validate_plan(r.plan, model.num_layers)
    res = simulate(model, cl, r.plan)
    assert res.step_time_ms == pytest.approx(r.step_ms, abs=1e-6)
    assert max(res.peak_memory_bytes) <= cl.memory_bytes
    assert r.step_ms <= feed.seen[-1].best_ms + 1e-9
    if r.baselines:
        assert r.step_ms <= best_builtin_ms(r.baselines) + 1e-9
