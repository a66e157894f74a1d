"""Stand-in Megatron model chunks: real `MegatronModule` chunks of the core's sleeping layers.

Any schedule that drives Megatron chunks (Megatron's own interleaved 1F1B, OctoPipe's) can run
them: each chunk takes its pipeline input through `set_input_tensor`, the first chunk reads
its micro-batch from the data iterator, the last returns what a loss function reduces. Each
layer of the model graph becomes one `SleepLayer` (testing/sleep_layer.py: F, I and W on
separate autograd paths, on the rank's DeviceClock), the same layer the DeepSpeed benchmark
and the executor's timing rule use, so both benchmarks compare executors, not stand-ins.
The first layer of a chunk waits for the transfer into it, the last charges the one out.
On the wall clock the boundary is as large as the model's bytes across a cut
(`boundary_shape`): Megatron's p2p moves it for real, and only a chunk's last layer makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..executor.clock import DeviceClock, wall_numel
from .sleep_layer import DTYPE, SleepLayer

BOUNDARY_SHAPE = (1, 1, 4)  # (sequence, micro-batch, hidden) of every stand-in boundary: the stamp is element 0


def boundary_shape(clock: str, model) -> tuple[int, int, int]:
    """The (sequence, micro-batch, hidden) every boundary has: the stamp's 4 numbers, or on the wall clock the
    model's largest layer output in float64 elements (Megatron sends one shape across every cut)."""
    if clock != "wall":
        return BOUNDARY_SHAPE
    return (1, 1, wall_numel(max(layer.output_bytes for layer in model.layers), BOUNDARY_SHAPE[2]))


@dataclass(frozen=True, kw_only=True, slots=True)
class StandInStage:
    """One chunk's stand-in layers: per-layer (F, I, W) ms and the transfer ms into and out of the chunk."""

    stage: int
    layers: tuple[tuple[float, float, float], ...]
    hop_in_ms: float  # previous stage -> this one (0 on the same device or for the first stage)
    hop_out_ms: float  # this stage -> the next one (its gradient comes back over the same link)
    first: bool
    last: bool
    boundary: tuple[int, ...] = BOUNDARY_SHAPE  # the shape this chunk sends on (boundary_shape)


def standin_chunk_class():
    """The chunk class, built on megatron.core's MegatronModule (imported only when a chunk is made)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class StandInChunk(MegatronModule):
        """A Megatron model chunk of stand-in layers (pre_process on the first stage, post_process on the last)."""

        def __init__(self, config, spec: StandInStage, clock: DeviceClock):
            super().__init__(config=config)
            self.spec = spec
            self.pre_process, self.post_process = spec.first, spec.last
            self.model_type = ModelType.encoder_or_decoder  # what get_model sets on every chunk
            self.input_tensor = None
            n = len(spec.layers)
            # inner layers pass the small stamp shape on; the last one makes what is sent (the last stage's: loss)
            out = lambda k: spec.boundary if k == max(n, 1) - 1 and not spec.last else BOUNDARY_SHAPE  # noqa: E731
            self.layers = nn.ModuleList(
                SleepLayer(clock, f, i, w, hop_in_ms=spec.hop_in_ms if k == 0 else 0.0,
                             hop_out_ms=spec.hop_out_ms if k == n - 1 else 0.0, out_shape=out(k))
                for k, (f, i, w) in enumerate(spec.layers))
            # an empty stage still hands its input on (and its gradient back) through one free layer
            if not n:
                self.layers.append(SleepLayer(clock, 0.0, 0.0, 0.0, spec.hop_in_ms, spec.hop_out_ms,
                                              out_shape=out(0)))

        share_embeddings_and_output_weights = False  # stand-ins tie no weights (what GPTModel answers untied)

        def shared_embedding_or_output_weight(self):
            """No embedding / output weight to keep in sync between ranks."""
            return None

        def set_input_tensor(self, input_tensor):
            """Megatron's hand-over of the pipeline input (a list of one tensor, or the tensor)."""
            if isinstance(input_tensor, (list, tuple)):
                input_tensor = input_tensor[0]
            self.input_tensor = input_tensor

        def forward(self, tokens=None):
            """Run the stand-in layers on the pipeline input (a fresh input that wants a gradient on stage 0)."""
            x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True) if self.pre_process \
                else self.input_tensor
            for layer in self.layers:
                x = layer(x)
            return x

    return StandInChunk


def standin_forward_step(data_iterator, model):
    """A Megatron forward_step_func for stand-in chunks: reads the batch on the first stage, loss on the last."""
    if data_iterator is not None and getattr(model, "pre_process", False):
        next(data_iterator)
    output = model()

    def loss_func(output_tensor):
        loss = output_tensor.sum() * 0.0  # the value is irrelevant; its backward starts the I/W chain
        return loss, {"lm loss": loss.detach()}

    return output, loss_func
