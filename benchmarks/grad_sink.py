"""The two gradient sinks of TorchStages on the same stages: 'autograd' (default) against 'direct'.

Usage: PYTHONPATH=. python benchmarks/grad_sink.py [--reps 15]

One process, two stages of the toy model (hidden 64, seq 32, batch 4, float32), 8
micro-batches through F then fused B, or F then I and W; prints the median time of each
sink, alternating the two so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from octopipe_plugin.executor import TorchStages  # noqa: E402
from octopipe_plugin.testing.toy import (  # noqa: E402
    ToySpec, boundary_metas, build_layers, loss_fn, microbatch, stage_modules,
)

SPEC = ToySpec(hidden=64, seq=32, batch=4, dtype=torch.float32, layers=("in",) + ("mlp", "attn") * 4 + ("head",))
M = 8


def one_step(layers, sink: str, split: bool) -> float:
    """Seconds for M micro-batches through both stages."""
    run = TorchStages(modules=stage_modules(layers, [(0, 5), (5, 10)], [0, 1]), num_stages=2, num_microbatches=M,
                      metas=boundary_metas(SPEC, 2), load_input=lambda mb: microbatch(SPEC, mb)[0],
                      loss_fn=loss_fn(SPEC), grad_sink=sink)
    t0 = time.perf_counter()
    for mb in range(M):
        run.forward(1, mb, run.forward(0, mb, None))
        if split:
            run.backward_input(0, mb, run.backward_input(1, mb, None))
            run.backward_weight(1, mb)
            run.backward_weight(0, mb)
        else:
            run.backward(0, mb, run.backward(1, mb, None))
    return time.perf_counter() - t0


def main() -> None:
    """Print the median step of each sink, fused and split backward."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = build_layers(SPEC)
    for split in (False, True):
        times = {"autograd": [], "direct": []}
        for _ in range(args.reps):
            for sink in times:
                times[sink].append(one_step(layers, sink, split))
        med = {s: statistics.median(v) * 1000 for s, v in times.items()}
        print(f"{'I+W' if split else 'B':<4} autograd {med['autograd']:7.1f} ms  direct {med['direct']:7.1f} ms  "
              f"autograd/direct {med['autograd'] / med['direct']:.3f}")


if __name__ == "__main__":
    main()
