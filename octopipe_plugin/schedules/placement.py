"""Stage -> device maps of the built-in schedules: looped (round-robin) and V-shape (zig-zag)."""

from __future__ import annotations

import enum

from ..errors import PlanError


class Placement(str, enum.Enum):
    """looped: stage s on device s % p (Megatron); v: down the devices, then back up (ZB-V, DualPipeV)."""

    LOOPED = "looped"
    V = "v"


def looped(num_devices: int, stages_per_device: int) -> list[int]:
    """Stage s runs on device s % p, as Megatron places virtual pipeline stages."""
    return place(Placement.LOOPED, num_devices, stages_per_device)


def v_shape(num_devices: int, stages_per_device: int = 2) -> list[int]:
    """Chunk c of p stages runs down the devices when c is even and back up when odd (a V for two)."""
    return place(Placement.V, num_devices, stages_per_device)


def place(placement: Placement | str, num_devices: int, stages_per_device: int) -> list[int]:
    """The stage -> device list of a named placement with `stages_per_device` stages on every device."""
    kind = Placement(placement)
    _check(num_devices, stages_per_device)
    return place_stages(kind, num_devices, num_devices * stages_per_device)


def place_stages(placement: Placement | str, num_devices: int, num_stages: int) -> list[int]:
    """Looped or V-shape stage -> device list for any stage count (the last chunk may hold fewer than p)."""
    kind = Placement(placement)
    _check(num_devices, 1)
    out = []
    for s in range(num_stages):
        chunk, pos = divmod(s, num_devices)
        out.append(num_devices - 1 - pos if kind is Placement.V and chunk % 2 else pos)
    return out


def _check(num_devices: int, stages_per_device: int) -> None:
    if num_devices < 1 or stages_per_device < 1:
        raise PlanError(f"placement needs >= 1 device and >= 1 stage per device, got "
                        f"{num_devices} devices and {stages_per_device} stages per device")
