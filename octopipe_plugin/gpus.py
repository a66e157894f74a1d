"""GPU spec table (a leaf: imports only errors): peak dense bf16 FLOP/s, memory, HBM and link bandwidths.

Read by the cost model (costs/), the cluster format (formats/cluster.py checks `gpu` names) and
the profiler; it sits below formats in the tier table (docs/design.md) so that all of them may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from .errors import OctoPipeError

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """One accelerator model. Bandwidths are GB/s (1e9 B/s) in one direction, per GPU."""

    name: str
    peak_bf16_flops: float  # dense (no 2:4 sparsity) bf16 tensor-core FLOP/s
    memory_bytes: int
    hbm_gb_per_s: float
    nvlink_gb_per_s: float  # one direction (NVIDIA quotes both directions added)
    ib_gb_per_s: float  # one InfiniBand NIC per GPU, e.g. NDR 400 Gb/s = 50 GB/s
    efficiency: float  # achieved / peak on large bf16 GEMMs in training
    arch_major: int  # CUDA compute capability major (8 Ampere, 9 Hopper, 10 Blackwell): Megatron asks it
    hbm_efficiency: float = 0.8  # achieved / peak on streaming element-wise kernels
    # host memory one GPU may use (the DGX node's RAM over its 8 GPUs) and its device<->host copy bandwidth, one
    # direction (PCIe Gen4 x16 ~ 25 GB/s on A100, Gen5 x16 ~ 50 GB/s on H100 / H200 / B200): what offloaded
    # activations cost (docs/formats.md, "Memory choices")
    host_memory_bytes: int = 256 * GIB
    host_link_gb_per_s: float = 50.0

    @property
    def flops(self) -> float:
        """Achieved matmul FLOP/s."""
        return self.peak_bf16_flops * self.efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        """Achieved HBM bytes/s for memory-bound kernels."""
        return self.hbm_gb_per_s * 1e9 * self.hbm_efficiency


# Sources: NVIDIA A100 / H100 / H200 / DGX B200 datasheets (dense bf16, SXM parts).
# Memory: 80 GiB for the 80 GB parts (what the docs/formats.md example uses), 141 GB and
# 180 GB (DGX B200: 1,440 GB / 8) for H200 and B200 in decimal units as quoted.
# Efficiency: large-GEMM bf16 throughput seen in practice (~70% of peak on A100/H100/H200,
# lower on the young B200 software stack); this workplace's device notes report ~790 TFLOP/s
# of bf16 matrix work on an H200 (0.8 of peak), of which 0.75 is kept for whole layers.
_SPECS = (
    GpuSpec(name="A100-80G", peak_bf16_flops=312e12, memory_bytes=80 * GIB, hbm_gb_per_s=2039,
            nvlink_gb_per_s=300, ib_gb_per_s=25, efficiency=0.7, arch_major=8,
            host_memory_bytes=128 * GIB, host_link_gb_per_s=25.0),
    GpuSpec(name="H100-SXM", peak_bf16_flops=989e12, memory_bytes=80 * GIB, hbm_gb_per_s=3350,
            nvlink_gb_per_s=450, ib_gb_per_s=50, efficiency=0.7, arch_major=9),
    GpuSpec(name="H200", peak_bf16_flops=989e12, memory_bytes=141 * 10**9, hbm_gb_per_s=4800,
            nvlink_gb_per_s=450, ib_gb_per_s=50, efficiency=0.75, arch_major=9),
    GpuSpec(name="B200", peak_bf16_flops=2250e12, memory_bytes=180 * 10**9, hbm_gb_per_s=8000,
            nvlink_gb_per_s=900, ib_gb_per_s=50, efficiency=0.6, arch_major=10,
            host_memory_bytes=512 * GIB),
)

GPUS = MappingProxyType({g.name: g for g in _SPECS})

_ALIASES = MappingProxyType({
    "a100": "A100-80G", "a100-80g": "A100-80G", "a100-80gb": "A100-80G", "a100-sxm": "A100-80G",
    "h100": "H100-SXM", "h100-sxm": "H100-SXM", "h100-80g": "H100-SXM", "h100-80gb": "H100-SXM",
    "h200": "H200", "h200-sxm": "H200", "b200": "B200",
})


def known_gpu(name: str) -> str | None:
    """The canonical table name of a GPU name or alias (case-insensitive), or None when unknown."""
    key = str(name).strip().lower()
    return _ALIASES.get(key) or next((n for n in GPUS if n.lower() == key), None)


def get_gpu(name: str | GpuSpec) -> GpuSpec:
    """Look a GPU up by name or alias, case-insensitively; unknown names list the valid ones."""
    if isinstance(name, GpuSpec):
        return name
    canonical = known_gpu(name)
    if canonical is None:
        valid = ", ".join(sorted(set(GPUS) | {"A100", "H100", "H200", "B200"}))
        raise OctoPipeError(f"unknown GPU {name!r}; expected one of: {valid}")
    return GPUS[canonical]
