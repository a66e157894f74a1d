"""Stand-in layers for DeepSpeed pipelines: a LayerSpec list of the core's sleeping layers.

Each model-graph layer becomes one `SleepLayer` (testing/sleep_layer.py: F forward, I on the
input-gradient path, W on a separate weight path, on the rank's DeviceClock), the same layer
the Megatron benchmark's chunks hold and the same timing rule as the executor's dry run, so
the stock PipelineEngine, its DualPipeVEngine and OctoPipeEngine run side by side on one
model and a measured speedup compares engines, not stand-ins. Each layer's parameter is sized
in proportion to the real layer's, so DeepSpeed's `parameters` partition splits the stand-in
model where it would split the real one. Sleeping costs no CPU, so eight ranks fit on two cores.
On the wall clock the activation is as wide as the model's bytes across a cut (`standin_width`):
DeepSpeed's p2p moves it for real (every layer passes it on: which layer ends a stage is the
engine's partition's to say).
"""

from __future__ import annotations

import time

import torch

from ..executor.clock import DeviceClock, wall_numel
from .sleep_layer import DTYPE, SleepLayer

WIDTH = 8  # the activation every stand-in layer passes on: [micro-batch, WIDTH] float64 (element 0: a time stamp)


def standin_width(clock: str, model) -> int:
    """The activation width: the stamp's WIDTH, or on the wall clock the model's largest layer output in float64."""
    return wall_numel(max(layer.output_bytes for layer in model.layers), WIDTH) if clock == "wall" else WIDTH


def standin_numel(layer, param_divisor: float) -> int:
    """The stand-in parameter count of a model layer: its state bytes / 18 (mixed-precision Adam) / divisor."""
    return max(1, round(layer.state_bytes / 18 / param_divisor))


def standin_specs(model, scale: float, param_divisor: float, clock: DeviceClock):
    """One LayerSpec of SleepLayer per model layer on `clock`: costs times `scale`, sizes by `standin_numel`.

    The parameters are float32 (DeepSpeed's gradient reduction refuses float64); the activations
    stay float64 for their time stamps.
    """
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(SleepLayer, clock, layer.fwd_ms * scale, layer.bwd_ms * scale, layer.wgrad_ms * scale,
                      numel=standin_numel(layer, param_divisor), param_dtype=torch.float32)
            for layer in model.layers]


def whole_layer_model(model):
    """The model as a stand-in list runs it: each entry one SleepLayer without sub-modules, so a memory choice can
    recompute or offload the whole layer but no selective recompute has anything to name (the analytic costs'
    sub-module shares, `simulator.costs.selective_modules`, left out with the analytic meta)."""
    from dataclasses import replace

    meta = {**(model.meta or {}), "cost_model": "stand-in"}
    return replace(model, layers=tuple(replace(layer, selective=()) for layer in model.layers), meta=meta)


def standin_loss(out, labels):
    """A scalar from the last stand-in layer's output (the loss's own cost is part of the last layer)."""
    return (out * labels).mean()


def standin_batches(n: int, micro_batch_size: int = 1, width: int = WIDTH):
    """n micro-batches (input, labels) of the stand-in width (float64, as the time stamps need)."""
    return [(torch.zeros(micro_batch_size, width, dtype=DTYPE), torch.ones(micro_batch_size, width, dtype=DTYPE))
            for _ in range(n)]


def timed_train_batches(engine, clock: DeviceClock, num_microbatches: int, steps: int,
                        width: int = WIDTH) -> list[float]:
    """Wall seconds of `steps` train_batch calls after one warm-up, every rank starting each at one instant.

    Boundaries carry device-clock times across ranks (the Megatron benchmark's rule), so all ranks start
    their clocks at the instant rank 0 broadcasts."""
    import deepspeed

    spans = []
    for _ in range(steps + 1):
        deepspeed.comm.barrier()
        start = torch.tensor([time.time() + 0.2], dtype=torch.float64)
        torch.distributed.broadcast(start, src=0)
        t0 = float(start[0])
        time.sleep(max(0.0, t0 - time.time()))
        clock.start(t0)
        engine.train_batch(data_iter=iter(standin_batches(num_microbatches, width=width)))
        spans.append(time.time() - t0)
    return spans[1:]
