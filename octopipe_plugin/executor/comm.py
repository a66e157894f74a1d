"""Point-to-point transport of one rank: receives posted early, non-blocking sends, bounded waits.

A message carries one boundary value (one or several tensors, see boundary.py): one
point-to-point operation per tensor, all with the message's tag, in leaf order. Where the
runner declares no meta for a boundary, the first activation of that boundary in the step
is preceded by a handshake message holding the meta; posting from that peer pauses at that
message until the handshake has arrived, so per-peer order is kept.

This module keeps what every backend shares: the per-peer order, the handshake, the checks
of what is sent (shape, structure, device) and the named error of a failed wait. How the
tensors move is a lane's job (lanes.py: plain gloo, host-staged, CUDA streams + events).
NCCL ignores tags and serialises the p2p operations of one communicator on one stream, so a
send to a peer that has not yet posted its receive would block a receive queued behind it:
each direction of each rank pair gets its own communicator (comm_cache.py).

Two exchanges: "message" issues each message as soon as it is ready; "batched" holds a
step's ready sends and receives and issues them at the next exchange point (the start of
the next action's posting, a receive that needs them, the end of the step) as one
`batch_isend_irecv` per (process group, peer), as DualPipe and Megatron do. Both issue the
same operations in the same order on every communicator, so both ends still match in
per-peer order; where the backend coalesces a batch into one completion (NCCL), a batch of
receives holds one message, so a consumer never waits on a later message's arrival.
"""

from __future__ import annotations

import os
import time
import torch
import torch.distributed as dist

from ..schedules.messages import Message, MsgKind
from .boundary import (
    decode_meta, encode_meta, flatten, grad_leaves, leaf_metas, meta_of, mismatch, pack_grads, same_meta, unflatten,
    unpack_grads, META_BYTES,
)
from .comm_cache import reusable
from .head_input import metas_from_head_input
from .errors import ExecutorError
from .interface import TensorMeta
from .lanes import Request, Transfer, make_lane

_HANDSHAKE = TensorMeta(shape=(META_BYTES,), dtype=torch.uint8, requires_grad=False)
EXCHANGES = ("message", "batched")
# gloo: both exchanges measure the same (benchmarks/exchange_lanes.py; gloo does not coalesce a batch), the
# per-message one posts earlier; NCCL: not measured yet (scripts/gpu_check.sh checks both)
DEFAULT_EXCHANGE = {"gloo": "message", "nccl": "message"}


# gloo's tcp transport writes a message from its device-loop thread unless the sender's own thread can (the
# receiver's ready notice already handled, the message fitting the socket buffer: gloo/transport/tcp/pair.cc); a
# sender that computes on at once keeps that thread from a core for up to a scheduler slice (1-3 ms measured,
# profile/overheads.py). Giving the core up once after posting lets the woken device thread write first:
# measured 0.9-1.1 ms of delay gone for +0.02-0.16 ms on the sender (4 KB to 4 MB). NCCL: not affected, unchanged.
YIELD_AFTER_SEND = {"gloo": True}


def yields_after_send(backend: str) -> bool:
    """Whether a rank gives up its core once after posting sends on `backend` (its default)."""
    return YIELD_AFTER_SEND.get(backend, False)


def give_way(enabled: bool) -> None:
    """After posting sends: yield the core once when `enabled` (the one place the executor and its profile do)."""
    if enabled:
        os.sched_yield()


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


# split messages whose meta a transport may learn in a step: the head input (handshake), what follows from it
_LEARNABLE = ("head-input", "stats", "head-partial")


def _first_head_inputs(orders: dict) -> set:
    """Per peer order -> the first head-input message of each (where a head input's handshake goes)."""
    return {next(m for m in msgs if m.kind is None and m.what == "head-input")
            for msgs in orders.values() if any(m.kind is None and m.what == "head-input" for m in msgs)}


def default_exchange(backend: str) -> str:
    """The exchange a backend uses unless told otherwise."""
    return DEFAULT_EXCHANGE.get(backend, "message")


