"""StageRunner driven by a Megatron-style `forward_step_func(data_iterator, model) -> (output, loss_func)`.

The convention the Megatron adapter needs, in pure torch: each stage's model chunk takes
its pipeline input through `set_input_tensor(tensor)` (None on the first stage), the
forward step reads its micro-batch from that chunk's data iterator, and on the last stage
`loss_func(output)` returns the loss first (Megatron returns (loss, reduced dict) or
(loss, num_tokens, reduced dict)). Plans may run a stage's forwards out of micro-batch
order, so each iterator is wrapped to hand forward k exactly the k-th batch.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .interface import TensorMeta
from .torch_stage import TorchStages


class IndexedBatches:
    """Batch k of a sequential iterator, on demand (batches read ahead are kept until used)."""

    def __init__(self, source: Iterator):
        self.source = source
        self.read: dict[int, object] = {}
        self.count = 0

    def get(self, k: int):
        """The k-th batch (0-based) of the source; each is handed out once."""
        while self.count <= k:
            self.read[self.count] = next(self.source)
            self.count += 1
        return self.read.pop(k)


class ForwardStepStages(TorchStages):
    """TorchStages whose forward calls `forward_step_func` on the stage's model chunk."""

    def __init__(self, *, models: Mapping[int, nn.Module], forward_step_func: Callable,
                 data_iterators: Mapping[int, Iterator], num_stages: int, num_microbatches: int,
                 metas: Sequence[TensorMeta]):
        super().__init__(modules=models, num_stages=num_stages, num_microbatches=num_microbatches, metas=metas,
                         load_input=lambda mb: None, loss_fn=lambda out, mb: out)
        self.forward_step_func = forward_step_func
        self.batches = {s: IndexedBatches(it) for s, it in data_iterators.items()}

    def _first_input(self, mb: int) -> torch.Tensor:
        # The first stage's data comes from its iterator inside the step; this empty marker stands
        # for "no pipeline input", so the first stage owns no input gradient.
        return torch.empty(0)

    def _compute(self, stage: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        model = self.modules[stage]
        model.set_input_tensor(None if stage == 0 else x)
        # stages without data get None, as Megatron passes to its middle stages
        data = iter([self.batches[stage].get(mb)]) if stage in self.batches else None
        output, loss_func = self.forward_step_func(data, model)
        if stage < self.num_stages - 1:
            return output
        result = loss_func(output)
        return result[0] if isinstance(result, tuple) else result
