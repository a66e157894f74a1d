"""Run in a fresh process by test_megatron_startup_profile.py: `--octopipe-profile` at start-up, print JSON.

The real profiler builds megatron-core layers on CPU, which needs the Megatron tests' CUDA shims
(tests/adapters/megatron/megatron_cpu_shims.py); they are installed in this throw-away process only.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))
import megatron_cpu_shims  # noqa: E402

megatron_cpu_shims.install()
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from launch_helpers import TINY_GPT, parse  # noqa: E402
from octopipe_plugin.adapters.megatron import startup  # noqa: E402


def main(cache_dir: str) -> None:
    """Tune at start-up with the profiler twice (the second from its cache); print what reached the graph."""
    seen = []
    real = startup.model_from_megatron

    def recording(src, **kw):
        seen.append(kw.get("measured"))
        return real(src, **kw)

    startup.model_from_megatron = recording  # records the seam's input, then builds the real model
    out = []
    for _ in range(2):
        args = parse(TINY_GPT + ["--global-batch-size", "2", "--pipeline-schedule", "octopipe",
                                 "--octopipe-cluster", "h100x1", "--octopipe-tune-iterations", "5",
                                 "--octopipe-profile", "--octopipe-profile-repeats", "1",
                                 "--octopipe-profile-cache", cache_dir], validate=False)
        out.append({"plan_meta": args.octopipe_plan["meta"], "measured": seen[-1],
                    "left_open": dist.is_initialized() or parallel_state.model_parallel_is_initialized(),
                    "cached": sorted(os.listdir(cache_dir))})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
