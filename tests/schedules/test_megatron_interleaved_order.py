"""Interleaved 1F1B against megatron-core's own schedule table and warm-up counts.

The oracle replays forward_backward_pipelining_with_interleaving's loop structure (warm-up
forwards, then one forward and one backward per step, then the cool-down backwards) with
megatron's get_schedule_table and get_pp_rank_microbatches; each backward pops the oldest
forward of its model chunk (megatron's input_tensors[chunk].pop(0)).
"""

from __future__ import annotations

import types

import pytest

from octopipe_plugin.actions import B, F
from octopipe_plugin.schedules.generators import interleaved_1f1b, megatron_group_size, one_f_one_b
from octopipe_plugin.schedules.placement import looped

pytestmark = pytest.mark.framework


@pytest.fixture(scope="module")
def mcore():
    return pytest.importorskip("megatron.core.pipeline_parallel.schedules")


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def megatron_order(mcore, p: int, r: int, v: int | None, m: int, g: int) -> list:
    comm = types.SimpleNamespace(pp_group=_Group(p, r), virtual_pipeline_model_parallel_size=v)
    chunks = v or 1
    total, _, warm, remaining = mcore.get_pp_rank_microbatches(m, chunks, g, p2p_communicator=comm)
    table = mcore.get_schedule_table(m, chunks, g) if v else [(i, 0) for i in range(m)]
    pending = {c: [] for c in range(chunks)}
    order = []

    def fwd(k):
        mb, c = table[k]
        pending[c].append(mb)
        order.append(F(c * p + r, mb))

    def bwd(k):
        c = chunks - 1 - table[k % total][1]
        order.append(B(c * p + r, pending[c].pop(0)))

    for k in range(warm):
        fwd(k)
    for k in range(remaining):
        fwd(k + warm)
        bwd(k)
    for k in range(remaining, total):
        bwd(k)
    return order


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 5), (4, 2, 8), (4, 2, 16), (4, 3, 12), (4, 4, 4),
                                     (3, 2, 7), (4, 2, 10), (4, 2, 6), (8, 2, 8), (2, 5, 9)])
def test_interleaved_matches_megatron(mcore, p, v, m):
    g = megatron_group_size(p, m)
    ours = interleaved_1f1b(looped(p, v), p, m)
    for r in range(p):
        assert list(ours[r]) == megatron_order(mcore, p, r, v, m, g), f"rank {r}"


@pytest.mark.parametrize("p, m", [(2, 1), (4, 3), (4, 8), (5, 7)])
def test_1f1b_matches_megatron_warmup(mcore, p, m):
    ours = one_f_one_b(looped(p, 1), p, m)
    for r in range(p):
        assert list(ours[r]) == megatron_order(mcore, p, r, None, m, p)
