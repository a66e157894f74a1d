"""Tied rows between a full weight and its row shards (executor/tied_rows.py) over three gloo ranks.

One spawn runs every case: uneven rows, the full rank holding a shard of its own (summed locally), a
rank outside the tie, float32 and bfloat16, a sub-group; both sides bit-equal to the tie's sum.
"""

from __future__ import annotations

import pytest
import torch

from octopipe_plugin.executor.tied_rows import TiedRows

V, H = 10, 4


def _weights(dtype):
    """The full weight and every rank's own shard gradient, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(7)
    full = torch.randn(V, H, generator=g).to(dtype)
    grads = {r: torch.randn(V, H, generator=g).to(dtype) for r in range(3)}
    return full, grads


def _case(rank: int, tied: TiedRows, dtype) -> None:
    """copy_rows then sum_rows for one tie; each rank checks its side exactly."""
    from octopipe_plugin.executor.tied_rows import copy_rows, sum_rows

    w, grads = _weights(dtype)
    full = w.clone() if rank == tied.full_rank else None
    rows = tied.rows.get(rank)
    shard = torch.zeros(rows[1] - rows[0], H, dtype=dtype) if rows else None
    copy_rows(tied, full, shard)
    if rows:
        assert torch.equal(shard, w[rows[0]:rows[1]])
    if full is not None:
        assert torch.equal(full, w)  # the full weight itself is untouched
    # gradients: the full rank's is grads[full_rank] (whole), each shard's is grads[r][lo:hi]
    full_grad = grads[tied.full_rank].clone() if full is not None else None
    shard_grad = grads[rank][rows[0]:rows[1]].clone() if rows else None
    sum_rows(tied, full_grad, shard_grad)
    want = grads[tied.full_rank].clone()
    for r, (lo, hi) in tied.rows.items():
        want[lo:hi] = grads[tied.full_rank][lo:hi] + grads[r][lo:hi]
    if rows:
        assert shard_grad.dtype == dtype
        assert torch.equal(shard_grad, want[rows[0]:rows[1]]), (rank, tied)
    if full_grad is not None:
        assert torch.equal(full_grad, want), (rank, tied)  # rows outside every shard keep the full rank's grad


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from octopipe_plugin.executor.launch import init_gloo

    init_gloo(rank, world, port, timeout_s=60)
    for dtype in (torch.float32, torch.bfloat16):
        # the full rank holds a shard too (V-shape): uneven rows, one summed locally
        _case(rank, TiedRows(full_rank=0, rows={0: (0, 3), 1: (3, 7), 2: (7, 10)}), dtype)
        # shards on other ranks only, rows not covering the weight's last rows
        _case(rank, TiedRows(full_rank=2, rows={1: (0, 2), 0: (2, 9)}), dtype)
    # a rank outside the tie returns at once; the tie runs over a sub-group
    sub = dist.new_group([0, 1])
    _case(rank, TiedRows(full_rank=1, rows={0: (0, 6)}, group=sub), torch.float32)
    # the full rank alone holds every shard: purely local
    _case(rank, TiedRows(full_rank=rank, rows={rank: (1, 5)}), torch.float32)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_copy_rows_and_sum_rows_keep_a_full_weight_and_its_row_shards_tied():
    """Every case in one spawn of three ranks."""
    from octopipe_plugin.executor.launch import spawn

    spawn(_worker, 3)


def test_a_tie_with_empty_or_overlapping_rows_is_refused_by_name():
    with pytest.raises(ValueError, match=r"rows\[1\].*lo < hi"):
        TiedRows(full_rank=0, rows={1: (3, 3)})
    with pytest.raises(ValueError, match="ranks 1 .* and 2 .* overlap"):
        TiedRows(full_rank=0, rows={1: (0, 4), 2: (3, 6)})
    assert TiedRows(full_rank=2, rows={3: (4, 6), 0: (0, 4), 2: (6, 7)}).ranks() == (2, 0, 3)
