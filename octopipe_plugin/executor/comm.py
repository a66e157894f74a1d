"""Point-to-point transport of one rank: receives posted early, non-blocking sends, bounded waits.

A message carries one boundary value (one or several tensors, see boundary.py): one
point-to-point operation per tensor, all with the message's tag, in leaf order. Where the
runner declares no meta for a boundary, the first activation of that boundary in the step
is preceded by a handshake message holding the meta; posting from that peer pauses at that
message until the handshake has arrived, so per-peer order is kept.

gloo: one process group, tagged messages, `Work.wait(timeout)` bounds each wait and
surfaces a dead peer ("connection closed") as soon as the socket closes. gloo with CUDA
tensors (several ranks on one GPU, where NCCL refuses) stages every tensor through host
memory.
NCCL: NCCL ignores tags and serialises the p2p operations of one communicator on one
stream, so a send to a peer that has not yet posted its receive would block a receive
queued behind it. Each direction of each rank pair therefore gets its own communicator
(comm_cache.py), operations are enqueued from a side stream that first waits on an event
recorded on the compute stream (the tensor is ready), waits poll `is_completed()` against a
deadline, and received buffers are `record_stream`-ed onto the compute stream so the
allocator cannot reuse them early.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules.messages import Message, MsgKind
from .boundary import (
    decode_meta, encode_meta, flatten, grad_leaves, leaf_metas, meta_of, mismatch, pack_grads, same_meta, unflatten,
    unpack_grads, META_BYTES,
)
from .comm_cache import reusable
from .errors import ExecutorError
from .interface import TensorMeta

_HANDSHAKE = TensorMeta(shape=(META_BYTES,), dtype=torch.uint8, requires_grad=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class Posted:
    """A posted message: its buffers (device tensors, and host copies when staged) and their work handles."""

    msg: Message
    tensors: tuple[torch.Tensor, ...]
    works: tuple
    host: tuple[torch.Tensor, ...] = ()


def boundary_of(msg: Message) -> int:
    """The stage whose output boundary a message crosses (its activation or that activation's gradient)."""
    return min(msg.src_stage, msg.dst_stage)


def handshake_messages(orders: dict) -> set[Message]:
    """Per peer order -> the first activation message of each boundary (where a handshake may go)."""
    first: dict[int, Message] = {}
    for msgs in orders.values():
        for m in msgs:
            if m.kind is MsgKind.ACT and boundary_of(m) not in first:
                first[boundary_of(m)] = m
    return set(first.values())


class Transport:
    """Sends and receives of one rank for one plan; peers are ranks of `group`."""

    def __init__(self, *, rank: int, num_stages: int, recv_order: dict, send_order: dict, device: torch.device,
                 timeout_s: float, group=None, pair_groups: dict | None = None, tags: bool = True,
                 buffers: dict | None = None):
        self.rank = rank
        self.num_stages = num_stages
        self.recv_order = recv_order
        self.position = {m: i for msgs in recv_order.values() for i, m in enumerate(msgs)}
        self.handshakes = handshake_messages(recv_order) | handshake_messages(send_order)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.group = group
        self.pair_groups = pair_groups or {}
        self.gloo = dist.get_backend(group) == "gloo"
        self.cuda = self.device.type == "cuda"
        self.staged = self.cuda and self.gloo  # gloo moves host memory: stage device tensors through it
        self.stream = torch.cuda.Stream(self.device) if self.cuda and not self.staged else None
        self.tags = tags and self.gloo
        self.buffers = {} if buffers is None else buffers
        self.forward_only = False
        self.declared: dict[int, object] = {}
        self.learned: dict[int, object] = {}
        self.target: dict[int, int] = {}
        self.posted_count: dict[int, int] = {}
        self.posted: dict[Message, Posted] = {}
        self.meta_posts: dict[Message, Posted] = {}
        self.meta_arrived: set[Message] = set()
        self.in_flight: list[Posted] = []

    def begin(self, declared: dict, forward_only: bool) -> None:
        """Start a step: the metas the runner declares now (None where learned by handshake)."""
        self.reset()
        self.declared = dict(declared)
        self.forward_only = forward_only
        if self.stream is not None:
            # kept buffers are rewritten by this step's receives: not before the last step's compute is done
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def reset(self) -> None:
        """Forget the previous step's bookkeeping (all its operations have completed)."""
        self.learned.clear()
        self.target.clear()
        self.posted_count.clear()
        self.posted.clear()
        self.meta_posts.clear()
        self.meta_arrived.clear()
        self.in_flight.clear()

    def _meta(self, b: int):
        declared = self.declared.get(b)
        return declared if declared is not None else self.learned.get(b)

    def _route(self, src: int, dst: int, peer: int) -> tuple[object, int]:
        """(process group, peer's rank in it) for the direction src -> dst."""
        g = self.pair_groups.get((src, dst))
        if g is None:
            return self.group, peer
        return g, dist.get_group_rank(g, dist.get_global_rank(self.group, peer) if self.group else peer)

    def _tag(self, msg: Message) -> int:
        return msg.tag(self.num_stages) if self.tags else 0

    # ----- receives

    def post_upto(self, upto) -> None:
        """Post, per peer, every receive up to the given count, in per-peer order (as far as metas are known)."""
        for peer, count in upto:
            self.target[peer] = max(self.target.get(peer, 0), count)
            self._advance(peer)

    def _advance(self, peer: int) -> None:
        order = self.recv_order.get(peer, ())
        done = self.posted_count.get(peer, 0)
        while done < self.target.get(peer, 0):
            msg = order[done]
            metas = self._recv_metas(msg)
            if metas is None:
                break  # a handshake or this rank's own activation still has to tell the shapes
            self.posted[msg] = self._post(msg, metas)
            done += 1
            self.posted_count[peer] = done

    def _recv_metas(self, msg: Message) -> list[TensorMeta] | None:
        """Leaf metas of a message, or None while they are not known yet."""
        b = boundary_of(msg)
        if msg.kind is MsgKind.GRAD:
            meta = self._meta(b)  # this rank sent (or declared) the activation this gradient belongs to
            if meta is None:
                return None
            leaves, _ = leaf_metas(meta)
            return [leaves[i] for i in grad_leaves(meta)]
        if self._meta(b) is None:
            if msg not in self.handshakes:
                return None
            hs = self.meta_posts.get(msg)
            if hs is None:
                hs = self.meta_posts[msg] = self._post(msg, [_HANDSHAKE])
            if msg not in self.meta_arrived:
                # gloo's receive work cannot be polled (is_completed() stays False until wait()), so there
                # the handshake is awaited only when its message is consumed (recv)
                if self.gloo or not all(w.is_completed() for w in hs.works):
                    return None
                self._wait(hs, msg.consumer, "receive")
            buf = hs.host[0] if self.staged else hs.tensors[0]
            self.learned[b] = decode_meta(buf)
        return leaf_metas(self._meta(b))[0]

    def _post(self, msg: Message, metas: list[TensorMeta]) -> Posted:
        group, grp_peer = self._route(msg.src, self.rank, msg.src)
        tag = self._tag(msg)
        tensors, hosts, works = [], [], []
        for i, meta in enumerate(metas):
            key = (msg, "meta" if meta is _HANDSHAKE else i)
            if self.staged:
                host = self._buffer(key, meta, "cpu")
                work = dist.irecv(host, group=group, group_src=grp_peer, tag=tag)
                hosts.append(host)
                tensors.append(host)
            elif self.cuda:
                with torch.cuda.stream(self.stream):
                    buf = self._buffer(key, meta, self.device)
                    work = dist.irecv(buf, group=group, group_src=grp_peer, tag=tag)
                tensors.append(buf)
            else:
                buf = self._buffer(key, meta, self.device)
                work = dist.irecv(buf, group=group, group_src=grp_peer, tag=tag)
                tensors.append(buf)
            works.append(work)
        return Posted(msg=msg, tensors=tuple(tensors), works=tuple(works), host=tuple(hosts))

    def _buffer(self, key, meta: TensorMeta, device) -> torch.Tensor:
        buf = self.buffers.get(key)
        if not reusable(buf, meta.shape, meta.dtype, device):
            buf = self.buffers[key] = meta.empty(device)
        return buf

    def recv(self, msg: Message, action):
        """The received value of `msg` (activation or gradient structure), waiting at most the timeout for it."""
        peer = msg.src
        if msg not in self.posted:
            self.target[peer] = max(self.target.get(peer, 0), self.position[msg] + 1)
            self._advance(peer)
        while msg not in self.posted:
            blocking = self.recv_order[peer][self.posted_count.get(peer, 0)]
            hs = self.meta_posts.get(blocking)
            if hs is None:
                raise ExecutorError(f"rank {self.rank}: {action}: the shapes of {blocking} are unknown (no declared "
                                    f"meta, no handshake, and this rank has not sent its activation)",
                                    rank=self.rank, action=str(action), awaited=str(blocking))
            self._wait(hs, action, "receive")
            self.meta_arrived.add(blocking)
            self._advance(peer)
        p = self.posted.pop(msg)
        tensors = self._finish_recv(p, action)
        b = boundary_of(msg)
        if msg.kind is MsgKind.GRAD:
            return unpack_grads(self._meta(b), tensors)
        leaves, structure = leaf_metas(self._meta(b))
        grad = not self.forward_only
        # hand out views: the kept buffer itself never becomes an autograd leaf
        return unflatten([t.detach().requires_grad_(grad and m.needs_grad) for t, m in zip(tensors, leaves)],
                         structure)

    def _finish_recv(self, p: Posted, action) -> list[torch.Tensor]:
        self._wait(p, action, "receive")
        if self.staged:
            return [h.to(self.device) for h in p.host]
        if self.cuda:
            for t in p.tensors:
                t.record_stream(torch.cuda.current_stream(self.device))
        return list(p.tensors)

    # ----- sends

    def send(self, msg: Message, value, action) -> None:
        """Start sending `value` as `msg` and return at once (the send is awaited in `finish`)."""
        b = boundary_of(msg)
        if msg.kind is MsgKind.ACT:
            tensors = self._activation(msg, b, value, action)
        else:
            meta = self._meta(b)
            tensors = self._gradients(msg, meta, value, action)
        group, grp_peer = self._route(self.rank, msg.dst, msg.dst)
        tag = self._tag(msg)
        works, kept = [], []
        for t in tensors:
            data = t.detach().contiguous()
            if self.staged:
                data = data.cpu()  # waits for the producing kernels: gloo reads host memory at once
                work = dist.isend(data, group=group, group_dst=grp_peer, tag=tag)
            elif self.cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    work = dist.isend(data, group=group, group_dst=grp_peer, tag=tag)
            else:
                work = dist.isend(data, group=group, group_dst=grp_peer, tag=tag)
            works.append(work)
            kept.append(data)  # holding `data` until completion keeps its buffer from being reused mid-transfer
        self.in_flight.append(Posted(msg=msg, tensors=tuple(kept), works=tuple(works)))
        if msg.kind is MsgKind.ACT:
            self._advance(msg.dst)  # its gradient's receive can now be posted

    def _activation(self, msg: Message, b: int, value, action) -> list[torch.Tensor]:
        actual = meta_of(value, grad=not self.forward_only)
        declared = self.declared.get(b)
        if declared is not None:
            why = mismatch(declared, actual, check_grad=not self.forward_only)
            if why is not None:
                raise ExecutorError(f"rank {self.rank}: {action} produced a value that does not fit boundary {b} "
                                    f"for {msg}: {why}", rank=self.rank, action=str(action), awaited=str(msg))
        else:
            known = self.learned.get(b)
            if known is not None and not same_meta(known, actual):
                raise ExecutorError(f"rank {self.rank}: {action}: boundary {b} changed shape within the step "
                                    f"(shapes may change between steps only)", rank=self.rank, action=str(action),
                                    awaited=str(msg))
            self.learned[b] = actual
            if msg in self.handshakes:
                self._send_raw(msg, encode_meta(actual))
        return flatten(value)[0]

    def _gradients(self, msg: Message, meta, value, action) -> list[torch.Tensor]:
        try:
            grads = pack_grads(meta, value)
        except ValueError as exc:
            raise ExecutorError(f"rank {self.rank}: {action}: {exc}", rank=self.rank, action=str(action),
                                awaited=str(msg)) from None
        leaves, _ = leaf_metas(meta)
        for i, g in zip(grad_leaves(meta), grads):
            if not leaves[i].matches(g):
                raise ExecutorError(
                    f"rank {self.rank}: {action} produced a gradient {tuple(g.shape)} {g.dtype} for leaf {i} of "
                    f"{msg}, the boundary is {leaves[i].shape} {leaves[i].dtype}", rank=self.rank,
                    action=str(action), awaited=str(msg))
        return [g.to(self.device) for g in grads]

    def _send_raw(self, msg: Message, buf: torch.Tensor) -> None:
        """Send one handshake tensor ahead of the message's data (same route, same tag)."""
        group, grp_peer = self._route(self.rank, msg.dst, msg.dst)
        if self.cuda and not self.staged:
            buf = buf.to(self.device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                work = dist.isend(buf, group=group, group_dst=grp_peer, tag=self._tag(msg))
        else:
            work = dist.isend(buf, group=group, group_dst=grp_peer, tag=self._tag(msg))
        self.in_flight.append(Posted(msg=msg, tensors=(buf,), works=(work,)))

    def reap(self) -> None:
        """Drop sends that have completed (frees their buffers early)."""
        if self.in_flight:
            self.in_flight = [p for p in self.in_flight if not all(w.is_completed() for w in p.works)]

    def finish(self, action="end of step") -> None:
        """Wait for every send of the step, each for at most the timeout."""
        while self.in_flight:
            self._wait(self.in_flight.pop(0), action, "send")

    def _wait(self, p: Posted, action, what: str) -> None:
        start = time.monotonic()
        try:
            for work in p.works:
                if self.gloo:
                    # each tensor of a message gets the whole bound (the first one is what waits on the peer)
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
                else:
                    while not work.is_completed():
                        if time.monotonic() - start > self.timeout_s:
                            raise TimeoutError(f"no completion after {self.timeout_s:g} s")
                        time.sleep(0.0001)
                    work.wait()
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
