"""Lanes: how one backend moves the tensors of a message (comm.py keeps order and handshakes above them).

One interface, three lanes, chosen once per transport by `make_lane` (the backend mode lives
here and nowhere else):

- `PlainLane` (gloo on CPU, or any backend moving tensors where they are): `irecv` into a
  buffer on the executor's device, `isend` the tensor, `Work.wait(timeout)` bounds each wait
  (gloo surfaces a dead peer, "connection closed", as soon as its socket closes).
- `StagedLane` (gloo with CUDA tensors: several ranks on one GPU, where NCCL refuses): every
  tensor goes through host memory; the receive lands in a host buffer, copied to the device
  when consumed.
- `CudaLane` (NCCL): operations are issued from a side stream; a send's side stream first
  waits on an event recorded on the compute stream (the tensor is ready); a consumer never
  blocks the host: `Work.wait()` of an NCCL work makes the *current* (compute) stream wait on
  the transfer's completion event, and received buffers are `record_stream`-ed onto that
  stream so the allocator cannot reuse them early. The host-side `Watchdog` bounds every such
  wait (and sees a dead peer by its heartbeat) instead of a polling loop.

Each lane issues a message's requests one by one (`issue`) or, for the batched exchange, as
one `batch_isend_irecv` (`issue_batch`, comm.py decides what goes in one batch), and a split
head's statistics as one all-gather (`issue_gather`: NCCL's all_gather; on gloo one all_to_all,
whose parts travel at once where gloo's ring all_gather waits n - 1 rounds).
"""

from __future__ import annotations

import datetime
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .watchdog import Watchdog


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)  # compared by identity: it holds a tensor
class Request:
    """One tensor to move: `isend` (send=True) or `irecv` of `wire` with `peer` (its rank in `group`) under `tag`."""

    send: bool
    wire: torch.Tensor
    group: object
    peer: int
    tag: int


class Transfer:
    """One message on a lane: what the step sees (`tensors`), what the backend moves (`requests`), and the work
    handles, set when the requests are issued (None while a batched exchange still holds them)."""

    __slots__ = ("msg", "tensors", "requests", "works")

    def __init__(self, msg, tensors: tuple, requests: tuple[Request, ...]):
        self.msg = msg
        self.tensors = tensors
        self.requests = requests
        self.works: tuple | None = None

    def completed(self) -> bool:
        """Whether every operation of the message has finished (False while not issued)."""
        return self.works is not None and all(w.is_completed() for w in self.works)


def _op(r: Request):
    return dist.isend if r.send else dist.irecv


def _peer_kw(r: Request) -> dict:
    return {"group_dst": r.peer} if r.send else {"group_src": r.peer}


class PlainLane:
    """Tensors moved where they are; waits bounded by `Work.wait(timeout)` (gloo on CPU)."""

    name = "plain"
    coalesces = False  # batch_isend_irecv gives one work per request (gloo does not coalesce)

    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device
        self.timeout_s = timeout_s

    @property
    def wire_device(self) -> torch.device:
        """Where receive buffers live."""
        return self.device

    def issuing(self):
        """Context in which buffers are made and operations issued."""
        return nullcontext()

    def send_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the backend reads for a send of `t` (on the executor's device)."""
        return t.detach().contiguous()

    def issue(self, requests) -> tuple:
        """Issue requests one by one; one work per request."""
        with self.issuing():
            self._before_sends(requests)
            return tuple(_op(r)(r.wire, group=r.group, tag=r.tag, **_peer_kw(r)) for r in requests)

    def issue_batch(self, requests) -> tuple:
        """Issue requests (all of one group) as one `batch_isend_irecv`."""
        with self.issuing():
            self._before_sends(requests)
            ops = [dist.P2POp(_op(r), r.wire, group=r.group, tag=r.tag, group_peer=r.peer) for r in requests]
            return tuple(dist.batch_isend_irecv(ops))

    def issue_gather(self, wire: torch.Tensor, group, size: int) -> tuple:
        """Start an all-gather of `wire` over `group` (`size` members): (its work, a buffer per member in group rank
        order, made like receive buffers). On gloo one all_to_all of `wire` to every member: its all_gather is a
        ring whose n - 1 rounds each wait for the next rank to be scheduled (15 ranks on 2 cores: 22 ms against
        5.5 ms for the all_to_all, the same bytes), where the all_to_all posts every part at once."""
        with self.issuing():
            self._after_compute()
            out = torch.empty((size * wire.numel(),), dtype=wire.dtype, device=wire.device)
            work = dist.all_to_all_single(out, wire.reshape(-1).repeat(size), group=group, async_op=True)
            return work, list(out.view(size, *wire.shape).unbind(0))

    def wait_gather(self, work) -> None:
        """Wait for an all-gather's work, at most the timeout."""
        work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))

    def _before_sends(self, requests) -> None:
        if any(r.send for r in requests):
            self._after_compute()

    def _after_compute(self) -> None:
        pass

    def begin(self) -> None:
        """Start a step (nothing to order on the host)."""

    def wait(self, t: Transfer, watch) -> None:
        """Wait for every operation of `t`, each for at most the timeout (raises what the backend raises)."""
        for work in t.works:
            # each tensor of a message gets the whole bound (the first one is what waits on the peer)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))

    def received(self, t: Transfer) -> list[torch.Tensor]:
        """The received tensors on the executor's device (after `wait`)."""
        return list(t.tensors)

    def wait_host(self, t: Transfer, watch) -> None:
        """Wait until the host can read `t`'s buffers (a handshake's meta)."""
        self.wait(t, watch)

    def pollable(self) -> bool:
        """Whether `Work.is_completed()` tells a receive's arrival before it is waited on (gloo's stays False)."""
        return False

    def failure(self):
        """The watchdog's failure, if any: (transfer, action, what, reason)."""
        return None

    def close(self) -> None:
        """Stop what the lane runs in the background."""


