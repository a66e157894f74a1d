"""Start local worker processes over gloo (tests, dry runs, benchmarks)."""

from __future__ import annotations

import datetime
import re
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import OctoPipeError

_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b")


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


def _exception_line(text: str) -> str:
    """The last 'SomeError: message' line of a child's traceback (the line that says what went wrong)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    found = [i for i, ln in enumerate(lines) if _EXC_LINE.match(ln)]
    if not found:
        return lines[-1] if lines else "unknown error"
    # a message may continue on the next lines (until the traceback's end)
    return " ".join(lines[found[-1]:found[-1] + 4])


def spawn(fn, world: int, *args, start_method: str = "spawn") -> None:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; a failure raises OctoPipeError.
    `start_method="forkserver"`: the processes fork from multiprocessing's forkserver (its preloaded imports)."""
    try:
        mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method=start_method, join=True)
    except mp.ProcessRaisedException as exc:
        raise OctoPipeError(f"rank {exc.error_index} failed: {_exception_line(str(exc))}") from None
    except mp.ProcessExitedException as exc:
        raise OctoPipeError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None
