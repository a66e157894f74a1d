"""Start local worker processes over gloo (tests, dry runs, benchmarks)."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import OctoPipeError


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Join a local gloo process group of `world` ranks."""
    # many ranks share few cores: intra-op threads would only contend
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def spawn(fn, world: int, *args) -> None:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; a failure raises OctoPipeError."""
    try:
        mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=True)
    except mp.ProcessRaisedException as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise OctoPipeError(f"rank {exc.error_index} failed: {lines[-1] if lines else exc}") from None
    except mp.ProcessExitedException as exc:
        raise OctoPipeError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None
