"""Overlapped pairs: the phase sequences of a stage's F, I and B, and the one rule that prices two of them overlapped.

A pair `3F12+5B7` runs on one device as one unit (docs/formats.md, "Overlapped pairs"): it starts
when the device is free and both halves' inputs are there, and both halves end together. Inside
it the two halves' phases interleave as DualPipe runs them: each half runs its own phases in
order; compute phases share the device, communication phases the link; whichever phase can
start first goes first (the forward half on a tie). A half's communication so runs while the
other half computes. Layers without phases are one compute phase, so a pair of them costs
exactly its two actions one after the other: pairs change nothing where nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import Kind

# One phase of a sequence: (on the link, milliseconds); consecutive phases on one resource are merged.
PhaseSeq = tuple[tuple[bool, float], ...]


@dataclass(frozen=True, slots=True)
class StagePhases:
    """Per stage, the phase sequence of its F, its I and its fused B (B: I's phases with each layer's W after it)."""

    fwd: tuple[PhaseSeq, ...]
    bwd: tuple[PhaseSeq, ...]
    fused: tuple[PhaseSeq, ...]

    def of(self, kind: Kind, stage: int) -> PhaseSeq:
        """The sequence an action of `kind` on `stage` runs (F, I or B)."""
        return {Kind.F: self.fwd, Kind.I: self.bwd, Kind.B: self.fused}[kind][stage]


def _merged(parts) -> PhaseSeq:
    out: list[tuple[bool, float]] = []
    for comm, ms in parts:
        if ms <= 0.0:
            continue
        if out and out[-1][0] == comm:
            out[-1] = (comm, out[-1][1] + ms)
        else:
            out.append((comm, ms))
    return tuple(out)


def _layer_fwd(layer):
    if not layer.phases:
        return [(False, layer.fwd_ms)]
    return [(p.resource == "comm", p.fwd_ms) for p in layer.phases]


def _layer_bwd(layer, with_wgrad: bool):
    parts = [(False, layer.bwd_ms)] if not layer.phases else [(p.resource == "comm", p.bwd_ms)
                                                              for p in reversed(layer.phases)]
    return parts + ([(False, layer.wgrad_ms)] if with_wgrad else [])


def stage_phases(model, stages) -> StagePhases | None:
    """The phase sequences of every stage's F, I and B; None when no layer of `model` has a communication phase."""
    if not communicates(model):
        return None
    fwd, bwd, fused = [], [], []
    for st in stages:
        chunk = model.layers[st.start:st.end]
        fwd.append(_merged(x for layer in chunk for x in _layer_fwd(layer)))
        bwd.append(_merged(x for layer in reversed(chunk) for x in _layer_bwd(layer, False)))
        fused.append(_merged(x for layer in reversed(chunk) for x in _layer_bwd(layer, True)))
    return StagePhases(tuple(fwd), tuple(bwd), tuple(fused))


def overlap_ms(first: PhaseSeq, second: PhaseSeq) -> float:
    """The reference time of two phase sequences overlapped (module docstring): a list schedule on two resources."""
    return overlap_order(first, second)[1]


def overlap_order(first: PhaseSeq, second: PhaseSeq) -> tuple[list[int], float]:
    """(the half, 0 or 1, of every phase in the order the overlap rule starts them; the pair's time): the one list
    schedule `overlap_ms` prices and the executor's phased runtime and stand-ins follow."""
    seqs = (first, second)
    pos = [0, 0]
    ready = [0.0, 0.0]
    free = {False: 0.0, True: 0.0}
    order: list[int] = []
    while True:
        best = None
        for k in (0, 1):
            if pos[k] < len(seqs[k]):
                comm, ms = seqs[k][pos[k]]
                start = max(ready[k], free[comm])
                if best is None or start < best[0]:  # strict: the first half wins a tie
                    best = (start, k, comm, ms)
        if best is None:
            return order, max(ready)
        start, k, comm, ms = best
        free[comm] = ready[k] = start + ms
        pos[k] += 1
        order.append(k)


def hidden_ms(phases: StagePhases | None, first, second) -> float:
    """What overlapping `first` with `second` saves against running them one after the other (0 without phases)."""
    if phases is None:
        return 0.0
    a, b = phases.of(first.kind, first.stage), phases.of(second.kind, second.stage)
    return max(0.0, sum(ms for _, ms in a) + sum(ms for _, ms in b) - overlap_ms(a, b))


def pair_ms(phases: StagePhases | None, first, second, first_ms: float, second_ms: float) -> float:
    """The time of the pair `first+second` whose halves alone take `first_ms` and `second_ms` (host overheads and
    all): their sum less what overlapping them hides. The one rule the simulators and the shard inserter charge."""
    return first_ms + second_ms - hidden_ms(phases, first, second)


def communicates(model) -> bool:
    """Whether some layer of `model` has a communication phase (only then can a pair hide anything)."""
    return model is not None and any(p.resource == "comm" for layer in model.layers for p in layer.phases)
