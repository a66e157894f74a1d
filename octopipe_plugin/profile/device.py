"""The device a profile runs on: its name (part of the cache key) and the GPU table entry it matches."""

from __future__ import annotations

import os
import platform
from importlib import metadata

import torch

from ..gpus import GPUS, GpuSpec


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device`, or the current CUDA device when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def device_name(device: torch.device) -> str:
    """A name that tells machines apart for timing: GPU model, or CPU model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {_cpu_model()} x{torch.get_num_threads()} threads"


def device_memory_bytes(device: torch.device) -> int:
    """Memory a device offers a plan: a GPU's total memory, on the CPU the host memory available now."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # not Linux: the pages free now (what MemAvailable improves on)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_spec_for(name: str) -> GpuSpec | None:
    """The GPU table entry a device name (e.g. 'NVIDIA H200', 'NVIDIA H100 80GB HBM3') matches, or None."""
    text = name.upper().replace("NVIDIA", "").strip()
    for spec in GPUS.values():
        family = spec.name.split("-")[0].upper()  # A100, H100, H200, B200
        if family in text.split() or text.startswith(family):
            return spec
    return None


def library_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Versions that change measured costs: torch, OctoPipe, and any `extra` distributions (megatron-core...)."""
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for dist in ("octopipe_plugin", *extra):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out
