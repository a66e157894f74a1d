"""Measured links: point-to-point transfers between ranks, fitted to an `octopipe-cluster/1` Cluster.

Ranks are local processes (`measure_local`, spawned over gloo) or the ranks of a `torchrun`
launch (`measure_launched`, from the environment torchrun sets; NCCL where CUDA is there).
A node is the ranks of one host: `LOCAL_WORLD_SIZE` consecutive ranks under torchrun (its
numbering), checked against the hostnames. For each link class (pairs of consecutive ranks
inside a node, and pairs across a node boundary, a few of each: the pairs a pipeline uses),
one rank sends each size to the other and gets it back; half the fastest round trip is the
one-way time (the least disturbed: on a shared machine a slow trip measures the scheduler). Bandwidth and latency come from a least-squares fit of
`time = latency + bytes / bandwidth` with relative weights (every size counts alike, the
smallest pins the latency, the largest the bandwidth). A figure that is not a finite positive
number (a machine too busy to measure) is refused with one line, never written.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import OctoPipeError
from ..formats import Cluster, Link
from .device import device_memory_bytes, device_name, gpu_spec_for

# 4 KiB (latency-bound) to 32 MiB (bandwidth-bound, the size of one transformer activation)
DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 25)
MAX_PAIRS_PER_CLASS = 4  # a few pairs each: the class's figure is their median, a large launch stays quick
# bytes each host-link copy moves: on a GPU enough to reach the PCIe rate; on a CPU well past the caches, yet small
# beside the memory several local ranks share
HOST_COPY_BYTES_CUDA, HOST_COPY_BYTES_CPU = 256 << 20, 64 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSample:
    """One-way seconds per size over one pair of ranks."""

    src: int
    dst: int
    seconds: tuple[float, ...]


def fit_link(sizes, seconds, what: str) -> Link:
    """The Link of least-squares `t = latency + n / bandwidth` (relative weights); refuses a non-positive fit."""
    # minimise sum ((a + b n - t) / t)^2 over a (s), b (s per byte)
    w = [1.0 / (t * t) for t in seconds]
    sw = sum(w)
    sn = sum(wi * n for wi, n in zip(w, sizes))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    st = sum(wi * t for wi, t in zip(w, seconds))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes, seconds))
    det = sw * snn - sn * sn
    slope = (sw * snt - sn * st) / det if det else float("nan")
    latency_s = (st - slope * sn) / sw if det else float("nan")
    bandwidth = 1.0 / slope / 1e9 if slope else float("inf")
    for name, value, unit in (("bandwidth", bandwidth, "GB/s"), ("latency", latency_s * 1e6, "us")):
        if not (math.isfinite(value) and value > 0):
            raise OctoPipeError(f"{what}: measured {name} {value:.4g} {unit} is not a finite positive number "
                                f"(times {', '.join(f'{t * 1e6:.0f}us' for t in seconds)} for "
                                f"{', '.join(str(n) for n in sizes)} bytes); the machine was too busy: rerun with "
                                f"more --repeats on a quieter machine")
    return Link(bandwidth_gb_per_s=bandwidth, latency_us=latency_s * 1e6)


def node_groups(hostnames: list[str], local_world: int | None) -> int:
    """Ranks per node: `local_world` (torchrun's consecutive numbering) checked against the hosts, else per host."""
    world = len(hostnames)
    per_node = local_world or sum(h == hostnames[0] for h in hostnames)
    if per_node < 1 or world % per_node:
        raise OctoPipeError(f"{world} ranks do not split into nodes of {per_node} (LOCAL_WORLD_SIZE or ranks per "
                            f"host); launch the same number of ranks on every node")
    for node in range(world // per_node):
        hosts = set(hostnames[node * per_node:(node + 1) * per_node])
        if len(hosts) > 1:
            raise OctoPipeError(f"ranks {node * per_node}..{(node + 1) * per_node - 1} form node {node} but run on "
                                f"hosts {', '.join(sorted(hosts))}: number ranks node by node (torchrun does)")
    return per_node


def link_pairs(world: int, per_node: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(intra-node pairs, inter-node pairs): consecutive ranks, a few of each class."""
    intra = [(r, r + 1) for r in range(world - 1) if r // per_node == (r + 1) // per_node]
    inter = [(r, r + 1) for r in range(world - 1) if r // per_node != (r + 1) // per_node]
    return intra[:MAX_PAIRS_PER_CLASS], inter[:MAX_PAIRS_PER_CLASS]


def _ping_pong(rank: int, pair: tuple[int, int], sizes, repeats: int, device: torch.device) -> tuple[float, ...]:
    """One-way seconds per size between the two ranks of `pair` (half the fastest round trip; others return).

    Sizes take turns within each repeat, so a disturbance (another process taking the core) spreads over
    sizes instead of spoiling every trip of one; two untimed trips first open the pair and warm the buffers."""
    a, b = pair
    if rank not in pair:
        return ()
    other = b if rank == a else a
    bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    best = [math.inf] * len(sizes)
    for k in range(repeats + 2):
        for i, buf in enumerate(bufs):
            _sync(device)
            t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, other)
                dist.recv(buf, other)
            else:
                dist.recv(buf, other)
                dist.send(buf, other)
            _sync(device)
            if k >= 2:
                best[i] = min(best[i], time.perf_counter() - t0)
    return tuple(t / 2 for t in best)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ranks(rank: int, world: int, per_node: int, sizes, repeats: int,
                  device: torch.device) -> list[LinkSample]:
    """Every rank calls this; the pairs take turns (a barrier between), so each measures its link alone."""
    intra, inter = link_pairs(world, per_node)
    samples = []
    for pair in intra + inter:
        secs = _ping_pong(rank, pair, sizes, repeats, device)
        if rank == pair[0]:
            samples.append(LinkSample(src=pair[0], dst=pair[1], seconds=secs))
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, samples)
    return [s for part in gathered for s in part]


def measure_host_link(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Device<->host copy bandwidth in GB/s (the slower direction's median), what an offloaded activation's copies
    cost (docs/formats.md, "Memory choices"), copied as the executor's offload copies: on CUDA into pinned host
    memory with non-blocking copies timed by events (256 MiB), on a CPU plain copies between host buffers (64 MiB)."""
    cuda = device.type == "cuda"
    nbytes = nbytes or (HOST_COPY_BYTES_CUDA if cuda else HOST_COPY_BYTES_CPU)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
    rates = {"out": [], "in": []}
    for _ in range(repeats + 1):
        for way, (dst, src) in (("out", (host, dev)), ("in", (dev, host))):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                seconds = time.perf_counter() - t0
            rates[way].append(nbytes / max(seconds, 1e-9) / 1e9)
    return min(statistics.median(r[1:]) for r in rates.values())  # the first round warms up


def build_cluster(samples: list[LinkSample], world: int, per_node: int, sizes, memory_bytes: int,
                  gpu: str | None, name: str, host_link_gb_per_s: float | None = None) -> Cluster:
    """The Cluster of the measured samples: per class, the median time per size over its pairs, fitted."""

    def fitted(cls: str, pairs) -> Link | None:
        chosen = [s for s in samples if (s.src, s.dst) in set(pairs)]
        if not chosen:
            return None
        med = [statistics.median(s.seconds[i] for s in chosen) for i in range(len(sizes))]
        return fit_link(sizes, med, f"{cls} link ({', '.join(f'{a}-{b}' for a, b in pairs)})")

    intra_pairs, inter_pairs = link_pairs(world, per_node)
    intra = fitted("intra-node", intra_pairs)
    inter = fitted("inter-node", inter_pairs)
    if intra is None and inter is None:
        raise OctoPipeError(f"{world} rank(s): no pair of ranks to measure a link between; use at least 2 ranks")
    if not (isinstance(memory_bytes, int) and memory_bytes >= 1 << 20):
        raise OctoPipeError(f"device memory {memory_bytes} bytes: expected at least 1 MiB")
    return Cluster(num_devices=world, devices_per_node=per_node, memory_bytes=memory_bytes,
                   intra_node=intra or inter, inter_node=inter or intra, name=name, gpu=gpu,
                   host_link_gb_per_s=host_link_gb_per_s)


def _device_figures(device: torch.device, ranks_on_host: int) -> tuple[int, str | None]:
    """(memory each rank may plan with, GPU table name or None): host ranks share the host's memory."""
    memory = device_memory_bytes(device)
    if device.type != "cuda":
        memory //= max(1, ranks_on_host)
    spec = gpu_spec_for(device_name(device)) if device.type == "cuda" else None
    return memory, spec.name if spec else None


def _local_worker(rank: int, world: int, port: int, per_node: int, sizes, repeats: int, timeout_s: float,
                  out: str) -> None:
    from ..executor.launch import init_gloo

    init_gloo(rank, world, port, timeout_s)
    samples = measure_ranks(rank, world, per_node, sizes, repeats, torch.device("cpu"))
    host = [None] * world  # every rank at once, as offloads copy during training; the slowest counts
    dist.all_gather_object(host, measure_host_link(torch.device("cpu")))
    if rank == 0:
        with open(os.path.join(out, "samples.json"), "w", encoding="utf-8") as fh:
            json.dump({"samples": [[s.src, s.dst, list(s.seconds)] for s in samples], "host_link": min(host)}, fh)
    dist.barrier()
    dist.destroy_process_group()


def measure_local(ranks: int, *, per_node: int | None = None, sizes=DEFAULT_SIZES, repeats: int = 5,
                  timeout_s: float = 120.0, name: str | None = None) -> Cluster:
    """Measure `ranks` local processes over gloo (`per_node` of them counted as one node; default all)."""
    from ..executor.launch import spawn

    per_node = per_node or ranks
    if ranks < 2 or ranks % per_node:
        raise OctoPipeError(f"--ranks {ranks} --ranks-per-node {per_node}: expected at least 2 ranks, a whole "
                            f"number of nodes")
    with tempfile.TemporaryDirectory(prefix="octopipe-links-") as out:
        spawn(_local_worker, ranks, per_node, tuple(sizes), repeats, timeout_s, out)
        with open(os.path.join(out, "samples.json"), encoding="utf-8") as fh:
            got = json.load(fh)
        samples = [LinkSample(src=a, dst=b, seconds=tuple(t)) for a, b, t in got["samples"]]
    memory, gpu = _device_figures(torch.device("cpu"), ranks)
    return build_cluster(samples, ranks, per_node, tuple(sizes), memory, gpu,
                         name or f"{socket.gethostname()}-gloo-x{ranks}", got["host_link"])


def launched() -> bool:
    """Whether this process is a rank of a torchrun-style launch (RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def measure_launched(*, sizes=DEFAULT_SIZES, repeats: int = 5, timeout_s: float = 120.0,
                     name: str | None = None) -> Cluster | None:
    """Measure the ranks of this torchrun launch (NCCL on CUDA, else gloo); the Cluster on rank 0, None elsewhere."""
    import datetime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        per_node = node_groups(hosts, local_world)
        samples = measure_ranks(rank, world, per_node, tuple(sizes), repeats, device)
        host = measure_host_link(device)  # every rank at once, as offloads copy during training; the slowest counts
        hosts_link = [None] * world
        dist.all_gather_object(hosts_link, host)
        if rank:
            return None
        memory, gpu = _device_figures(device, sum(h == hosts[0] for h in hosts))
        backend = "nccl" if cuda else "gloo"
        return build_cluster(samples, world, per_node, tuple(sizes), memory, gpu,
                             name or f"{hosts[0]}-{backend}-x{world}", min(hosts_link))
    finally:
        dist.destroy_process_group()
