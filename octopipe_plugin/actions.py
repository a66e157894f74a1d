"""The plan IR: `Action(stage, kind, microbatch)`, written `3F12`, and the one table of action kinds.

`RULES` says, for every kind, what it waits for, what it hands on and what it does to the
stage's live activation. The simulator, the tuner's list scheduler, the message lowering,
the executor's program and the plan validator all read it, so adding a kind means one new
`Kind` member and one `RULES` entry (see docs/formats.md, "Reference execution semantics").

A leaf module: it imports nothing from the package, so formats and schedules both build on
it without importing each other.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class Kind(str, enum.Enum):
    """F forward, B fused backward, I input-gradient backward, W weight-gradient backward; the shard kinds
    of a split layer (docs/formats.md, "Split layers"): H, J, K of the LM head, E, G of the embedding."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the letter is the notation
    W = "W"
    # Appended after F, B, I, W so their integer codes (CODE, encoded schedules) stay as they were.
    H = "H"  # head shard forward: logits of the device's vocabulary rows, local max and sum of exponentials
    J = "J"  # head shard input-gradient: after the global softmax statistics; a partial of the head's input gradient
    K = "K"  # head shard weight-gradient: deferrable like W
    E = "E"  # embedding shard lookup: the partial embedding of the device's vocabulary rows
    G = "G"  # embedding shard weight-gradient: after the embedding's output gradient has arrived


class Flow(str, enum.Enum):
    """What crosses a stage boundary: activations go to the next stage, gradients to the previous one."""

    ACT = "act"
    GRAD = "grad"

    @property
    def step(self) -> int:
        """+1 when the flow goes from stage s to s+1, -1 when it goes to s-1."""
        return 1 if self is Flow.ACT else -1


@dataclass(frozen=True, kw_only=True, slots=True)
class KindRule:
    """What an action of one kind on stage s and micro-batch m waits for, hands on and holds."""

    kind: Kind
    noun: str  # how messages name it: "its own forward 3F12"
    receives: Flow | None  # input from stage s - receives.step (none at the pipeline's end it would come from)
    after: Kind | None  # the action of stage s on micro-batch m that must have ended first
    sends: Flow | None  # output to stage s + sends.step (none past the pipeline's end)
    cost: tuple[str, ...]  # per-stage cost fields (fwd, bwd, wgrad) summed for its duration
    activation: int  # +1: the stage's activation of m becomes live; -1: it is freed; 0: unchanged
    phase: str  # every (stage, micro-batch) runs each phase once, in exactly one of its forms
    form: str  # the set of kinds that together run the phase
    # its action finishes the parameter gradients of (s, m): a stage's last such action in a step is where
    # its weight gradients are final (the executor's `last_backward`, a framework's gradient reduction)
    weight_grad: bool
    # Shard kinds of a split layer (None for the stage kinds above): which end of the model the split
    # layer sits at ("output": the LM head, the last layer; "input": the embedding, layer 0). A shard
    # action runs once per shard device, its stage field names the stage that owns the split layer, its
    # costs are the split layer's times the device's share; `receives`/`sends` stay None (the flows
    # below are not stage-to-stage).
    side: str | None = None
    takes: str | None = None  # "owner": waits for the owner stage's hand-over (its F output / its B-I gradient);
    #                           "peers": waits for `peer` of the same micro-batch on every shard device (the statistics)
    peer: "Kind | None" = None
    gives: str | None = None  # "owner": the owner stage's F (input side) or B/I (output side) waits for it on every shard
    # The kinds an action of this kind may run overlapped with, as the first half of a pair on one device (DualPipe's
    # "F of one micro-batch while B of another"; docs/formats.md, "Overlapped pairs"): `3F12+5B7`.
    pairs_with: tuple["Kind", ...] = ()


