"""Split backward on Megatron's own linears: forward + I + W against forward + B, on this CPU.

Usage: PYTHONPATH=. python benchmarks/megatron_wgrad.py [--hidden 512] [--layers 4] [--seq 256] [--batch 4]

A stack of Megatron MLP blocks (ColumnParallelLinear -> GELU -> RowParallelLinear, local
spec, TP=1 on a one-rank gloo group). Three backward variants on the same model and data:
B (Megatron's fused backward), I+W with the adapter's split linears (each linear runs its
input GEMM at I and its weight GEMM at W, once), and I+W with the executor's plain graph
split (the linear's one autograd Function runs whole at I and again at W). Prints median
times and (I+W)/B for both splits; the split-linear ratio should be within 10% of 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from octopipe_plugin.testing.megatron_wgrad import time_backward

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        t = time_backward(args.hidden, args.layers, args.seq, args.batch, args.reps)
        dist.destroy_process_group()
    b = t["B"]
    split = t["I split linears"] + t["W split linears"]
    plain = t["I plain split"] + t["W plain split"]
    print(f"Megatron MLP stack: hidden {args.hidden}, {args.layers} blocks, seq {args.seq}, batch {args.batch}, "
          f"1 thread, CPU time of this process, median of {args.reps}")
    print(f"  B                            {b:8.2f} ms")
    print(f"  I+W (split linears)          {split:8.2f} ms   I {t['I split linears']:.2f} + W "
          f"{t['W split linears']:.2f}   (I+W)/B = {split / b:.2f}")
    print(f"  I+W (plain graph split)      {plain:8.2f} ms   I {t['I plain split']:.2f} + W "
          f"{t['W plain split']:.2f}   (I+W)/B = {plain / b:.2f}")


if __name__ == "__main__":
    main()
