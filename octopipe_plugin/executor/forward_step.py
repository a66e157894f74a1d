"""StageRunner driven by a Megatron-style `forward_step_func(data_iterator, model) -> (output, loss_func)`.

The convention the Megatron adapter needs, in pure torch: each stage's model chunk takes
its pipeline input through `set_input_tensor(tensor)` (None on the first stage), the
forward step reads its micro-batch from a data iterator, and on the last stage
`loss_func(output)` returns the loss first (Megatron returns (loss, reduced dict) or
(loss, num_tokens, reduced dict); both come back per micro-batch in the step's result).
The micro-batch comes from the step's data source (`run_step(data={stage: iterator})`),
or from `data_iterators` given at construction (one step's worth: a runner per step); each
forward gets an iterator holding exactly its own micro-batch, since plans may run a stage's
forwards out of order.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

from torch import nn

from .data import MicroBatches
from .torch_stage import TorchStages


IndexedBatches = MicroBatches  # the earlier name (Megatron adapter): batch k of a stream, on demand


class ForwardStepStages(TorchStages):
    """TorchStages whose forward calls `forward_step_func` on the stage's model chunk."""

    def __init__(self, *, models: Mapping[int, nn.Module], forward_step_func: Callable, num_stages: int,
                 num_microbatches: int, metas: Sequence | None = None,
                 data_iterators: Mapping[int, Iterator] | None = None, **options):
        super().__init__(modules=models, num_stages=num_stages, num_microbatches=num_microbatches, metas=metas,
                         **options)
        self.forward_step_func = forward_step_func
        self.batches = {s: MicroBatches(it) for s, it in (data_iterators or {}).items()}

    def _compute(self, stage: int, mb: int, x, batch):
        model = self.modules[stage]
        model.set_input_tensor(None if stage == 0 else x)
        if batch is None and stage in self.batches:
            batch = self.batches[stage].get(mb)
        # stages without data get None, as Megatron passes to its middle stages
        data = iter([batch]) if batch is not None else None
        output, loss_func = self.forward_step_func(data, model)
        return loss_func(output) if stage == self.num_stages - 1 else output