RULES: Mapping[Kind, KindRule] = MappingProxyType({
    Kind.F: KindRule(kind=Kind.F, noun="forward", receives=Flow.ACT, after=None, sends=Flow.ACT,
                     cost=("fwd",), activation=1, phase="forward", form="forward", weight_grad=False,
                     pairs_with=(Kind.B, Kind.I)),
    # B waits for its stage's own F (autograd needs the saved activation) and the next stage's gradient
    Kind.B: KindRule(kind=Kind.B, noun="backward", receives=Flow.GRAD, after=Kind.F, sends=Flow.GRAD,
                     cost=("bwd", "wgrad"), activation=-1, phase="backward", form="fused",
                     weight_grad=True),
    # I is B without the weight gradient: it keeps the activation, which W still reads
    Kind.I: KindRule(kind=Kind.I, noun="input-gradient", receives=Flow.GRAD, after=Kind.F, sends=Flow.GRAD,
                     cost=("bwd",), activation=0, phase="backward", form="split",
                     weight_grad=False),
    Kind.W: KindRule(kind=Kind.W, noun="weight-gradient", receives=None, after=Kind.I, sends=None,
                     cost=("wgrad",), activation=-1, phase="backward", form="split",
                     weight_grad=True),
    # The LM head split by vocabulary rows: H needs the head's input from the owner stage's F; J needs
    # every shard's statistics (max, sum-exp, target logit) and sends its input-gradient partial to the
    # owner, whose B/I sums them; K, like W, frees the shard's logits.
    # shard kinds' weight_grad is False: a shard's gradients belong to the split layer, not to the owner
    # stage's last backward (the executor's shard runners add them into the shard weights themselves)
    Kind.H: KindRule(kind=Kind.H, noun="head-shard forward", receives=None, after=None, sends=None,
                     cost=("fwd",), activation=1, phase="head-forward", form="shard",
                     side="output", takes="owner", weight_grad=False),
    Kind.J: KindRule(kind=Kind.J, noun="head-shard input-gradient", receives=None, after=Kind.H, sends=None,
                     cost=("bwd",), activation=0, phase="head-backward", form="shard",
                     side="output", takes="peers", peer=Kind.H, gives="owner", weight_grad=False),
    Kind.K: KindRule(kind=Kind.K, noun="head-shard weight-gradient", receives=None, after=Kind.J, sends=None,
                     cost=("wgrad",), activation=-1, phase="head-wgrad", form="shard", side="output", weight_grad=False),
    # The embedding split by vocabulary rows: E looks up the shard's rows (the micro-batch is there at t = 0)
    # and sends its partial to the owner (stage 0), whose F sums them; G needs the owner B/I's input gradient.
    Kind.E: KindRule(kind=Kind.E, noun="embedding-shard lookup", receives=None, after=None, sends=None,
                     cost=("fwd",), activation=1, phase="embedding-forward", form="shard",
                     side="input", gives="owner", weight_grad=False),
    Kind.G: KindRule(kind=Kind.G, noun="embedding-shard weight-gradient", receives=None, after=Kind.E, sends=None,
                     cost=("bwd", "wgrad"), activation=-1, phase="embedding-backward", form="shard",
                     side="input", takes="owner", weight_grad=False),
})


# Integer code of each kind (its position in Kind), for compact encodings of long schedules.
KINDS: tuple[Kind, ...] = tuple(Kind)
CODE: Mapping[Kind, int] = MappingProxyType({k: i for i, k in enumerate(KINDS)})


def forms() -> dict[str, dict[str, tuple[Kind, ...]]]:
    """phase -> form -> the kinds that together run it (e.g. backward: fused (B,) or split (I, W)); stage kinds only."""
    out: dict[str, dict[str, tuple[Kind, ...]]] = {}
    for rule in RULES.values():
        if rule.side is not None:
            continue
        group = out.setdefault(rule.phase, {})
        group[rule.form] = group.get(rule.form, ()) + (rule.kind,)
    return out


def shard_kinds(side: str | None = None) -> tuple[Kind, ...]:
    """The kinds a split layer's shard devices run (of one side, "output" or "input", when given)."""
    return tuple(k for k, r in RULES.items() if r.side is not None and (side is None or r.side == side))


def stage_kinds() -> tuple[Kind, ...]:
    """The kinds of a stage's own actions (F, B, I, W), run on the stage's device."""
    return tuple(k for k, r in RULES.items() if r.side is None)


def receivers(flow: Flow) -> tuple[Kind, ...]:
    """The kinds that consume `flow` from a neighbouring stage (ACT: F; GRAD: B or I)."""
    return tuple(k for k, r in RULES.items() if r.receives is flow)


def senders(flow: Flow) -> tuple[Kind, ...]:
    """The kinds that produce `flow` for a neighbouring stage (ACT: F; GRAD: B or I)."""
    return tuple(k for k, r in RULES.items() if r.sends is flow)


_ACTION_RE = re.compile(r"^\s*(\d+)\s*([A-Z])\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One compute action of a device: run `kind` of `stage` on `microbatch`."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> "Action":
        """Parse `3F12`; raises ValueError naming the text when it does not parse."""
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None or match.group(2) not in Kind.__members__:
            letters = "|".join(k.value for k in Kind)
            raise ValueError(f"action {text!r} does not parse: expected <stage><{letters}><microbatch>, e.g. '3F12'")
        return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))

    @property
    def rule(self) -> KindRule:
        """The table entry of this action's kind."""
        return RULES[self.kind]

    def input_stage(self, num_stages: int) -> int | None:
        """The stage whose output this action consumes, or None (pipeline end, or a kind that receives nothing)."""
        flow = RULES[self.kind].receives
        if flow is None:
            return None
        src = self.stage - flow.step
        return src if 0 <= src < num_stages else None

    def output_stage(self, num_stages: int) -> int | None:
        """The stage this action's output goes to, or None (pipeline end, or a kind that sends nothing)."""
        flow = RULES[self.kind].sends
        if flow is None:
            return None
        dst = self.stage + flow.step
        return dst if 0 <= dst < num_stages else None