class Transport:
    """Sends and receives of one rank for one plan; peers are ranks of `group`.

    `buffers`: the receive-buffer store kept across steps (None: every step allocates its own).
    `exchange`: "message" or "batched" (None: the backend's default).
    `positions`: the plan's `schedules.messages.device_positions` (None: sends are dropped only by `reap` and
    `finish`); with it, a lane whose sends cannot be polled drops them once the peer has visibly consumed them.
    `yield_after_send`: give the core up once after posting sends (None: the backend's default, `YIELD_AFTER_SEND`).
    `gather_groups`: a split head's shard devices (sorted) -> (their process group, the device of each group rank):
    where the statistics' all-gathers run (`start_gather`, `gathered`; comm_cache.CommCache.gather_groups).
    """

    def __init__(self, *, rank: int, num_stages: int, recv_order: dict, send_order: dict, device: torch.device,
                 timeout_s: float, group=None, pair_groups: dict | None = None, tags: bool = True,
                 buffers: dict | None = None, exchange: str | None = None, positions: dict | None = None,
                 yield_after_send: bool | None = None, gather_groups: dict | None = None):
        self.rank = rank
        self.gather_groups = gather_groups or {}
        self.gathers: dict = {}  # StatsGather -> (its Transfer, the wire tensor it reads) until its J takes it
        # (device, action) -> position in that device's list of the step's plan: tells which sends a peer has
        # consumed (per device: a shard action of a split layer runs on several)
        self.positions = positions
        self.num_stages = num_stages
        self.recv_order = recv_order
        self.send_order = send_order
        self.position = {m: i for msgs in recv_order.values() for i, m in enumerate(msgs)}
        self.handshakes = handshake_messages(recv_order) | handshake_messages(send_order)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.group = group
        self.pair_groups = pair_groups or {}
        backend = dist.get_backend(group)
        self.exchange = exchange or default_exchange(backend)
        self.give_way = yields_after_send(backend) if yield_after_send is None else yield_after_send
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange {self.exchange!r}: expected one of {', '.join(EXCHANGES)}")
        groups = {id(g): g for g in (group, *self.pair_groups.values()) if g is not None}
        self.lane = make_lane(backend=backend, device=self.device, timeout_s=timeout_s, rank=rank,
                              groups=tuple(groups.values()),
                              to_global=lambda r: dist.get_global_rank(group, r) if group is not None else r)
        self.tags = tags and backend == "gloo"
        self.keep_buffers = buffers is not None
        self.buffers = {} if buffers is None else buffers
        self.forward_only = False
        self.declared: dict[int, object] = {}
        self.split_metas: dict[str, TensorMeta] = {}  # a split layer's messages: what -> meta (runner.split_meta)
        self.split_learned: dict[str, object] = {}  # what -> meta learned this step (head input undeclared)
        self.split_handshakes: set = set()  # the head-input messages a handshake goes ahead of (when undeclared)
        self.learned: dict[int, object] = {}
        self.target: dict[int, int] = {}
        self.posted_count: dict[int, int] = {}
        self.posted: dict[Message, Transfer] = {}
        self.meta_posts: dict[Message, Transfer] = {}
        self.meta_arrived: set[Message] = set()
        # sends not yet known complete, per destination in posting order (a receive from a peer scans only its own)
        self.in_flight: dict[int, list[Transfer]] = {}
        self.queued: list[Transfer] = []
        self.owed_yield = False  # a send was posted since the last end_sends
        self.yields = 0  # end_sends' yields this step
        self.left_at_finish = 0  # messages whose sends were still held when the step's finish began

    def begin(self, declared: dict, forward_only: bool, split_metas: dict | None = None) -> None:
        """Start a step: the metas the runner declares now (None where learned by handshake), and those of the
        split layers' messages (what -> TensorMeta: no handshake, the runner declares them)."""
        self.reset()
        self.yields = 0
        if not self.keep_buffers:
            self.buffers.clear()  # reuse_buffers=False: this step's receives get buffers of their own
        self.declared = dict(declared)
        self.split_metas = dict(split_metas or {})
        # an undeclared head input (None) is learned by a handshake ahead of the first one on each pair, and the
        # statistics' and partials' metas follow from it (head_input.metas_from_head_input)
        undeclared = "head-input" in self.split_metas and self.split_metas["head-input"] is None
        self.split_handshakes = (_first_head_inputs(self.recv_order) | _first_head_inputs(self.send_order)
                                 if undeclared else set())
        self.forward_only = forward_only
        self.lane.begin()

    def reset(self) -> None:
        """Forget the previous step's bookkeeping (all its operations have completed)."""
        self.learned.clear()
        self.split_learned.clear()
        self.target.clear()
        self.posted_count.clear()
        self.posted.clear()
        self.meta_posts.clear()
        self.meta_arrived.clear()
        self.in_flight.clear()
        self.queued.clear()
        self.gathers.clear()

    def close(self) -> None:
        """Stop the lane's background work (the watchdog thread on CUDA)."""
        self.lane.close()

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

    # ----- issuing (per message, or held for the step's batch)

    def _issue(self, t: Transfer) -> None:
        if self.exchange == "batched":
            self.queued.append(t)
        else:
            t.works = self.lane.issue(t.requests)

    def flush(self) -> None:
        """Issue the held operations: one batch per (process group, peer), in the order they were held."""
        if not self.queued:
            return
        batches: dict[tuple, list[Transfer]] = {}
        for t in self.queued:
            r = t.requests[0]
            # a coalescing backend completes a batch as one: receives of different messages go in different batches
            split = None if (r.send or not self.lane.coalesces) else id(t)
            batches.setdefault((id(r.group), r.peer, r.send if self.lane.coalesces else None, split), []).append(t)
        self.queued = []
        sends = False
        for transfers in batches.values():
            requests = [r for t in transfers for r in t.requests]
            works = self.lane.issue_batch(requests)
            if len(works) == len(requests):
                i = 0
                for t in transfers:
                    t.works, i = tuple(works[i:i + len(t.requests)]), i + len(t.requests)
            else:  # coalesced: the batch completes as one
                for t in transfers:
                    t.works = tuple(works)
            sends = sends or requests[0].send
        give_way(sends and self.give_way)

    # ----- receives

    def post_upto(self, upto) -> None:
        """Post, per peer, every receive up to the given count, in per-peer order (as far as metas are known)."""
        self._check_watchdog("posting")
        for peer, count in upto:
            self.target[peer] = max(self.target.get(peer, 0), count)
            self._advance(peer)
        self.flush()  # the exchange point: the last action's send and the receives now in the window

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
        if msg.kind is None:  # a split layer's hand-over: its meta (the head's input: a HeadInput of three)
            meta = self._split_known(msg, msg.consumer)
            if meta is None and msg in self.split_handshakes:
                learned = self._handshake(msg)
                if learned is None:
                    return None
                self._learn_split(learned)
                meta = self._split_known(msg, msg.consumer)
            return None if meta is None else leaf_metas(meta)[0]
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
            learned = self._handshake(msg)
            if learned is None:
                return None
            self.learned[b] = learned
        return leaf_metas(self._meta(b))[0]

    def _handshake(self, msg: Message):
        """The meta the handshake ahead of `msg` carries (posted on first ask), or None while it has not arrived."""
        hs = self.meta_posts.get(msg)
        if hs is None:
            hs = self.meta_posts[msg] = self._post(msg, [_HANDSHAKE])
        if msg not in self.meta_arrived:
            # gloo's receive work cannot be polled (is_completed() stays False until wait()), so there
            # the handshake is awaited only when its message is consumed (recv)
            if not self.lane.pollable() or not hs.completed():
                return None
            self._wait(hs, msg.consumer, "receive", host=True)
        return decode_meta(self.lane.received(hs)[0])

    def _post(self, msg: Message, metas: list[TensorMeta]) -> Transfer:
        group, grp_peer = self._route(msg.src, self.rank, msg.src)
        tag = self._tag(msg)
        bufs = []
        with self.lane.issuing():  # CUDA: buffers made on the side stream that fills them
            for i, meta in enumerate(metas):
                bufs.append(self._buffer((msg, "meta" if meta is _HANDSHAKE else i), meta, self.lane.wire_device))
        t = Transfer(msg, tuple(bufs), tuple(Request(send=False, wire=b, group=group, peer=grp_peer, tag=tag)
                                             for b in bufs))
        self._issue(t)
        return t

    def _buffer(self, key, meta: TensorMeta, device) -> torch.Tensor:
        buf = self.buffers.get(key)
        if not reusable(buf, meta.shape, meta.dtype, device):
            buf = self.buffers[key] = meta.empty(device)
        return buf

    def recv(self, msg: Message, action):
        """The received value of `msg` (activation or gradient structure), waiting at most the timeout for it."""
        self._check_watchdog(action)
        peer = msg.src
        if msg not in self.posted:
            self.target[peer] = max(self.target.get(peer, 0), self.position[msg] + 1)
            self._advance(peer)
        while msg not in self.posted:
            blocking = self.recv_order[peer][self.posted_count.get(peer, 0)]
            hs = self.meta_posts.get(blocking)
            if hs is None and blocking.kind is None and self._await_head_input(action):
                self._advance(peer)  # the statistics' or partials' meta is known now
                continue
            if hs is None:
                raise ExecutorError(f"rank {self.rank}: {action}: the shapes of {blocking} are unknown (no declared "
                                    f"meta, no handshake, and this rank has not sent its activation)",
                                    rank=self.rank, action=str(action), awaited=str(blocking), peer=peer)
            self._wait(hs, action, "receive", host=True)
            self.meta_arrived.add(blocking)
            self._advance(peer)
        p = self.posted.pop(msg)
        self._wait(p, action, "receive")
        self._drop_consumed_sends(msg, action)
        tensors = self.lane.received(p)
        self._check_devices(tensors, msg, action, "received buffer")
        if msg.kind is None:  # shard math takes no autograd graph across devices
            _, structure = leaf_metas(self._split_known(msg, action))
            return unflatten([t.detach() for t in tensors], structure)
        b = boundary_of(msg)
        if msg.kind is MsgKind.GRAD:
            return unpack_grads(self._meta(b), tensors)
        leaves, structure = leaf_metas(self._meta(b))
        grad = not self.forward_only
        # hand out views: the kept buffer itself never becomes an autograd leaf
        return unflatten([t.detach().requires_grad_(grad and m.needs_grad) for t, m in zip(tensors, leaves)],
                         structure)

    # ----- sends

    def send(self, msg: Message, value, action) -> None:
        """Start sending `value` as `msg`, return at once (dropped once done: `reap`, a later receive, `finish`)."""
        self._check_watchdog(action)
        if msg.kind is None:
            self._send_tensors(msg, self._split_tensors(msg, value, action))
            return
        b = boundary_of(msg)
        if msg.kind is MsgKind.ACT:
            self._check_devices(flatten(value)[0], msg, action, "tensor to send")
            tensors = self._activation(msg, b, value, action)
        else:
            tensors = self._gradients(msg, self._meta(b), value, action)
            self._check_devices(tensors, msg, action, "tensor to send")
        self._send_tensors(msg, tensors)
        if msg.kind is MsgKind.ACT:
            self._advance(msg.dst)  # its gradient's receive can now be posted

    def _send_tensors(self, msg: Message, tensors) -> None:
        group, grp_peer = self._route(self.rank, msg.dst, msg.dst)
        tag = self._tag(msg)
        # holding the wire tensors until completion keeps their memory from being reused mid-transfer
        wires = tuple(self.lane.send_wire(t) for t in tensors)
        t = Transfer(msg, wires, tuple(Request(send=True, wire=w, group=group, peer=grp_peer, tag=tag) for w in wires))
        self._issue(t)
        self.in_flight.setdefault(msg.dst, []).append(t)
        # batched: once the batch is issued (flush); per message: once the action's sends are all posted (end_sends)
        self.owed_yield = self.give_way and self.exchange != "batched"

    def end_sends(self) -> None:
        """An action's sends are posted: give the core up once (YIELD_AFTER_SEND) if any was. Once per action, not
        per message: a split head's fan-out posts up to 2 (n - 1) messages in one action, and each yield on a
        host with more ranks than cores waits for a whole scheduler slice (issue 36: 7 ms per send at 16 ranks on
        2 cores, 4 s of a 11.5 s step)."""
        if self.owed_yield:
            self.owed_yield = False
            self.yields += 1
            give_way(True)

    # ----- the statistics' all-gathers (schedules.split_messages.StatsGather)

    def start_gather(self, g, value, action) -> None:
        """Post the all-gather `g` of this shard's statistics `value`, return at once (its J takes it: `gathered`)."""
        self._check_watchdog(action)
        got = self.gather_groups.get(g.devices)
        if got is None:
            raise ExecutorError(f"rank {self.rank}: {action}: no process group for {g} (the executor makes one per "
                                f"split head at construction: comm_cache.CommCache.gather_groups)",
                                rank=self.rank, action=str(action), awaited=str(g))
        if not isinstance(value, torch.Tensor):
            raise ExecutorError(f"rank {self.rank}: {action} produced {type(value).__name__} for {g}: expected its "
                                f"statistics as one tensor", rank=self.rank, action=str(action), awaited=str(g))
        self._check_devices([value], g, action, "tensor to gather")
        wire = self.lane.send_wire(value)
        work, outs = self.lane.issue_gather(wire, got[0], len(g.devices))
        t = Transfer(g, tuple(outs), ())
        t.works = (work,)
        self.gathers[g] = (t, wire)  # the wire lives until the gather completed

    def gathered(self, g, action) -> tuple:
        """Every other shard's statistics of the all-gather `g`, in shard-device order (what their messages gave)."""
        held = self.gathers.pop(g, None)
        if held is None:
            raise ExecutorError(f"rank {self.rank}: {action}: {g} was not started on this rank (its H runs first)",
                                rank=self.rank, action=str(action), awaited=str(g))
        t = held[0]
        self._wait_gather(t, action)
        members = self.gather_groups[g.devices][1]
        tensors = self.lane.received(t)
        self._check_devices(tensors, g, action, "gathered buffer")
        return tuple(x.detach() for d, x in sorted(zip(members, tensors), key=lambda p: p[0]) if d != self.rank)

    def _wait_gather(self, t: Transfer, action) -> None:
        start = time.monotonic()
        try:
            self.lane.wait_gather(t.works[0])
        except Exception as exc:  # gloo raises RuntimeError for both a timeout and a dead peer
            raise ExecutorError(f"rank {self.rank}: {action}: {t.msg} failed after {time.monotonic() - start:.1f} s "
                                f"(timeout {self.timeout_s:g} s): {_reason(exc)}", rank=self.rank, action=str(action),
                                awaited=str(t.msg)) from exc
        self._check_watchdog(action)

    def _split_known(self, msg, action):
        """The meta of a split message: declared, or learned this step (None while the head input's handshake has
        not arrived); refused by name where it can be neither."""
        meta = self.split_metas.get(msg.what)
        if meta is not None:
            return meta
        if not self.split_handshakes or msg.what not in _LEARNABLE:
            raise ExecutorError(f"rank {self.rank}: {action}: no meta for the split layer's {msg.what!r} message {msg} "
                                f"(the runner's split_meta({msg.what!r}) returned None; only the head's input, its "
                                f"statistics and partials may be learned, from a head input left undeclared)",
                                rank=self.rank, action=str(action), awaited=str(msg))
        return self.split_learned.get(msg.what)

    def _split_meta(self, msg, action):
        meta = self._split_known(msg, action)
        if meta is None:
            raise ExecutorError(f"rank {self.rank}: {action}: the meta of {msg} is not known yet (it follows from the "
                                f"head input's handshake, which has not arrived)", rank=self.rank, action=str(action),
                                awaited=str(msg))
        return meta

    def _learn_split(self, head_meta) -> None:
        """The head input's meta learned (sent or received by handshake): it and what follows from it."""
        if len(leaf_metas(head_meta)[0]) == 3:  # a HeadInput (a stand-in's one payload implies nothing more)
            self.split_learned.update(metas_from_head_input(unflatten(*leaf_metas(head_meta))))
        else:
            self.split_learned["head-input"] = head_meta

    def _await_head_input(self, action) -> bool:
        """Wait for the head input's handshake to this rank (the metas of the statistics and partials follow from it);
        False when none is on its way (the caller then reports the unknown shapes)."""
        if "head-input" in self.split_learned:
            return False
        for hs_msg in self.split_handshakes:
            if hs_msg.dst != self.rank:
                continue
            peer = hs_msg.src
            self.target[peer] = max(self.target.get(peer, 0), self.position[hs_msg] + 1)
            self._advance(peer)
            if "head-input" in self.split_learned:  # it had arrived: posting learned it
                return True
            hs = self.meta_posts.get(hs_msg)
            if hs is None:
                return False
            self._wait(hs, action, "receive", host=True)
            self.meta_arrived.add(hs_msg)
            self._learn_split(decode_meta(self.lane.received(hs)[0]))
            return True
        return False

    def _split_tensors(self, msg, value, action) -> list[torch.Tensor]:
        """The tensors a split hand-over carries (one, or the head input's three), checked against its declared
        meta and the device."""
        # a None leaf travels as nothing: a stand-in owner's (hidden, None, None) to shards declaring one payload
        leaves = [t for t in flatten(value)[0] if t is not None]
        if self.split_metas.get(msg.what) is None and msg.what == "head-input" and self.split_handshakes:
            if "head-input" not in self.split_learned:
                self._learn_split(meta_of(value, grad=False))
            if msg in self.split_handshakes:  # the handshake goes ahead of the message's data (same route, tag)
                self._send_tensors(msg, [encode_meta(self.split_learned["head-input"]).to(self.device)])
        metas, _ = leaf_metas(self._split_meta(msg, action))
        bad = len(leaves) != len(metas) or any(not isinstance(t, torch.Tensor) or not m.matches(t)
                                               for t, m in zip(leaves, metas))
        if bad:
            def said(ts):
                return ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, (torch.Tensor, TensorMeta))
                                 else type(t).__name__ for t in ts)
            raise ExecutorError(f"rank {self.rank}: {action} produced [{said(leaves)}] for {msg}, its declared meta "
                                f"is [{said(metas)}]", rank=self.rank, action=str(action), awaited=str(msg))
        self._check_devices(leaves, msg, action, "tensor to send")
        return [t.detach() for t in leaves]

    def _check_devices(self, tensors, msg: Message, action, what: str) -> None:
        """Refuse a tensor on another device than the executor's (a device mix-up fails here, by name)."""
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise ExecutorError(
                    f"rank {self.rank}: {action}: {what} {i} of {msg} is on {t.device}, the executor runs on "
                    f"{self.device} (build the executor with device= the model's device, and place the stage's "
                    f"tensors there)", rank=self.rank, action=str(action), awaited=str(msg))

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
                # the handshake goes ahead of the message's data (same route, same tag)
                self._send_tensors(msg, [encode_meta(actual).to(self.device)])
        return flatten(value)[0]

    def _gradients(self, msg: Message, meta, value, action) -> list[torch.Tensor]:
        try:
            grads = pack_grads(meta, value, device=self.device)
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
        return grads

    def reap(self) -> None:
        """Drop sends that have completed (frees their buffers early)."""
        self._check_watchdog("reap")
        # a send that cannot be polled (gloo's) never reports completion before its wait: scanning them after every
        # action cost O(sends) each, ~0.6 s of a 16-rank split step's host time (issue 36); _drop_consumed_sends
        # drops those instead
        if self.in_flight and self.lane.pollable():
            self.in_flight = {peer: kept for peer, sends in self.in_flight.items()
                              if (kept := [t for t in sends if not t.completed()])}

    def _drop_consumed_sends(self, got: Message, action) -> None:
        """Drop the sends to `got`'s sender that it consumed before producing `got` (they have completed).

        gloo's send works report completion only once waited on, so `reap` never drops them: each send's wire
        tensors (for a pseudo-freed output, its whole storage) would live until the step's end, as Megatron's
        schedules never keep them. Waiting on such a send returns at once: the peer already received it.
        """
        sends = self.in_flight.get(got.src) if self.positions is not None and not self.lane.pollable() else None
        if not sends:
            return
        made = self.positions.get((got.src, got.producer))
        if made is None:
            return
        keep = []
        for t in sends:
            used = self.positions.get((t.msg.dst, t.msg.consumer))
            if t.works is not None and used is not None and used < made:
                self._wait(t, action, "send")
            else:
                keep.append(t)
        self.in_flight[got.src] = keep

    def finish(self, action="end of step") -> None:
        """Wait for every send of the step, each for at most the timeout."""
        self.flush()
        self.left_at_finish = len({t.msg for sends in self.in_flight.values() for t in sends})  # handshakes: one
        for peer in sorted(self.in_flight):
            sends = self.in_flight.pop(peer)
            while sends:
                self._wait(sends.pop(0), action, "send")
        while self.gathers:  # none is left by a complete step: every J took its micro-batch's
            self._wait_gather(self.gathers.pop(next(iter(self.gathers)))[0], action)
        self._check_watchdog(action)

    # ----- waits

    def _wait(self, t: Transfer, action, what: str, host: bool = False) -> None:
        if t.works is None:
            self.flush()  # a held batch: issue it before waiting on it
        peer = t.msg.src if what == "receive" else t.msg.dst
        start = time.monotonic()
        try:
            (self.lane.wait_host if host else self.lane.wait)(t, (action, what, peer))
        except Exception as exc:  # gloo raises RuntimeError for both a timeout and a dead peer
            failure = self.lane.failure()
            if failure is not None:
                raise self._named(*failure) from exc
            raise self._error(t, action, what, time.monotonic() - start, _reason(exc)) from exc
        self._check_watchdog(action)

    def _check_watchdog(self, action) -> None:
        failure = self.lane.failure()
        if failure is not None:
            raise self._named(*failure)

    def _named(self, entry, reason: str) -> ExecutorError:
        if entry is None:
            return ExecutorError(f"rank {self.rank}: {reason}", rank=self.rank)
        t, action, what, waited = entry
        return self._error(t, action, what, waited, reason)

    def _error(self, t: Transfer, action, what: str, waited: float, reason: str) -> ExecutorError:
        """The one named error of a failed wait: rank, action, message (and its tag), peer, time waited, why."""
        peer = t.msg.src if what == "receive" else t.msg.dst
        return ExecutorError(
            f"rank {self.rank}: {action}: {what} of {t.msg} (tag {t.msg.tag(self.num_stages)}) "
            f"{'from' if what == 'receive' else 'to'} rank {peer} failed after {waited:.1f} s "
            f"(timeout {self.timeout_s:g} s): {reason}",
            rank=self.rank, action=str(action), awaited=str(t.msg), peer=peer)


def _reason(exc: Exception) -> str:
    """The backend's one-line reason, with what it means when it says the peer's socket closed."""
    line = _first_line(exc)
    if "by peer" in line or "Connection closed" in line:
        return f"peer died or left ({line})"
    return line


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
