"""Memory a plan leaves free on every device (headroom), and the one rule usable = device memory - headroom.

The cost model counts what a plan puts on a device: weights, gradients, optimizer state and
live activations. A real GPU also holds what no plan accounts for: the CUDA context (about
0.5-1 GiB, outside PyTorch's allocator), NCCL's communicator buffers for the tensor-, data- and
pipeline-parallel groups (about 1-2 GiB with several groups), and the caching allocator's
fragmentation (a few percent of the peak). A plan at 99% of device memory is one fragment from
an out-of-memory error, so every front end (the CLI, both adapters) keeps DEFAULT free unless
told otherwise; the library (`tune`, `simulate`) keeps none unless the cluster says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .errors import OctoPipeError

_GIB = 2**30
DEFAULT = "8%"  # 6.4 GiB of an 80 GiB H100: context + NCCL buffers + fragmentation, with a margin
WHY = ("kept free for what the cost model does not count: the CUDA context (~0.5-1 GiB), NCCL communicator "
       "buffers (~1-2 GiB) and the allocator's fragmentation (a few %% of the peak)")
HELP = (f"memory left free on every device: GiB (6, 6GiB) or a fraction of device memory (8%%, 0.08; a bare "
        f"number below 1 is a fraction); 0 for none. Default {DEFAULT.replace('%', '%%')}, {WHY}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Headroom:
    """Headroom as asked: an absolute amount in GiB or a fraction of device memory (one of them non-zero, or none)."""

    gib: float = 0.0
    fraction: float = 0.0

    def bytes_for(self, memory_bytes: int) -> int:
        """Headroom in bytes on a device of `memory_bytes`."""
        return int(round(self.gib * _GIB)) if self.gib else int(memory_bytes * self.fraction)

    def describe(self, memory_bytes: int) -> str:
        """'6.4 GiB (8% of 80.0 GiB)' or '6.0 GiB' or 'none'."""
        if not self.gib and not self.fraction:
            return "none"
        amount = f"{self.bytes_for(memory_bytes) / _GIB:.1f} GiB"
        return f"{amount} ({self.fraction:.0%} of {memory_bytes / _GIB:.1f} GiB)" if self.fraction else amount


def parse_headroom(value, where: str = "--memory-headroom") -> Headroom:
    """A Headroom from '6', '6GiB', '6G', '8%', '0.08' or a number; refused in one line naming `where`."""
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%|gib|gb|g)?", text, flags=re.I)
    if m is None or isinstance(value, bool):
        raise OctoPipeError(f"{where} {value!r}: expected GiB (6, 6GiB) or a fraction of device memory (8%, 0.08)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        number, unit = number / 100.0, "fraction"
    elif not unit:
        unit = "fraction" if number < 1 else "gib"
    if unit == "fraction":
        if not 0 <= number < 1:
            raise OctoPipeError(f"{where} {value!r}: a fraction of device memory must be below 100%")
        return Headroom(fraction=number)
    return Headroom(gib=number)


def with_headroom(cluster, headroom: Headroom, where: str = "--memory-headroom"):
    """The cluster with `headroom` kept free on every device; refused when nothing would be left."""
    kept = headroom.bytes_for(cluster.memory_bytes)
    if kept >= cluster.memory_bytes:
        raise OctoPipeError(f"{where}: {kept / _GIB:.1f} GiB of headroom leaves nothing of the "
                            f"{cluster.memory_bytes / _GIB:.1f} GiB per device of {cluster.name}; ask for less")
    return replace(cluster, memory_headroom_bytes=kept)


def fit_word(peak_bytes: int, cluster) -> str:
    """'yes' within usable memory, 'only without headroom' within the device but not the usable part, else 'NO'."""
    if peak_bytes <= cluster.usable_memory_bytes:
        return "yes"
    return "only without headroom" if peak_bytes <= cluster.memory_bytes else "NO"
