"""Host-side bound on device-side waits (NCCL): a thread that fails a late transfer or one whose peer died.

On CUDA the compute stream waits on a transfer's event and the host runs ahead, so no host
call is there to time out. The watchdog thread polls the watched transfers (off the
critical path), and fails the first one that is past its deadline, or whose peer stopped
beating: every rank's watchdog writes a heartbeat counter into the process group's store,
so a dead peer is reported as dead after `dead_after_s`, before NCCL's own timeout. On a
failure it records (transfer, action, what, reason) for the transport to raise as the named
error, and aborts the communicators so a host blocked on the stuck stream returns.
Torch's private store and abort helpers are used here only.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

_KEY = "octopipe/heartbeat/{}"


class Heartbeat:
    """This rank's beat in the store, and the last change seen of each peer's."""

    def __init__(self, rank: int):
        self.rank = rank
        self.count = 0
        self.seen: dict[int, tuple[bytes, float]] = {}
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # no default group (a test transport): no heartbeat, deadlines only
            self.store = None

    def beat(self) -> None:
        """Advance this rank's counter."""
        if self.store is not None:
            self.count += 1
            self.store.set(_KEY.format(self.rank), str(self.count))

    def silent_for(self, peer: int) -> float:
        """Seconds since `peer`'s counter last changed (0 while it has not started beating)."""
        if self.store is None:
            return 0.0
        key = _KEY.format(peer)
        if not self.store.check([key]):
            return 0.0
        value, now = self.store.get(key), time.monotonic()
        last = self.seen.get(peer)
        if last is None or last[0] != value:
            self.seen[peer] = (value, now)
            return 0.0
        return now - last[1]


class Watchdog:
    """Bounds the transfers it watches by `timeout_s`; `failure` is set by the first one that fails."""

    def __init__(self, *, rank: int, timeout_s: float, groups=(), to_global=None, poll_s: float = 0.005,
                 beat_s: float = 0.5, dead_after_s: float | None = None):
        self.rank = rank
        self.timeout_s = timeout_s
        self.groups = tuple(groups)
        self.to_global = to_global or (lambda peer: peer)
        self.poll_s = poll_s
        self.beat_s = beat_s
        # a dead peer must be named before the executor's own bound (and NCCL's) ends the wait
        self.dead_after_s = dead_after_s if dead_after_s is not None else max(4 * beat_s, min(10.0, timeout_s / 2))
        self.failure: tuple | None = None
        self._watched: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, transfer, action, what: str, peer: int) -> None:
        """Bound `transfer` (a lane Transfer) from now on; `peer` is its other end (rank in the executor's group)."""
        with self._lock:
            self._watched.append((time.monotonic(), transfer, action, what, peer))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"octopipe-watchdog-{self.rank}", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread (at the transport's end)."""
        self._stop.set()

    def _run(self) -> None:
        beat = Heartbeat(self.to_global(self.rank))
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_beat:
                    beat.beat()
                    next_beat = now + self.beat_s
                self._check(now, beat)
            except Exception as exc:  # the store is gone: its host (rank 0 of the world) died or finished
                with self._lock:
                    waiting = bool(self._watched)
                if not waiting:
                    return  # nothing in flight (a run that ended): stop quietly, abort nothing
                self._fail(None, f"the process group's store is unreachable ({exc}): its rank died")
            if self.failure is not None:
                return
            self._stop.wait(self.poll_s)

    def _check(self, now: float, beat: Heartbeat) -> None:
        with self._lock:
            watched = [w for w in self._watched if not w[1].completed()]
            self._watched = watched
        for start, t, action, what, peer in watched:
            if now - start > self.timeout_s:
                self._fail((t, action, what, now - start), f"no completion after {self.timeout_s:g} s")
                return
            silent = beat.silent_for(self.to_global(peer))
            if silent > self.dead_after_s:
                self._fail((t, action, what, now - start),
                           f"peer rank {peer} is dead (no heartbeat for {silent:.1f} s)")
                return

    def _fail(self, entry, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = (entry, reason)
        for g in self.groups:
            try:  # unblocks a host waiting on the stuck stream (the step is lost anyway)
                dist.distributed_c10d._abort_process_group(g)
            except Exception:
                pass
