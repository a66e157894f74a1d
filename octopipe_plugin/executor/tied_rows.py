"""Tied rows between a full weight and its row shards (a tied embedding + LM head whose head is split).

The embedding's holder (`full_rank`) keeps the whole weight W [V, h] (or its tensor-parallel slice);
each head shard rank holds rows [lo, hi) of the same weight as its own parameter. The tie says both
start equal and receive the same gradient every step, exactly as the unsplit tied model where both
uses accumulate into one weight. `copy_rows` makes the shards equal to the full weight's rows;
`sum_rows` makes both sides' gradients the sum `full_grad[lo:hi] + shard_grad`.

Framework-neutral (torch.distributed only). Messages are point-to-point in one `batch_isend_irecv`
per rank (every send and receive posted at once, so no order between peers can deadlock); the full
rank's own shard (full_rank in `rows`) is handled locally without a message. Ranks outside the tie
return at once. `sum_rows` runs after the step's last backward and before data-parallel reduction
(summing before reducing equals reducing before summing; after a reduce-scatter only slices are valid).
Both sides compute the same sum of the same two values, so they stay bit-equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TiedRows:
    """One tie: `full_rank` holds the whole weight; `rows[r]` = the rows [lo, hi) shard rank r holds (global ranks)."""

    full_rank: int
    rows: Mapping[int, tuple[int, int]]
    group: object | None = None  # a process group containing all of them (None: the default group)

    def __post_init__(self):
        spans = sorted((lo, hi, r) for r, (lo, hi) in self.rows.items())
        for lo, hi, r in spans:
            if not 0 <= lo < hi:
                raise ValueError(f"TiedRows.rows[{r}]: expected rows lo < hi with lo >= 0, got [{lo}, {hi}); "
                                 "give each shard rank a non-empty row range")
        for (lo0, hi0, r0), (lo1, hi1, r1) in zip(spans, spans[1:]):
            if lo1 < hi0:
                raise ValueError(f"TiedRows.rows: ranks {r0} [{lo0}, {hi0}) and {r1} [{lo1}, {hi1}) overlap; "
                                 "expected disjoint row ranges, one per shard rank")

    def ranks(self) -> tuple[int, ...]:
        """Every rank in the tie: the full rank first, then the shard ranks in order."""
        return (self.full_rank, *sorted(r for r in self.rows if r != self.full_rank))


def _role(tied: TiedRows) -> int | None:
    """This rank's global rank when it takes part in the tie, else None."""
    me = dist.get_rank()
    return me if me == tied.full_rank or me in tied.rows else None


def _check(tied: TiedRows, me: int, full, shard, what: str) -> None:
    """The tensors this rank must give for its role, one line naming what is missing or misshapen."""
    if me == tied.full_rank:
        if full is None:
            raise ValueError(f"tied_rows.{what}: rank {me} holds the full weight; expected its tensor, got None")
        top = max(hi for _, hi in tied.rows.values())
        if full.dim() < 1 or full.shape[0] < top:
            raise ValueError(f"tied_rows.{what}: the full tensor on rank {me} has {tuple(full.shape)} rows; "
                             f"expected at least {top} (the highest shard row)")
    if me in tied.rows:
        lo, hi = tied.rows[me]
        if shard is None or shard.dim() < 1 or shard.shape[0] != hi - lo:
            got = None if shard is None else tuple(shard.shape)
            raise ValueError(f"tied_rows.{what}: rank {me} holds rows [{lo}, {hi}); expected a shard tensor "
                             f"of {hi - lo} rows, got {got}")


def _exchange(tied: TiedRows, me: int, full, shard, with_back: bool) -> dict[int, torch.Tensor]:
    """Post every message of this rank at once; return what it received, by peer.

    The full rank sends each remote shard rank its rows (and with `with_back` receives that rank's
    shard); a shard rank receives its rows from the full rank (and with `with_back` sends its shard).
    """
    ops, got = [], {}
    if me == tied.full_rank:
        for r in tied.ranks()[1:]:
            lo, hi = tied.rows[r]
            ops.append(dist.P2POp(dist.isend, full[lo:hi].contiguous(), r, tied.group))
            if with_back:
                got[r] = torch.empty_like(full[lo:hi], memory_format=torch.contiguous_format)
                ops.append(dist.P2POp(dist.irecv, got[r], r, tied.group))
    else:
        src = tied.full_rank
        got[src] = torch.empty_like(shard, memory_format=torch.contiguous_format)
        if with_back:
            ops.append(dist.P2POp(dist.isend, shard.contiguous(), src, tied.group))
        ops.append(dist.P2POp(dist.irecv, got[src], src, tied.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return got


def copy_rows(tied: TiedRows, full: torch.Tensor | None, shard: torch.Tensor | None) -> None:
    """Shard ranks' rows := the full weight's rows (collective over full_rank and the shard ranks)."""
    me = _role(tied)
    if me is None:
        return
    _check(tied, me, full, shard, "copy_rows")
    with torch.no_grad():
        if me == tied.full_rank and me in tied.rows:
            lo, hi = tied.rows[me]
            shard.copy_(full[lo:hi])
        got = _exchange(tied, me, full, shard, with_back=False)
        if me != tied.full_rank:
            shard.copy_(got[tied.full_rank])


def sum_rows(tied: TiedRows, full_grad: torch.Tensor | None, shard_grad: torch.Tensor | None) -> None:
    """Both sides := full_grad[lo:hi] + shard_grad, in place (the tie's gradient), deadlock-free (batched isend/irecv),
    the full rank's own shard (full_rank in rows) summed locally."""
    me = _role(tied)
    if me is None:
        return
    _check(tied, me, full_grad, shard_grad, "sum_rows")
    with torch.no_grad():
        got = _exchange(tied, me, full_grad, shard_grad, with_back=True)
        if me == tied.full_rank:
            for r, theirs in got.items():
                lo, hi = tied.rows[r]
                full_grad[lo:hi].add_(theirs)
            if me in tied.rows:
                lo, hi = tied.rows[me]
                full_grad[lo:hi].add_(shard_grad)
                shard_grad.copy_(full_grad[lo:hi])
        else:
            # the same two addends as the full rank's sum (IEEE addition commutes): both sides bit-equal
            shard_grad.add_(got[tied.full_rank])
