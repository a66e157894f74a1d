"""Run in a fresh process by test_megatron_profile.py: FLOPs of I, W and B of real Megatron layers as profiled.

The profiler times I and W through the module's `octopipe_split_backward` (the stage runner's
split of Megatron's linears); counted with torch's FlopCounterMode, I + W must equal B (each GEMM
once), where the executor's generic split on the unsplit linears gave I + W = B + the weight GEMMs.
CUDA shims: the Megatron tests' own (tests/adapters/megatron/megatron_cpu_shims.py).
"""

import json
import os
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
import megatron_cpu_shims  # noqa: E402

megatron_cpu_shims.install()
torch.set_num_threads(1)

from octopipe_plugin.adapters.megatron.profile import megatron_builders, megatron_inputs  # noqa: E402
from octopipe_plugin.costs import load_arch  # noqa: E402
from octopipe_plugin.executor.split_backward import backward_input, backward_weight  # noqa: E402


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main() -> None:
    arch = load_arch("llama3-8b", hidden=64, ffn=128, heads=4, kv_heads=4, head_dim=0, vocab=512, seq_len=32,
                     num_layers=2, tp=1)
    builders = megatron_builders(arch, "cpu", torch.float32)
    inputs = megatron_inputs(arch, torch.float32)
    out = {}
    for kind in ("dense", "lm_head"):
        module = builders[kind]()
        params = [p for p in module.parameters() if p.requires_grad]
        split = module.octopipe_split_backward
        row = {}
        for name, (run_i, run_w) in {"runner": (split.backward_input, split.backward_weight),
                                     "generic": (backward_input, backward_weight)}.items():
            x = inputs[kind](torch.device("cpu")).requires_grad_(True)
            y = module(x)
            box = {}
            fi = flops(lambda: box.setdefault("work", run_i([y], [torch.ones_like(y)], [x], params)[1]))
            fw = flops(lambda: run_w(box["work"], "autograd"))
            row[name] = {"I": fi, "W": fw}
        x = inputs[kind](torch.device("cpu")).requires_grad_(True)
        y = module(x)
        row["B"] = flops(lambda: torch.autograd.backward([y], [torch.ones_like(y)], inputs=params + [x]))
        out[kind] = row
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
