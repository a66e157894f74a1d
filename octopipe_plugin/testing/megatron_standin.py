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
Under a plan that splits the LM head, the head's layer is not in the owner chunk (its rows are
the rank's SleepShards'): the owner chunk ends in a `HeadHandOver` whose output is the head's
input, and reads its micro-batch from the data iterator as Megatron's last stage reads labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..executor.clock import DeviceClock, wall_numel
from ..executor.standin import pair_rest_ms
from .sleep_layer import DTYPE, HeadHandOver, SleepLayer, stamp

BOUNDARY_SHAPE = (1, 1, 4)  # (sequence, micro-batch, hidden) of every stand-in boundary: the stamp is element 0


def boundary_shape(clock: str, model, at_least: int = 0) -> tuple[int, int, int]:
    """The (sequence, micro-batch, hidden) every boundary has: the stamp's 4 numbers (`at_least` elements: a
    split head's hand-over, `split_numel`), or on the wall clock the model's largest layer output in float64
    elements (Megatron sends one shape across every cut)."""
    width = max(BOUNDARY_SHAPE[2], at_least)
    if clock != "wall":
        return BOUNDARY_SHAPE[:2] + (width,)
    return (1, 1, wall_numel(max(layer.output_bytes for layer in model.layers), width))


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
    split_head: bool = False  # the last stage of a plan that splits the LM head: ends in a HeadHandOver
    # the (scaled) phase sequences of the chunk's F and fused B, ((on the link, ms), ...) (simulator/pairs.py
    # stage_phases): what a pair sleeps overlapped; empty: nothing communicates, a pair sleeps F then B
    phases_f: tuple[tuple[bool, float], ...] = ()
    phases_b: tuple[tuple[bool, float], ...] = ()

    @property
    def fwd_ms(self) -> float:
        """The chunk's F."""
        return sum(f for f, _, _ in self.layers)

    @property
    def bwd_ms(self) -> float:
        """The chunk's fused backward (I + W of every layer)."""
        return sum(i + w for _, i, w in self.layers)


def standin_chunk_class():
    """The chunk class, built on megatron.core's MegatronModule (imported only when a chunk is made)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    plan_class = _schedule_plan_class()

    class StandInChunk(MegatronModule):
        """A Megatron model chunk of stand-in layers (pre_process on the first stage, post_process on the last)."""

        def __init__(self, config, spec: StandInStage, clock: DeviceClock, shards=None, pairs=None):
            super().__init__(config=config)
            self.spec = spec
            self.clock, self.pairs = clock, pairs  # pairs: the rank's PairSleeper (combined step's pairs)
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
            self.microbatch = None  # what the forward step read (the owner of a split head stamps it)
            if spec.split_head:
                if shards is None:
                    raise ValueError(f"stage {spec.stage} owns a split LM head: its chunk needs the rank's "
                                     "SleepShards (shards=)")
                self.layers.append(HeadHandOver(shards, mb=lambda: -1 if self.microbatch is None else self.microbatch))

        share_embeddings_and_output_weights = False  # stand-ins tie no weights (what GPTModel answers untied)

        def shared_embedding_or_output_weight(self):
            """No embedding / output weight to keep in sync between ranks."""
            return None

        def set_input_tensor(self, input_tensor):
            """Megatron's hand-over of the pipeline input (a list of one tensor, or the tensor)."""
            if isinstance(input_tensor, (list, tuple)):
                input_tensor = input_tensor[0]
            self.input_tensor = input_tensor

        def build_schedule_plan(self, tokens=None):
            """The combined step's schedule plan of one micro-batch through this chunk (GPTModel's counterpart)."""
            return plan_class(self, tokens)

        def forward(self, tokens=None, output_processor=None):
            """Run the stand-in layers on the pipeline input (a fresh input that wants a gradient on stage 0);
            `tokens`: the micro-batch the forward step read (first and last stage). `output_processor`:
            GPTModel's hook on the last stage, called as GPTModel calls it (the final hidden states and the
            labels, one token of [micro-batch, sequence] here); a split head's owner returns its answer."""
            self.microbatch = tokens
            x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True) if self.pre_process \
                else self.input_tensor
            for layer in self.layers:
                x = layer(x)
            if output_processor is not None and self.post_process:
                return output_processor(hidden_states=x, labels=torch.zeros(BOUNDARY_SHAPE[1::-1], dtype=torch.int64))
            return x

    return StandInChunk


