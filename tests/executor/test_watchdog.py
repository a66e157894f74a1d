"""The watchdog that bounds device-side (NCCL) waits, driven on CPU: a late transfer and a dead peer are named.

The CUDA lane cannot run here; its host-side bound can: transfers that never complete are
watched, and the watchdog must report the deadline, or, sooner, a peer whose heartbeat in
the process group's store stopped (the peer process exits abruptly), well within the bound.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.multiprocessing as mp

from octopipe_plugin.executor.launch import free_port, init_gloo
from octopipe_plugin.executor.watchdog import Watchdog


class _Never:
    """A transfer whose operations never complete (a peer that never posts its end)."""

    msg = "act[0F0->1F0] dev0->dev1"

    def completed(self) -> bool:
        return False


class _Done(_Never):
    def completed(self) -> bool:
        return True


def test_a_transfer_past_its_deadline_fails_with_the_bound_and_a_completed_one_never_does():
    dog = Watchdog(rank=0, timeout_s=0.3, poll_s=0.01)
    dog.watch(_Done(), "0F1", "receive", 1)
    dog.watch(_Never(), "0B0", "receive", 1)
    deadline = time.monotonic() + 20
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.stop()
    assert dog.failure is not None
    (transfer, action, what, waited), reason = dog.failure
    assert isinstance(transfer, _Never) and (action, what) == ("0B0", "receive")
    assert waited >= 0.3 and reason == "no completion after 0.3 s"


def _worker(rank: int, port: int, out: str) -> None:
    init_gloo(rank, 2, port, timeout_s=300)
    dog = Watchdog(rank=rank, timeout_s=60.0, poll_s=0.01, beat_s=0.1, dead_after_s=1.5)
    if rank == 1:
        dog.watch(_Done(), "1F0", "receive", 0)  # starts its thread: it beats
        time.sleep(1.0)
        os._exit(3)  # dies like a crash: no goodbye, the store key stays
    start = time.monotonic()
    dog.watch(_Never(), "0B0", "receive", 1)
    while dog.failure is None and time.monotonic() - start < 60:
        time.sleep(0.05)
    entry, reason = dog.failure if dog.failure else (None, "no failure")
    with open(os.path.join(out, "rank0.json"), "w") as fh:
        json.dump({"reason": reason, "action": entry[1] if entry else None, "elapsed": time.monotonic() - start}, fh)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_dead_peer_is_named_from_its_heartbeat_before_the_bound(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.is_alive():
            p.kill()
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["reason"].startswith("peer rank 1 is dead (no heartbeat for"), got
    assert got["action"] == "0B0" and got["elapsed"] < 60, got
