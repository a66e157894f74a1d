"""Start local worker processes over gloo (tests, dry runs, benchmarks)."""

from __future__ import annotations

import datetime
import os
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


# What a rank imports before its function runs (torch, the executor, the simulator the dry run prices with): the
# forkserver imports it once and each rank forks from it, instead of every rank paying ~4 CPU seconds afresh.
RANK_IMPORTS = ("octopipe_plugin.executor.dryrun",)


def use_forkserver(preload=RANK_IMPORTS) -> None:
    """Multiprocessing's forkserver running with exactly `preload` imported (restarted if it runs with others)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # one server a process; its preload is fixed when it starts
    want = list(preload)
    # private in CPython (3.8-3.13 alike); without them the server keeps what it started with, which is still right
    # for one preload a process (the CLI's)
    if getattr(server, "_preload_modules", want) != want:
        if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
            server._stop()  # running with other imports (another caller's): its ranks would inherit them
        forkserver.set_forkserver_preload(want)
    forkserver.ensure_running()


def spawn(fn, world: int, *args, start_method: str = "forkserver", preload=RANK_IMPORTS) -> None:
    """Run `fn(rank, world, port, *args)` in `world` processes; a failure raises OctoPipeError.
    By default they fork from a forkserver that imported `preload` once; `start_method="spawn"` starts each afresh."""
    if start_method == "forkserver":
        use_forkserver(preload)
    try:
        # a forked rank has the server's environment (from when it started): give it this process's, as spawn does
        mp.start_processes(_with_environ, args=(fn, dict(os.environ), world, free_port(), *args), nprocs=world,
                           start_method=start_method, join=True)
    except mp.ProcessRaisedException as exc:
        raise OctoPipeError(f"rank {exc.error_index} failed: {_exception_line(str(exc))}") from None
    except mp.ProcessExitedException as exc:
        raise OctoPipeError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None


def _with_environ(rank: int, fn, environ: dict, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)
