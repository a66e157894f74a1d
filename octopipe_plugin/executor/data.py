"""The step's data source: micro-batch k for each stage of the rank, read once, in order."""

from __future__ import annotations

from typing import Iterable, Mapping

from .errors import ExecutorError


class MicroBatches:
    """Batch k of a sequential source, on demand; read ahead of need when a plan runs micro-batches out of
    order, each batch kept until its `consumers` have taken it."""

    def __init__(self, source: Iterable, consumers: int = 1, *, rank: int = 0, limit: int | None = None):
        self.source = _iterator(source)
        self.consumers = consumers
        self.rank = rank
        self.limit = limit
        self.read: dict[int, list] = {}  # k -> [batch, takes left]
        self.count = 0

    def get(self, k: int):
        """The k-th batch (0-based) of the source."""
        while self.count <= k:
            try:
                batch = next(self.source)
            except StopIteration:
                raise ExecutorError(f"rank {self.rank}: the step's data source ended after {self.count} micro-batches"
                                    f"{'' if self.limit is None else f', the plan has {self.limit}'}",
                                    rank=self.rank) from None
            self.read[self.count] = [batch, self.consumers]
            self.count += 1
        entry = self.read[k]
        entry[1] -= 1
        if entry[1] <= 0:
            del self.read[k]
        return entry[0]


def _iterator(source):
    """`source` as an iterator: an object with `__next__` is used as it is (Megatron's RerunDataIterator has
    `__next__` but no `__iter__`), anything else through iter()."""
    return source if hasattr(source, "__next__") else iter(source)


class StepData:
    """Hands each forward of this rank its micro-batch from the step's data source.

    `data` is None (runners load their own data), one iterable shared by every stage of the
    rank (each batch is read once and handed to each of the rank's stages), or a mapping
    stage -> iterable (Megatron's per-chunk iterators; a stage missing or mapped to None gets None).
    """

    def __init__(self, data, stages: list[int], num_microbatches: int, rank: int = 0):
        self.shared: MicroBatches | None = None
        self.per_stage: dict[int, MicroBatches] = {}
        if data is None:
            return
        if isinstance(data, Mapping):
            self.per_stage = {s: MicroBatches(src, 1, rank=rank, limit=num_microbatches)
                              for s, src in data.items() if src is not None and s in stages}
        else:
            self.shared = MicroBatches(data, len(stages), rank=rank, limit=num_microbatches)

    def get(self, stage: int, mb: int):
        """Micro-batch `mb` for `stage` (None where the step gives this stage no data)."""
        if self.shared is not None:
            return self.shared.get(mb)
        src = self.per_stage.get(stage)
        return src.get(mb) if src is not None else None
