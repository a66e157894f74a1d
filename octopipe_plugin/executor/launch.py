"""Start local worker processes over gloo (tests, dry runs, benchmarks)."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Join a local gloo process group of `world` ranks."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def spawn(fn, world: int, *args) -> None:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; raises if any fails."""
    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=True)
