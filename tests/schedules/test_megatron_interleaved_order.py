"""Interleaved 1F1B against megatron-core's own schedule table and warm-up counts (megatron_oracle.py)."""

from __future__ import annotations

import pytest

from megatron_oracle import megatron_order
from octopipe_plugin.schedules.generators import interleaved_1f1b, megatron_group_size, one_f_one_b
from octopipe_plugin.schedules.placement import looped

pytestmark = pytest.mark.framework


@pytest.fixture(scope="module")
def mcore():
    return pytest.importorskip("megatron.core.pipeline_parallel.schedules")


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 5), (4, 2, 8), (4, 2, 16), (4, 3, 12), (4, 4, 4),
                                     (3, 2, 7), (4, 2, 10), (4, 2, 6), (8, 2, 8), (2, 5, 9)])
def test_interleaved_matches_megatron(mcore, p, v, m):
    g = megatron_group_size(p, m)
    ours = interleaved_1f1b(looped(p, v), p, m)
    for r in range(p):
        assert list(ours[r]) == megatron_order(mcore, p, r, v, m, g)[0], f"rank {r}"


@pytest.mark.parametrize("p, m", [(2, 1), (4, 3), (4, 8), (5, 7)])
def test_1f1b_matches_megatron_warmup(mcore, p, m):
    ours = one_f_one_b(looped(p, 1), p, m)
    for r in range(p):
        assert list(ours[r]) == megatron_order(mcore, p, r, None, m, p)[0]
