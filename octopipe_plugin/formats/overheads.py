"""`octopipe-overheads/1`: the executor's own host cost per action kind and per message, measured on one device.

Written by `octopipe profile --overheads` (profile/overheads.py), read by `simulate`, `plan` and
the benchmarks; how the figures are charged is simulator/overheads.py (docs/formats.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field, replace

from .fields import check_format, check_value, field, load_json, write_json
from ..actions import Kind
from ..errors import FormatError

OVERHEADS_FORMAT = "octopipe-overheads/1"
MAX_OVERHEAD_US = 1e6  # a second per action or message: anything above is a broken measurement, not a cost


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageCost:
    """Host time one message costs one end of the transfer: `fixed_ms` plus `per_mb_ms` per 10^6 bytes."""

    fixed_ms: float = 0.0
    per_mb_ms: float = 0.0

    def ms(self, nbytes: float) -> float:
        """Host milliseconds of one message of `nbytes`."""
        return self.fixed_ms + self.per_mb_ms * nbytes / 1e6


@dataclass(frozen=True, kw_only=True, slots=True)
class Overheads:
    """The executor's host costs: per action (by kind), per message on the sender and on the receiver.

    `launch_ms` is the older fixed per-message cost in flight (`--launch-us`): it delays the
    message's arrival but occupies neither device. `delivery` is the measured in-flight cost of the
    same kind: how much later than the link's idle ping-pong a message arrives when its sender goes
    on computing right after posting it (profile/overheads.py). All zero (the default) charges nothing.
    """

    action_ms: tuple[tuple[str, float], ...] = ()  # (kind letter, ms), kinds absent cost nothing
    send: MessageCost = MessageCost()
    recv: MessageCost = MessageCost()
    launch_ms: float = 0.0
    delivery: MessageCost = MessageCost()
    # one round of an all-gather (a ring's step: each member takes its neighbour's part and passes it on) beyond the
    # link's time: a split head's statistics' gather waits n - 1 of them (simulator/split.py gather_ms)
    gather_round: MessageCost = MessageCost()
    device: str = ""
    backend: str = ""
    meta: dict = dc_field(default_factory=dict, compare=False, hash=False)

    def action(self, kind: Kind) -> float:
        """Host milliseconds one action of `kind` costs beyond its layers' own time."""
        for k, ms in self.action_ms:
            if k == kind.value:
                return ms
        return 0.0

    def scaled(self, factor: float, per_mb: bool = True) -> "Overheads":
        """Every host cost times `factor` (the in-flight `launch_ms` too): the same work on a `factor` times busier host
        (stand-in ranks sharing few cores: `testing.sleep_layer.standin_sim_options`); `per_mb` False drops the
        per-byte parts (messages that carry a stamp, not the model's bytes)."""
        def m(c: MessageCost) -> MessageCost:
            return MessageCost(fixed_ms=c.fixed_ms * factor, per_mb_ms=c.per_mb_ms * factor if per_mb else 0.0)

        return replace(self, action_ms=tuple((k, ms * factor) for k, ms in self.action_ms), send=m(self.send),
                       recv=m(self.recv), launch_ms=self.launch_ms * factor, delivery=m(self.delivery),
                       gather_round=m(self.gather_round))

    @property
    def is_zero(self) -> bool:
        """Whether nothing is charged."""
        return not any(ms for _, ms in self.action_ms) and self.send == MessageCost() and \
            self.recv == MessageCost() and not self.launch_ms and self.delivery == MessageCost() and \
            self.gather_round == MessageCost()


def overheads_from_dict(data: dict, src: str = "<dict>") -> Overheads:
    """Parse an octopipe-overheads/1 document; bad input raises FormatError naming the file and field."""
    check_format(data, src, "octopipe-overheads")
    acts = field(data, "action_us", src, "$", dict)
    known = {k.value for k in Kind}
    pairs = []
    for k, v in sorted(acts.items()):
        if k not in known:
            raise FormatError(src, f"$.action_us.{k}", f"an action kind ({', '.join(sorted(known))})", k)
        us = check_value(v, src, f"$.action_us.{k}", float, minimum=0.0, maximum=MAX_OVERHEAD_US)
        pairs.append((k, us / 1000.0))
    ends = {}
    for end in ("send", "recv", "delivery", "gather_round"):
        if end in ("delivery", "gather_round") and f"{end}_us" not in data:  # came later (optional): none charges none
            ends[end] = MessageCost()
            continue
        obj = field(data, f"{end}_us", src, "$", dict)
        path = f"$.{end}_us"
        fixed = field(obj, "fixed", src, path, float, minimum=0.0, maximum=MAX_OVERHEAD_US)
        per_mb = field(obj, "per_mb", src, path, float, default=0.0, minimum=0.0, maximum=MAX_OVERHEAD_US)
        ends[end] = MessageCost(fixed_ms=fixed / 1000.0, per_mb_ms=per_mb / 1000.0)
    launch = field(data, "launch_us", src, "$", float, default=0.0, minimum=0.0, maximum=MAX_OVERHEAD_US)
    return Overheads(action_ms=tuple(pairs), send=ends["send"], recv=ends["recv"], launch_ms=launch / 1000.0,
                     delivery=ends["delivery"], gather_round=ends["gather_round"], device=field(data, "device", src, "$", str, default=""),
                     backend=field(data, "backend", src, "$", str, default=""),
                     meta=field(data, "meta", src, "$", dict, default={}))


def overheads_to_dict(ov: Overheads) -> dict:
    """Inverse of overheads_from_dict (microseconds, as the file holds them)."""
    def us(ms: float) -> float:
        return round(ms * 1000.0, 3)

    return {"format": OVERHEADS_FORMAT, "device": ov.device, "backend": ov.backend,
            "action_us": {k: us(ms) for k, ms in ov.action_ms},
            "send_us": {"fixed": us(ov.send.fixed_ms), "per_mb": us(ov.send.per_mb_ms)},
            "recv_us": {"fixed": us(ov.recv.fixed_ms), "per_mb": us(ov.recv.per_mb_ms)},
            "launch_us": us(ov.launch_ms),
            "delivery_us": {"fixed": us(ov.delivery.fixed_ms), "per_mb": us(ov.delivery.per_mb_ms)},
            "gather_round_us": {"fixed": us(ov.gather_round.fixed_ms), "per_mb": us(ov.gather_round.per_mb_ms)},
            "meta": dict(ov.meta)}


def read_overheads(source) -> Overheads:
    """Read an overheads file (path or dict)."""
    data, name = load_json(source)
    return overheads_from_dict(data, name)


def write_overheads(ov: Overheads, path) -> None:
    """Write an overheads file."""
    write_json(overheads_to_dict(ov), path)