class StagedLane(PlainLane):
    """gloo with device tensors: every tensor travels through host memory."""

    name = "staged"

    @property
    def wire_device(self) -> torch.device:
        """Receives land in host buffers."""
        return torch.device("cpu")

    def send_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy (waits for the producing kernels: gloo reads host memory at once)."""
        return t.detach().contiguous().cpu()

    def received(self, t: Transfer) -> list[torch.Tensor]:
        """The host buffers copied to the device."""
        return [h.to(self.device) for h in t.tensors]


class CudaLane(PlainLane):
    """NCCL: side-stream operations ordered by events, device-side waits, host-side watchdog."""

    name = "cuda"

    def __init__(self, device: torch.device, timeout_s: float, watchdog: Watchdog):
        super().__init__(device, timeout_s)
        self.stream = torch.cuda.Stream(device)
        self.watchdog = watchdog
        group = getattr(dist.group, "WORLD", None)
        self.coalesces = bool(group is not None and group._get_backend(device).supports_coalescing)

    def begin(self) -> None:
        """Kept buffers are rewritten by this step's receives: not before the last step's compute is done."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def issuing(self):
        """Buffers are made, and operations issued, on the side stream."""
        return torch.cuda.stream(self.stream)

    def _after_compute(self) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)  # the side stream reads the tensor only once the compute stream made it

    def issue_gather(self, wire: torch.Tensor, group, size: int) -> tuple:
        """Start NCCL's all-gather of `wire` over `group` on the side stream: (its work, a buffer per member)."""
        with self.issuing():
            self._after_compute()
            outs = [torch.empty_like(wire) for _ in range(size)]
            return dist.all_gather(outs, wire, group=group, async_op=True), outs

    def wait_gather(self, work) -> None:
        """The compute stream waits on the all-gather (no host block; NCCL's own timeout bounds it)."""
        work.wait()

    def send_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor itself (kept alive by the transport until its send completed)."""
        return t.detach().contiguous()

    def wait(self, t: Transfer, watch) -> None:
        """The compute stream waits on the transfer (no host block); the watchdog bounds it on the host."""
        self.watchdog.watch(t, *watch)
        for work in t.works:
            work.wait()  # NCCL: the current stream waits on the work's end event

    def received(self, t: Transfer) -> list[torch.Tensor]:
        """The device buffers, marked as used by the compute stream."""
        compute = torch.cuda.current_stream(self.device)
        for buf in t.tensors:
            buf.record_stream(compute)
        return list(t.tensors)

    def wait_host(self, t: Transfer, watch) -> None:
        """A handshake's meta is read by the host: wait on the stream, then on the host (bounded by the watchdog)."""
        self.wait(t, watch)
        torch.cuda.current_stream(self.device).synchronize()

    def pollable(self) -> bool:
        """NCCL works report completion without being waited on."""
        return True

    def failure(self):
        """The watchdog's failure, if any."""
        return self.watchdog.failure

    def close(self) -> None:
        """Stop the watchdog thread."""
        self.watchdog.stop()


def make_lane(*, backend: str, device: torch.device, timeout_s: float, rank: int, groups=(),
              to_global=None) -> PlainLane:
    """The lane for a backend and a device: the one place that decides the backend mode.

    `groups` are aborted by the CUDA lane's watchdog on a failure; `to_global` maps a peer's rank in the
    executor's group to its global rank (the heartbeat's key)."""
    if device.type == "cuda" and backend == "gloo":
        return StagedLane(device, timeout_s)  # gloo moves host memory: stage device tensors through it
    if device.type == "cuda":
        return CudaLane(device, timeout_s, Watchdog(rank=rank, timeout_s=timeout_s, groups=groups,
                                                    to_global=to_global))
    return PlainLane(device, timeout_s)
