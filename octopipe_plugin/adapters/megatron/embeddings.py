"""Tied word embeddings (and MTP's embedding copy) under any stage->rank map.

Megatron keeps one copy of the word-embedding weight per chunk that needs it (the
embedding chunk, the LM-head chunk when tied, the MTP chunk), initialises the copies by an
all-reduce over the embedding group {first pp rank, last pp rank} and sums their
gradients over that group after each step. Under a plan, the copies live on the ranks the
plan chooses — under a V-shape the embedding and the LM head are two chunks of rank 0, and
Megatron's construction all-reduce over {0, P-1} waits forever for rank P-1.

`mapping.embedding_ranks_fn(plan, model)` gives `initialize_model_parallel(get_embedding_ranks=...)`
the ranks that really hold copies; copies that share a rank are tied here, locally:
`tie_local_copies` copies the embedding into them after construction and
`sum_local_grads` sums their main_grads before Megatron's finalize step.

A tied LM head that the plan splits keeps no whole copy: each shard rank holds rows of the
embedding (vocab_shards.build_tied_head_shard, initialised from the embedding's rank), and the
`HeadTie` registered here on the chunks involved sums their gradients with the embedding's
(`sum_head_tie`: executor.tied_rows.sum_rows) after the step's backward and before those
chunks' data-parallel reduction starts (`head_tie_chunks` are held until then). Megatron's
embedding group then holds only the ranks with whole copies (mapping.copy_ranks).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ...errors import OctoPipeError


def local_copy_chunks(model: Sequence[torch.nn.Module]) -> set[int]:
    """Indices of this rank's chunks holding a word-embedding copy, when the rank holds two or more
    (their gradients are summed before either chunk's gradient reduction may start)."""
    _, _, holders = _holders(model)
    return set(holders) if len(holders) > 1 else set()


def _copies(model: Sequence[torch.nn.Module]) -> tuple[torch.nn.Parameter | None, list[torch.nn.Parameter]]:
    """(the embedding chunk's weight, the other local copies) among this rank's chunks."""
    source, others, _ = _holders(model)
    return source, others


def _holders(model: Sequence[torch.nn.Module]):
    """(embedding weight, other copies, indices of the chunks holding any of them)."""
    from megatron.core.utils import get_attr_wrapped_model

    source, others, holders = None, [], []
    for c, chunk in enumerate(model):
        inner = get_attr_wrapped_model(chunk, "shared_embedding_or_output_weight", return_model_obj=True)
        if inner is None:
            continue
        tied = inner.share_embeddings_and_output_weights and inner.post_process
        if not (inner.pre_process or tied or getattr(inner, "mtp_process", False)):
            continue
        weight = inner.shared_embedding_or_output_weight()
        if weight is None:
            continue
        holders.append(c)
        if inner.pre_process:
            source = weight
        elif all(weight is not o for o in others):
            others.append(weight)
    return source, others, holders


def tie_local_copies(model: Sequence[torch.nn.Module]) -> int:
    """Copy the embedding chunk's weight into the other copies on this rank (Megatron zero-fills them)."""
    source, others = _copies(model)
    if source is None:
        return 0
    with torch.no_grad():
        for w in others:
            w.copy_(source)
    return len(others)


def sum_local_grads(model: Sequence[torch.nn.Module]) -> None:
    """Sum the main_grads of the copies held by this rank and give every copy the sum."""
    source, others = _copies(model)
    if source is None or not others:
        return
    grads = [getattr(w, "main_grad", None) for w in (source, *others)]
    if any(g is None for g in grads):
        return
    total = torch.stack(grads).sum(0)
    for g in grads:
        g.copy_(total)


@dataclass(frozen=True)
class HeadTie:
    """One rank's side of a split head's tie: the embedding's weight (on its rank) and/or this rank's shard weight."""

    tie: object  # executor.tied_rows.TiedRows
    full: torch.nn.Parameter | None
    shard: torch.nn.Parameter | None


# inner GPTModel chunk -> its rank's HeadTie (weak: a model that goes away takes its entry with it)
_TIES: "weakref.WeakKeyDictionary[torch.nn.Module, HeadTie]" = weakref.WeakKeyDictionary()


def register_head_tie(chunks: Sequence[torch.nn.Module], head_tie: HeadTie) -> None:
    """Record `head_tie` on the chunks holding its weights (the embedding's chunk, the shard's host chunk)."""
    for chunk in chunks:
        if any(p is w for p in chunk.parameters() for w in (head_tie.full, head_tie.shard) if w is not None):
            _TIES[chunk] = head_tie


def _inner(chunk):
    """The language model inside a (DDP / Float16Module) chunk, or None for a chunk that is none."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(chunk, "shared_embedding_or_output_weight", return_model_obj=True)
    except RuntimeError:  # not a language model (no embedding, no head): it holds no tie
        return None


def head_tie_chunks(model: Sequence[torch.nn.Module]) -> set[int]:
    """Indices of this rank's chunks holding a weight of a split head's tie (their reduction waits for the sum)."""
    return {c for c, chunk in enumerate(model) if _inner(chunk) in _TIES}


def sum_head_tie(model: Sequence[torch.nn.Module]) -> None:
    """The tie's gradient: embedding rows' and shards' main_grads := their sum (collective over the tie's ranks)."""
    from octopipe_plugin.executor.tied_rows import sum_rows

    found = next((_TIES[_inner(c)] for c in model if _inner(c) in _TIES), None)
    if found is None:
        return
    grads = [getattr(w, "main_grad", None) if w is not None else None for w in (found.full, found.shard)]
    for w, g in zip((found.full, found.shard), grads):
        if w is not None and g is None:
            raise OctoPipeError("a split LM head tied to the embedding needs Megatron's DDP (main_grad) on its weights")
    sum_rows(found.tie, *grads)


def uneven_embedding_entry(chunk: torch.nn.Module) -> bool:
    """Make the embedding chunk's checkpoint entry of the word embedding an uneven-grid ShardedTensor (once).

    The tied head's shards save their rows under the embedding's key on no regular grid, and dist-ckpt
    wants one grid kind per key (validation.py `_validate_sharding_for_key`): the embedding's entry,
    same offsets and data, drops its grid too (torch DCP then checks the coverage, as for the shards).
    The checkpoint is the same either way, so Megatron's own layout (regular) loads it and writes what
    this layout loads."""
    from .hooks import replace_sharded_state_dict
    from .vocab_shards import EMBEDDING_KEY

    def make(original):
        def sharded_state_dict(prefix: str = "", *args, **kwargs):
            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            out = original(prefix, *args, **kwargs)
            entry = out.get(f"{prefix}{EMBEDDING_KEY}")
            if isinstance(entry, ShardedTensor):
                entry.axis_fragmentations = None
            return out

        return sharded_state_dict

    return replace_sharded_state_dict(chunk, make, "a split head tied to the word embedding: the embedding's "
                                                   "entry on the shards' uneven grid")
