"""A split embedding's token ids before the step: stage 0's rank reads them, the shard ranks receive them, and a
refusal on stage 0's rank ends every pipeline rank with its one line.

The shards' E look up the micro-batch's tokens, which only stage 0's rank reads (the framework adapter reads its
forward steps ahead). Stage 0's rank first tells every rank of the pipeline group whether it refused the step (one
int64 broadcast: the length of its one-line refusal, 0 when none, then the line's bytes); only then do the token ids
go to the other shard ranks (one int64 message [m, seq, mbs] each). The broadcast header also carries the ids
shape, so a runtime that knows no boundary shape ahead of the step (DeepSpeed's: `shape=None`) allocates from it.
A refusal therefore ends each rank at once with
the same line (an `ExecutorError` naming stage 0's rank), where a shard rank would otherwise wait in `recv` and
every other rank on stage 0's first boundary until the group's timeout.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import OctoPipeError, one_line
from .errors import ExecutorError


def exchange_tokens(split, *, owner: int, rank: int, group, read: Callable[[], torch.Tensor] | None,
                    shape: tuple[int, int] | None, num_microbatches: int, device) -> torch.Tensor | None:
    """The step's token ids [m, seq, mbs] on every rank of the embedding's `split` (None on the others); collective
    over `group` (the pipeline group, `owner` stage 0's rank in it). `read()` on `owner`: the token ids (whatever it
    raises refuses the step); `shape`: the micro-batch's id shape the step's boundary expects (None: any, the other
    ranks learn it from the header)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    tokens, refusal = None, None
    if rank == owner:
        try:
            tokens = read()
            if tokens.dim() != 3 or tokens.shape[0] != num_microbatches or (
                    shape is not None and tuple(tokens.shape[1:]) != tuple(shape)):
                want = "" if shape is None else f" {tuple(shape)[::-1]}"
                raise OctoPipeError(f"plan splits the embedding: stage 0's token ids have shape "
                                    f"{tuple(tokens.shape[1:])[::-1]} ([mbs, seq]) over {tokens.shape[0]} micro-batches, "
                                    f"the step's boundary{want} over {num_microbatches}: feed the "
                                    "micro-batch shape the run was configured with")
        except Exception as exc:  # noqa: BLE001 - whatever ends stage 0's read ends every rank (raised again below)
            refusal = exc
    line, want = _shared_refusal(refusal, tokens, src=ranks[owner], group=group, device=device)
    if refusal is not None:
        raise refusal
    if line is not None:
        raise ExecutorError(f"pipeline rank {rank}: stage 0's rank (pipeline rank {owner}) refused the step: {line}",
                            rank=rank, peer=owner)
    if rank != owner and rank not in split.devices:
        return None
    if rank == owner:
        tokens = tokens.to(device=device, dtype=torch.int64).contiguous()
        for d in split.devices:
            if d != owner:
                dist.send(tokens, dst=ranks[d], group=group)
        return tokens if rank in split.devices else None
    tokens = torch.empty(want, dtype=torch.int64, device=device)
    dist.recv(tokens, src=ranks[owner], group=group)
    return tokens


def _shared_refusal(refusal: BaseException | None, tokens, *, src: int, group,
                    device) -> tuple[str | None, tuple[int, ...]]:
    """(`src`'s one-line refusal or None, the ids' shape [m, seq, mbs]) on every rank of `group`: a header of the
    line's length and the shape, then the line's bytes."""
    import torch.distributed as dist

    data = one_line(refusal).encode() if refusal is not None else b""
    dims = list(tokens.shape) if refusal is None and tokens is not None else [0, 0, 0]
    header = torch.tensor([len(data), *dims], dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    n, *dims = (int(v) for v in header.tolist())
    if n == 0:
        return None, tuple(dims)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist()).decode(errors="replace"), tuple(dims)