def F(stage: int, mb: int) -> Action:
    """Shorthand for a forward action."""
    return Action(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:
    """Shorthand for a fused backward action."""
    return Action(stage, Kind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E741, E743
    """Shorthand for an input-gradient backward action."""
    return Action(stage, Kind.I, mb)


def W(stage: int, mb: int) -> Action:
    """Shorthand for a weight-gradient backward action."""
    return Action(stage, Kind.W, mb)


PAIR_SEP = "+"


def pair_problem(first: Action, second: Action) -> str | None:
    """Why `first+second` cannot be an overlapped pair (None when it can): the kind table's `pairs_with`, and two
    micro-batches (every backward of a micro-batch waits for all its forwards, so one micro-batch's halves depend
    on each other)."""
    allowed = RULES[first.kind].pairs_with
    if second.kind not in allowed:
        firsts = "/".join(k.value for k, r in RULES.items() if r.pairs_with)
        return (f"pair {first}{PAIR_SEP}{second}: a pair is a {firsts} followed by a "
                f"{'/'.join(k.value for k in RULES[Kind.F].pairs_with)} of another micro-batch")
    if first.microbatch == second.microbatch:
        return (f"pair {first}{PAIR_SEP}{second}: both halves are micro-batch {first.microbatch}, and its backward "
                f"depends on its forward; pair halves of two micro-batches")
    return None


def parse_entry(text: str) -> tuple[Action, ...]:
    """One schedule entry: `3F12` (one action) or `3F12+5B7` (an overlapped pair); ValueError names what is wrong."""
    if not isinstance(text, str) or PAIR_SEP not in text:
        return (Action.parse(text),)
    parts = text.split(PAIR_SEP)
    if len(parts) != 2:
        raise ValueError(f"entry {text!r}: a pair has two halves, like '3F12+5B7'")
    first, second = Action.parse(parts[0]), Action.parse(parts[1])
    problem = pair_problem(first, second)
    if problem is not None:
        raise ValueError(problem)
    return first, second


def pair_starts(row, pairs) -> frozenset[int]:
    """Positions in one device's list where an overlapped pair starts (its second half is the next action)."""
    if not pairs:
        return frozenset()
    return _starts(row, {f: b for f, b in pairs})


def pair_positions(schedule, pairs) -> list[frozenset[int]]:
    """`pair_starts` of every device's list (the pairs looked up once)."""
    if not pairs:
        return [frozenset() for _ in schedule]
    firsts = {f: b for f, b in pairs}
    return [_starts(row, firsts) for row in schedule]


def _starts(row, firsts) -> frozenset[int]:
    return frozenset(i for i in range(len(row) - 1) if firsts.get(row[i]) == row[i + 1])


def format_schedule(schedule, pairs=()) -> list[list[str]]:
    """Per-device action lists as strings (the plan file's `schedule`), each overlapped pair as one `3F12+5B7`."""
    out = []
    for dev, starts in zip(schedule, pair_positions(schedule, pairs)):
        row, i = [], 0
        while i < len(dev):
            if i in starts:
                row.append(f"{dev[i]}{PAIR_SEP}{dev[i + 1]}")
                i += 2
            else:
                row.append(str(dev[i]))
                i += 1
        out.append(row)
    return out


def parse_schedule(rows) -> tuple[tuple[Action, ...], ...]:
    """Per-device lists of action strings to a tuple of Action tuples (a pair's halves one after the other)."""
    return tuple(tuple(a for e in dev for a in parse_entry(e)) for dev in rows)


def parse_paired(rows) -> tuple[tuple[tuple[Action, ...], ...], tuple[tuple[Action, Action], ...]]:
    """Per-device entry strings to (schedule, pairs): each `3F12+5B7` gives two adjacent actions and one pair."""
    pairs = []
    for dev in rows:
        for e in dev:
            got = parse_entry(e)
            if len(got) == 2:
                pairs.append(got)
    return parse_schedule(rows), tuple(sorted(pairs))


class PairedSchedule(tuple):
    """A generator's schedule with overlapped pairs: the per-device tuple, plus `pairs` ((first, second) actions,
    adjacent in their device's list) that `schedules.registry.build_plan` moves into `Plan.pairs`."""

    pairs: tuple[tuple[Action, Action], ...] = ()

    def __new__(cls, rows, pairs=()):
        obj = super().__new__(cls, rows)
        obj.pairs = tuple(sorted(pairs))
        return obj


def render_grid(schedule, mark: dict[int, int] | None = None, width: int | None = None) -> str:
    """Draw per-device action lists as a text grid; `mark[d] = i` brackets action i of device d."""
    mark = mark or {}
    pairs = getattr(schedule, "pairs", ())
    cells = []
    for dev, starts in zip(schedule, pair_positions(schedule, pairs)):  # a pair's halves shown as `3F12+` `5B7`
        cells.append([f"{a}{PAIR_SEP}" if i in starts else str(a) for i, a in enumerate(dev)])
    for d, i in mark.items():
        if 0 <= i < len(cells[d]):
            cells[d][i] = f"[{cells[d][i]}]"
    w = max([len(c) for row in cells for c in row] + [3])
    lines = []
    for d, row in enumerate(cells):
        shown = row if width is None else row[:width]
        more = "" if width is None or len(row) <= width else f" ... (+{len(row) - width})"
        lines.append(f"dev{d:<3}| " + " ".join(c.rjust(w) for c in shown) + more)
    return "\n".join(lines)
