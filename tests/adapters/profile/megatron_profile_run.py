"""Run in a fresh process by test_megatron_profile.py: profile real Megatron layers on CPU, print JSON.

Test-only CUDA shims (megatron-core 0.19.2's local attention asks for a CUDA device for its
scratch buffer and its causal mask, the MoE dispatcher a side stream; its RNG tracker forks
the CUDA generator): each is redirected to the CPU here,
never in the plugin. They live in this throw-away process so no other test sees them.
"""

import contextlib
import json
import sys

import torch

torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
torch.set_num_threads(1)


class _NullStream:
    """A CPU stand-in for a CUDA stream (the MoE all-to-all dispatcher makes one): all work is in order."""

    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    """A CPU stand-in for a CUDA event: already complete."""

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def record(self, stream=None):
        return None


torch.cuda.Event = lambda *a, **k: _NullEvent()
torch.cuda.Stream = lambda *a, **k: _NullStream()
torch.cuda.current_stream = lambda *a, **k: _NullStream()
torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _on_cpu(factory):
    """A tensor factory whose device='cuda' means the CPU (Megatron builds its causal mask on 'cuda')."""
    def call(*args, **kwargs):
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call


for _name in ("ones", "zeros", "empty", "arange", "full"):
    setattr(torch, _name, _on_cpu(getattr(torch, _name)))

import megatron.core.tensor_parallel.random as rnd  # noqa: E402

rnd.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

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