def standin_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """A Megatron forward_step_func for stand-in chunks: reads the batch (the micro-batch's number) on the first
    and the last stage, as get_batch reads tokens and labels; loss on the last. `return_schedule_plan`: the combined
    step's call, answered with the chunk's schedule plan (as pretrain_gpt's forward_step answers it)."""
    mb = None
    if data_iterator is not None and (getattr(model, "pre_process", False) or getattr(model, "post_process", False)):
        mb = next(data_iterator)
    output = model.build_schedule_plan(mb) if return_schedule_plan else model(mb)

    def loss_func(output_tensor):
        loss = output_tensor.sum() * 0.0  # the value is irrelevant; its backward starts the I/W chain
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _schedule_plan_class():
    """The stand-ins' schedule plan, an AbstractSchedulePlan of megatron.core (the combined step checks the type)."""
    from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan

    class StandInSchedulePlan(AbstractSchedulePlan):
        """One micro-batch through one stand-in chunk under megatron-core's combined step (module docstring)."""

        def __init__(self, chunk, tokens):
            self.chunk, self.tokens = chunk, tokens
            self.vp_stage = getattr(chunk, "vp_stage", None)
            self.input = self.output = None
            self._event = None

        @property
        def event(self):
            """The event the combined step's loss node waits and records on (made when it asks: a CUDA event, or
            the CPU shims' stand-in on a CPU process, as for GPTModel's plans)."""
            if self._event is None:
                self._event = torch.cuda.Event()
            return self._event

        @staticmethod
        def run(f_schedule_plan, b_schedule_plan, b_grad=None, pre_forward=None, pre_backward=None,
                post_forward=None, post_backward=None):
            """F of `f_schedule_plan` and B of `b_schedule_plan` (either may be None), the hooks called where
            TransformerModelChunkSchedulePlan.run calls them; returns the forward's output."""
            f, b = f_schedule_plan, b_schedule_plan
            if f is not None and pre_forward is not None:
                pre_forward(f.vp_stage)
            if b is not None and pre_backward is not None:
                pre_backward(b.vp_stage)
            if f is not None and b is not None:
                out, dx = _paired(f, b, b_grad)
            else:
                out = f._forward() if f is not None else None
                dx = b._backward(b_grad) if b is not None else None
            if f is not None and post_forward is not None:
                post_forward(out, f.vp_stage)
            if b is not None and post_backward is not None:
                post_backward(dx, b.vp_stage)
            return out

        def _forward(self):
            # the input this micro-batch's forward read (the chunk's next forward sets another): its gradient is
            # what this plan's backward gives back (None on the first stage, whose chunk makes its own input)
            self.input = None if self.chunk.pre_process else self.chunk.input_tensor
            self.output = self.chunk(self.tokens)
            return self.output

        def _backward(self, grad):
            torch.autograd.backward(self.output, grad_tensors=grad)
            self.output = None
            return self.input.grad if self.input is not None else None

    def _paired(f, b, b_grad):
        """Both sides' graphs run without sleeping, then the pair sleeps its phases once both inputs have landed;
        its end is stamped on the forward's output and the backward's input gradient."""
        fc, bc = f.chunk, b.chunk
        clock = fc.clock
        x = None if fc.pre_process else fc.input_tensor
        ready = max(stamp(x) + fc.spec.hop_in_ms / 1000.0 if x is not None else 0.0,
                    stamp(b_grad) + bc.spec.hop_out_ms / 1000.0 if b_grad is not None and not bc.post_process
                    else 0.0)
        mode, clock.mode = clock.mode, "off"
        try:
            out = f._forward()
            dx = b._backward(b_grad)
        finally:
            clock.mode = mode
        sf, sb = fc.spec, bc.spec
        if sf.phases_f or sb.phases_b:
            seq_f, seq_b = sf.phases_f or ((False, sf.fwd_ms),), sb.phases_b or ((False, sb.bwd_ms),)
            rest = pair_rest_ms(sf.fwd_ms, sb.bwd_ms, seq_f, seq_b)
            if fc.pairs is None:
                raise ValueError(f"stage {sf.stage} pairs with stage {sb.stage}: its chunk needs the rank's "
                                 "PairSleeper (pairs=)")
            end = clock.overlapped(lambda: fc.pairs.sleep(seq_f, seq_b, rest), ready)
        else:  # nothing communicates: the two sides back to back, as the simulator prices such a pair
            end = clock.work(sf.fwd_ms + sb.bwd_ms, ready)
        with torch.no_grad():
            for t in (out, dx):
                if t is not None and t.numel():
                    t.view(-1)[0] = end
        return out, dx

    return StandInSchedulePlan
