"""`octopipe-cluster/1`: devices, memory and links."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import check_format, check_value, field, load_json, write_json
from .. import limits as L
from ..errors import FormatError
from ..gpus import GPUS, known_gpu

CLUSTER_FORMAT = "octopipe-cluster/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A link class: bandwidth in GB/s (1e9 B/s) and latency in microseconds."""

    bandwidth_gb_per_s: float
    latency_us: float

    def transfer_ms(self, nbytes: float) -> float:
        """Time to move `nbytes` over this link (docs/formats.md)."""
        return self.latency_us / 1000.0 + nbytes / (self.bandwidth_gb_per_s * 1e9) * 1000.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Devices 0..num_devices-1, `devices_per_node` to a node, equal memory each."""

    num_devices: int
    devices_per_node: int
    memory_bytes: int
    intra_node: Link
    inter_node: Link
    name: str = "cluster"
    # GPU whose analytic costs fit this cluster (canonical name of octopipe_plugin/gpus.py, e.g. "A100-80G"); None: unsaid
    gpu: str | None = None
    # bytes kept free on every device for what no plan accounts for (headroom.py); not part of the file format
    memory_headroom_bytes: int = 0
    # host memory each device may fill with offloaded activations, and its device<->host copy bandwidth (GB/s, one
    # direction); None: the `gpu`'s figures of gpus.py (H100-SXM's where no gpu is said): `host_memory`, `host_link`
    host_memory_bytes: int | None = None
    host_link_gb_per_s: float | None = None

    @property
    def host_memory(self) -> int:
        """Host bytes one device may hold offloaded (the field, else the GPU table's: docs/formats.md)."""
        return self.host_memory_bytes if self.host_memory_bytes is not None else self._gpu_spec().host_memory_bytes

    @property
    def host_link(self) -> float:
        """Device<->host copy bandwidth of each device in GB/s (the field, else the GPU table's)."""
        return self.host_rate()

    def host_rate(self, profiled: float | None = None) -> float:
        """The device<->host GB/s offloads are priced with, the one rule: this file's `host_link_gb_per_s` (said, or
        measured by `cluster --measure`), else `profiled` (a profiled model's measured rate, Model.host_link_gb_per_s),
        else the GPU table's figure."""
        if self.host_link_gb_per_s is not None:
            return self.host_link_gb_per_s
        return profiled if profiled is not None else self._gpu_spec().host_link_gb_per_s

    def host_copy_ms(self, nbytes: float, profiled: float | None = None) -> float:
        """Time to copy `nbytes` between a device and its host memory, either way (ms), at `host_rate(profiled)`."""
        return nbytes / (self.host_rate(profiled) * 1e9) * 1000.0

    def _gpu_spec(self):
        return GPUS[self.gpu or "H100-SXM"]

    @property
    def usable_memory_bytes(self) -> int:
        """Memory a plan may fill on each device: device memory less the headroom (the one place of this rule)."""
        return self.memory_bytes - self.memory_headroom_bytes

    def node_of(self, device: int) -> int:
        """The node a device sits in."""
        return device // self.devices_per_node

    def same_node(self, d1: int, d2: int) -> bool:
        """Whether two devices share a node."""
        return d1 // self.devices_per_node == d2 // self.devices_per_node

    def link(self, d1: int, d2: int) -> Link:
        """The link class between two devices."""
        return self.intra_node if self.same_node(d1, d2) else self.inter_node

    def transfer_ms(self, d1: int, d2: int, nbytes: float) -> float:
        """Transfer time of `nbytes` from d1 to d2; zero on the same device."""
        if d1 == d2:
            return 0.0
        return self.link(d1, d2).transfer_ms(nbytes)


def _read_link(data: dict, key: str, src: str) -> Link:
    raw = field(data, key, src, "$", dict)
    path = f"$.{key}"
    return Link(
        bandwidth_gb_per_s=field(raw, "bandwidth_gb_per_s", src, path, float, positive=True,
                                 maximum=L.MAX_BANDWIDTH_GB_PER_S),
        latency_us=field(raw, "latency_us", src, path, float, minimum=0, maximum=L.MAX_LATENCY_US),
    )


def cluster_from_dict(data: dict, src: str = "<dict>") -> Cluster:
    """Build a Cluster from a parsed `octopipe-cluster/1` document, refusing bad input."""
    check_format(data, src, "octopipe-cluster")
    n = field(data, "num_devices", src, "$", int, minimum=1, maximum=L.MAX_DEVICES)
    per_node = field(data, "devices_per_node", src, "$", int, minimum=1, maximum=L.MAX_DEVICES, default=n)
    memory = field(data, "memory_bytes", src, "$", int, minimum=1 << 20, maximum=L.MAX_BYTES)
    intra = _read_link(data, "intra_node", src)
    return Cluster(
        num_devices=n,
        devices_per_node=per_node,
        memory_bytes=memory,
        intra_node=intra,
        inter_node=_read_link(data, "inter_node", src) if "inter_node" in data else intra,
        name=check_value(data.get("name", "cluster"), src, "$.name", str),
        gpu=_read_gpu(data, src),
        host_memory_bytes=field(data, "host_memory_bytes", src, "$", int, minimum=0, maximum=L.MAX_BYTES, default=None),
        host_link_gb_per_s=field(data, "host_link_gb_per_s", src, "$", float, positive=True,
                                 maximum=L.MAX_BANDWIDTH_GB_PER_S, default=None),
    )


def _read_gpu(data: dict, src: str) -> str | None:
    """The optional `gpu` field as a canonical GPU name of the cost model's table."""
    if "gpu" not in data:
        return None
    name = check_value(data["gpu"], src, "$.gpu", str)
    canonical = known_gpu(name)
    if canonical is None:
        raise FormatError(src, "$.gpu", f"a GPU of the cost model ({', '.join(GPUS)}; A100, H100 also accepted)",
                          name)
    return canonical


def cluster_to_dict(cluster: Cluster) -> dict:
    """Serialise a Cluster as an `octopipe-cluster/1` document."""

    def link(lk: Link) -> dict:
        return {"bandwidth_gb_per_s": lk.bandwidth_gb_per_s, "latency_us": lk.latency_us}

    return {
        "format": CLUSTER_FORMAT,
        "name": cluster.name,
        "num_devices": cluster.num_devices,
        "devices_per_node": cluster.devices_per_node,
        "memory_bytes": cluster.memory_bytes,
        "intra_node": link(cluster.intra_node),
        "inter_node": link(cluster.inter_node),
        **({"gpu": cluster.gpu} if cluster.gpu else {}),
        **({"host_memory_bytes": cluster.host_memory_bytes} if cluster.host_memory_bytes is not None else {}),
        **({"host_link_gb_per_s": cluster.host_link_gb_per_s} if cluster.host_link_gb_per_s is not None else {}),
    }


def read_cluster(source) -> Cluster:
    """Read an `octopipe-cluster/1` file or dict."""
    data, src = load_json(source)
    return cluster_from_dict(data, src)


def write_cluster(cluster: Cluster, path) -> None:
    """Write a Cluster as `octopipe-cluster/1` JSON."""
    write_json(cluster_to_dict(cluster), path)
