"""Megatron-core's own interleaved-1F1B order for one rank: the oracle of the built-ins that claim to be it.

Replays forward_backward_pipelining_with_interleaving's loop structure (warm-up forwards, then one forward and
one backward per step, then the cool-down backwards) with megatron's get_schedule_table and
get_pp_rank_microbatches; each backward pops the oldest forward of its model chunk (megatron's
input_tensors[chunk].pop(0)). With `overlap` (--overlap-moe-expert-parallel-comm) the warm-up count is
megatron's with the flag, and each steady step (forward k + warm-up, backward k) is one merged
combined_forward_backward_step: a pair.
"""

from __future__ import annotations

import types

from octopipe_plugin.actions import B, F


class Group:
    """The two calls megatron makes of a pipeline process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def communicator(p: int, r: int, v: int | None):
    """What get_pp_rank_microbatches reads of its p2p_communicator."""
    return types.SimpleNamespace(pp_group=Group(p, r), virtual_pipeline_model_parallel_size=v)


def megatron_order(mcore, p: int, r: int, v: int | None, m: int, g: int, overlap: bool = False):
    """(order, pairs) of rank r: its actions, and (with `overlap`) each merged step's (forward, backward)."""
    chunks = v or 1
    kw = {"overlap_moe_expert_parallel_comm": True} if overlap else {}
    total, _, warm, remaining = mcore.get_pp_rank_microbatches(m, chunks, g, p2p_communicator=communicator(p, r, v),
                                                               **kw)
    table = mcore.get_schedule_table(m, chunks, g) if v else [(i, 0) for i in range(m)]
    pending = {c: [] for c in range(chunks)}
    order, pairs = [], []

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
        if overlap:
            pairs.append((order[-2], order[-1]))
    for k in range(remaining, total):
        bwd(k)
    return order, pairs
