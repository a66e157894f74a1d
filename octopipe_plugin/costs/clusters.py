"""Clusters by name ('<gpu>x<count>', 8 GPUs per node) or from an `octopipe-cluster/1` file."""

from __future__ import annotations

import re

from ..errors import OctoPipeError
from ..formats.fields import is_document_path
from ..formats.cluster import Cluster, Link, read_cluster
from ..limits import MAX_DEVICES
from ..gpus import get_gpu

DEVICES_PER_NODE = 8
# Small-message p2p latency: NCCL over NVLink within a node, over InfiniBand (GPUDirect RDMA) across nodes.
NVLINK_LATENCY_US = 10.0
IB_LATENCY_US = 20.0
_NAME = re.compile(r"^(?P<gpu>[a-z0-9-]+?)x(?P<count>\d+)$", re.IGNORECASE)


def named_cluster(gpu: str, count: int, devices_per_node: int = DEVICES_PER_NODE) -> Cluster:
    """`count` GPUs of one kind, `devices_per_node` to a node: NVLink inside a node, one IB NIC per GPU across."""
    try:
        spec = get_gpu(gpu)
    except OctoPipeError as exc:
        raise OctoPipeError(f"cluster {gpu.lower()}x{count}: {exc}") from None
    if not 1 <= count <= MAX_DEVICES:
        raise OctoPipeError(f"cluster {gpu.lower()}x{count}: expected 1..{MAX_DEVICES} devices, got {count}")
    return Cluster(
        name=f"{gpu.lower()}x{count}",  # as the user wrote it: h100x8, not h100-sxmx8
        num_devices=count,
        devices_per_node=min(devices_per_node, count),
        memory_bytes=spec.memory_bytes,
        intra_node=Link(bandwidth_gb_per_s=spec.nvlink_gb_per_s, latency_us=NVLINK_LATENCY_US),
        inter_node=Link(bandwidth_gb_per_s=spec.ib_gb_per_s, latency_us=IB_LATENCY_US),
        gpu=spec.name,
    )


def resolve_cluster(name_or_path: str) -> Cluster:
    """'h100x16' style names (8 per node) or an `octopipe-cluster/1` JSON/YAML file."""
    name = str(name_or_path).strip()
    if is_document_path(name):
        return read_cluster(name)
    match = _NAME.match(name)
    if not match:
        raise OctoPipeError(
            f"unknown cluster {name!r}: expected '<gpu>x<count>' (e.g. h100x8, a100x16, b200x8) or a cluster file")
    count = match["count"]
    if len(count) > 6:  # int() of a thousand digits is slow and the number is refused anyway
        raise OctoPipeError(f"cluster {name}: expected 1..{MAX_DEVICES} devices, got {count}")
    return named_cluster(match["gpu"], int(count))


def cost_gpu(cluster: Cluster | None, gpu: str | None = None) -> str:
    """The GPU a model is costed for on `cluster`: `gpu` when given, else the cluster's own, else H100."""
    if gpu:
        return get_gpu(gpu).name
    if cluster is not None and cluster.gpu:
        return cluster.gpu
    return get_gpu("H100").name
