"""Run in a fresh process by test_megatron_profile.py: profile real Megatron layers on CPU, print JSON.

Test-only CUDA shims (megatron-core 0.19.2's local attention asks for a CUDA device for its
scratch buffer and its causal mask, the MoE dispatcher a side stream; its RNG tracker forks
the CUDA generator) come from tests/adapters/megatron/megatron_cpu_shims.py, never the plugin;
they are installed in this throw-away process so no other test sees them.
"""

import json
import os
import sys

import torch

# The shims are the Megatron tests' own (one copy): loaded from their folder, not the plugin.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
import megatron_cpu_shims  # noqa: E402

megatron_cpu_shims.install()
torch.set_num_threads(1)

from octopipe_plugin.adapters.megatron.profile import megatron_builders, megatron_inputs  # noqa: E402
from octopipe_plugin.costs import load_arch  # noqa: E402
from octopipe_plugin.formats.model import model_to_dict  # noqa: E402
from octopipe_plugin.profile import ProfileSettings  # noqa: E402
from octopipe_plugin.profile.arch_profile import profile_arch  # noqa: E402


def main(cache_dir: str) -> None:
    """Profile a small MoE model twice (the second from the cache) and print both results."""
    arch = load_arch("deepseek-v3-mini", hidden=64, ffn=128, moe_ffn=32, heads=4, kv_heads=4, head_dim=0, vocab=512,
                     seq_len=32, num_experts=4, top_k=2, shared_experts=1, num_layers=3, first_dense_layers=1,
                     mtp_depth=0, tp=1)
    out = []
    for _ in range(2):
        r = profile_arch(arch, megatron_builders(arch, "cpu", torch.float32), impl="megatron", dtype=torch.float32,
                         inputs=megatron_inputs(arch, torch.float32),
                         settings=ProfileSettings(device="cpu", warmup=1, repeats=2, cache_dir=cache_dir,
                                                  versions_extra=("megatron-core",)))
        out.append({"model": model_to_dict(r.model), "measured": r.stats.measured, "hits": r.stats.cache_hits})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
