"""Operations of a layer with their forward / input-grad / weight-grad FLOPs and bytes, timed on a roofline.

Each op's time is max(FLOPs / achieved FLOP/s, bytes / achieved HBM bytes/s) (the roofline model,
Williams, Waterman and Patterson, CACM 2009), plus link time for tensor-parallel collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gpus import GpuSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One kernel of a layer: FLOPs and HBM bytes of its forward (F), input-grad (I) and weight-grad (W) parts."""

    name: str
    f_flops: float = 0.0
    f_bytes: float = 0.0
    i_flops: float = 0.0
    i_bytes: float = 0.0
    w_flops: float = 0.0
    w_bytes: float = 0.0
    comm_bytes: float = 0.0  # bytes each rank moves over NVLink in F, and again in I
    comm_ib_bytes: float = 0.0  # bytes each rank moves over the inter-node link at the same time (an all-to-all)
    # a communication phase of its own (an expert-parallel all-to-all, which another action's compute may hide
    # inside an overlapped pair); False: the op blocks the device's compute as today (tensor-parallel collectives)
    on_link: bool = False
    phase: str = ""  # the sub-layer part it belongs to ("attention", "router", "experts"...), names its phase


def matmul(name: str, m: int, k: int, n: int, dt: int, weights: int = 1) -> Op:
    """X[m,k] @ W[k,n]: 2mkn FLOPs each for Y, dX = dY W^T (I) and dW = X^T dY (W).

    `weights` > 1 is a grouped GEMM: the m rows spread over that many [k,n] matrices, each read once.
    """
    flops = 2.0 * m * k * n
    nbytes = float(m * k + weights * k * n + m * n) * dt
    return Op(name=name, f_flops=flops, f_bytes=nbytes, i_flops=flops, i_bytes=nbytes, w_flops=flops, w_bytes=nbytes)


def core(name: str, flops: float, nbytes: float, bwd_factor: float = 2.0) -> Op:
    """A product of two activations (attention, SSD scan): no weights, so its whole backward is I."""
    return Op(name=name, f_flops=flops, f_bytes=nbytes, i_flops=bwd_factor * flops, i_bytes=2.0 * nbytes)


def elementwise(name: str, nbytes: float, i_bytes: float | None = None, w_bytes: float = 0.0) -> Op:
    """A memory-bound kernel; its backward reads the output grad and a saved input and writes a grad (2x)."""
    return Op(name=name, f_bytes=nbytes, i_bytes=2.0 * nbytes if i_bytes is None else i_bytes, w_bytes=w_bytes)


def collective(name: str, nbytes: float) -> Op:
    """A tensor-parallel collective: `nbytes` moved per rank in the forward and the same in the backward."""
    return Op(name=name, comm_bytes=nbytes)


def alltoall(name: str, nbytes: float, ep: int, ep_nodes: int) -> Op:
    """An expert-parallel all-to-all moving `nbytes` per rank (every peer's share, its own included) over an EP
    group of `ep` ranks spread evenly over `ep_nodes` nodes: each rank sends nbytes/ep to every other rank, NVLink
    to the peers of its node and the inter-node link to the rest, both at once; the same again in the backward."""
    per_node = ep // ep_nodes
    return Op(name=name, comm_bytes=nbytes * (per_node - 1) / ep, comm_ib_bytes=nbytes * (ep - per_node) / ep,
              on_link=True, phase=name)


def op_times(op: Op, gpu: GpuSpec) -> tuple[float, float, float]:
    """(F, I, W) milliseconds of one op on `gpu`."""

    def roof(flops: float, nbytes: float) -> float:
        return max(flops / gpu.flops, nbytes / gpu.hbm_bytes_per_s) * 1e3

    comm = max(op.comm_bytes / (gpu.nvlink_gb_per_s * 1e9), op.comm_ib_bytes / (gpu.ib_gb_per_s * 1e9)) * 1e3
    return roof(op.f_flops, op.f_bytes) + comm, roof(op.i_flops, op.i_bytes) + comm, roof(op.w_flops, op.w_bytes)


def total_times(ops: list[Op], gpu: GpuSpec) -> tuple[float, float, float]:
    """Summed (F, I, W) milliseconds of a list of ops run one after another."""
    f = i = w = 0.0
    for op in ops:
        df, di, dw = op_times(op, gpu)
        f, i, w = f + df, i + di, w + dw
    return f, i, w


def total_flops(ops: list[Op]) -> tuple[float, float, float]:
    """Summed (F, I, W) FLOPs of a list of ops."""
    return (sum(o.f_flops for o in ops), sum(o.i_flops for o in ops), sum(o.w_flops for o in ops))
