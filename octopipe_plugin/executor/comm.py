"""Point-to-point transport of one rank: receives posted early, non-blocking sends, bounded waits.

gloo: one process group, tagged messages, `Work.wait(timeout)` bounds each wait and
surfaces a dead peer ("connection closed") as soon as the socket closes.
NCCL (built for GPU, not run on this CPU-only machine): NCCL ignores tags and serialises the
p2p operations of one communicator on one stream, so a send to a peer that has not yet
posted its receive would block a receive queued behind it. Each direction of each rank
pair therefore gets its own communicator (`new_group`), operations are enqueued from a
side stream that first waits on an event recorded on the compute stream (the tensor is
ready), waits poll `is_completed()` against a deadline, and received buffers are
`record_stream`-ed onto the compute stream so the allocator cannot reuse them early.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules.messages import Message, plan_messages
from .errors import ExecutorError


@dataclass(frozen=True, kw_only=True, slots=True)
class Posted:
    """A posted operation: the buffer it reads or writes and its work handle."""

    msg: Message
    tensor: torch.Tensor
    work: object


class Transport:
    """Sends and receives of one rank for one plan; peers are ranks of `group`."""

    def __init__(self, *, rank: int, num_stages: int, recv_order: dict, meta_of, device: torch.device,
                 timeout_s: float, group=None, pair_groups: dict | None = None, tags: bool = True):
        self.rank = rank
        self.num_stages = num_stages
        self.recv_order = recv_order
        self.meta_of = meta_of  # stage -> TensorMeta of that stage's output
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.group = group
        self.pair_groups = pair_groups or {}
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.gloo = dist.get_backend(group) == "gloo"
        self.tags = tags and self.gloo
        self.posted_count: dict[int, int] = {}
        self.posted: dict[Message, Posted] = {}
        self.in_flight: list[Posted] = []

    def reset(self) -> None:
        """Forget the previous step's bookkeeping (all its operations have completed)."""
        self.posted_count.clear()
        self.posted.clear()
        self.in_flight.clear()

    def _route(self, src: int, dst: int, peer: int) -> tuple[object, int]:
        """(process group, peer's rank in it) for the direction src -> dst."""
        g = self.pair_groups.get((src, dst))
        if g is None:
            return self.group, peer
        return g, dist.get_group_rank(g, dist.get_global_rank(self.group, peer) if self.group else peer)

    def post_upto(self, upto) -> None:
        """Post, per peer, every receive up to the given count, in per-peer order."""
        for peer, count in upto:
            done = self.posted_count.get(peer, 0)
            for msg in self.recv_order[peer][done:count]:
                meta = self.meta_of(min(msg.src_stage, msg.dst_stage))
                group, grp_peer = self._route(peer, self.rank, peer)
                tag = msg.tag(self.num_stages) if self.tags else 0
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        buf = meta.empty(self.device)
                        work = dist.irecv(buf, group=group, group_src=grp_peer, tag=tag)
                else:
                    buf = meta.empty(self.device)
                    work = dist.irecv(buf, group=group, group_src=grp_peer, tag=tag)
                self.posted[msg] = Posted(msg=msg, tensor=buf, work=work)
            self.posted_count[peer] = max(done, count)

    def recv(self, msg: Message, action) -> torch.Tensor:
        """The received tensor of `msg`, waiting at most the timeout for it."""
        p = self.posted.pop(msg)
        self._wait(p, action, "receive")
        if self.cuda:
            p.tensor.record_stream(torch.cuda.current_stream(self.device))
        return p.tensor

    def send(self, msg: Message, tensor: torch.Tensor, action) -> None:
        """Start sending `tensor` as `msg` and return at once (the send is awaited in `finish`)."""
        meta = self.meta_of(min(msg.src_stage, msg.dst_stage))
        if not meta.matches(tensor):
            raise ExecutorError(
                f"rank {self.rank}: {action} produced {tuple(tensor.shape)} {tensor.dtype} for {msg}, "
                f"the boundary is declared {meta.shape} {meta.dtype}", rank=self.rank, action=str(action),
                awaited=str(msg))
        group, grp_peer = self._route(self.rank, msg.dst, msg.dst)
        tag = msg.tag(self.num_stages) if self.tags else 0
        data = tensor.detach().contiguous()
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                work = dist.isend(data, group=group, group_dst=grp_peer, tag=tag)
        else:
            work = dist.isend(data, group=group, group_dst=grp_peer, tag=tag)
        # holding `data` until completion keeps its buffer from being reused mid-transfer
        self.in_flight.append(Posted(msg=msg, tensor=data, work=work))

    def reap(self) -> None:
        """Drop sends that have completed (frees their buffers early)."""
        if self.in_flight:
            self.in_flight = [p for p in self.in_flight if not p.work.is_completed()]

    def finish(self, action="end of step") -> None:
        """Wait for every send of the step, each for at most the timeout."""
        while self.in_flight:
            self._wait(self.in_flight.pop(0), action, "send")

    def _wait(self, p: Posted, action, what: str) -> None:
        start = time.monotonic()
        try:
            if self.gloo:
                p.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            else:
                while not p.work.is_completed():
                    if time.monotonic() - start > self.timeout_s:
                        raise TimeoutError(f"no completion after {self.timeout_s:g} s")
                    time.sleep(0.0001)
                p.work.wait()
        except Exception as exc:  # gloo raises RuntimeError for both a timeout and a dead peer
            waited = time.monotonic() - start
            peer = f"from rank {p.msg.src}" if what == "receive" else f"to rank {p.msg.dst}"
            raise ExecutorError(
                f"rank {self.rank}: {action}: {what} of {p.msg} (tag {p.msg.tag(self.num_stages)}) {peer} "
                f"failed after {waited:.1f} s (timeout {self.timeout_s:g} s): {_first_line(exc)}",
                rank=self.rank, action=str(action), awaited=str(p.msg)) from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def direction_groups(plan, group=None) -> dict:
    """One communicator per direction of each communicating rank pair (NCCL); every rank must call this."""
    out = {}
    for src, dst in sorted(plan_messages(plan)):
        ranks = [dist.get_global_rank(group, r) if group else r for r in (src, dst)]
        out[(src, dst)] = dist.new_group(ranks=sorted(ranks))
    return out
