"""Per-stage costs of a plan, folded once from the model's layers."""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import RULES, Kind


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage F/I/W time (and B's where it was measured), activation bytes, output bytes, per-stage state."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    activation: tuple[int, ...]
    output: tuple[int, ...]
    state: tuple[int, ...]  # per stage
    # per stage the fused backward B's time where some layer measured it (Layer.fused_ratio); None: B = bwd + wgrad
    fused: tuple[float, ...] | None = None

    def device_state(self, stages, num_devices: int) -> list[int]:
        """Static bytes of each device: the state of every layer it owns."""
        out = [0] * num_devices
        for s, st in enumerate(stages):
            out[st.device] += self.state[s]
        return out


def kind_durations(costs, extra: dict | None = None) -> dict[Kind, tuple[float, ...]]:
    """Per kind, each stage's action time: the table's cost fields summed (B = bwd + wgrad, I = bwd...).

    `costs` is anything with per-stage `fwd`, `bwd` and `wgrad` tuples (StageCosts, the tuner's Job);
    where it also has `fused` (not None) the fused backward B costs that instead (measured B: `stage_costs`).
    `extra` (simulator/overheads.py `overhead_ms`) adds each kind's host overhead per stage.
    """
    fused = getattr(costs, "fused", None)
    out = {}
    for kind, rule in RULES.items():
        fields = [getattr(costs, name) for name in rule.cost]
        if kind is Kind.B and fused is not None:
            fields = [fused]
        if rule.side is not None:  # a shard kind costs its share of the split layer (simulator/split.py), not the stage
            fields = [tuple(0.0 for _ in fields[0])]
        if extra is not None and rule.side is None:
            fields = fields + [extra[kind]]
        out[kind] = tuple(sum(vals) for vals in zip(*fields))
    return out


def hop_times(cluster, devices, output, launch_ms: float = 0.0, delivery=None) -> tuple[float | None, ...]:
    """Time to move stage s's output to stage s+1 (and its gradient back), for every boundary s.

    The one transfer-time rule: the cluster's link time for the boundary's bytes plus the in-flight
    costs — the fixed per-message launch cost and, where measured overheads are charged, the busy
    sender's delivery delay (`delivery`, a formats.overheads.MessageCost of the boundary's bytes;
    every cross-device hop pays it, docs/formats.md "Host overheads" says why). None where both
    stages share a device (nothing is sent, the tensor is handed over in memory). The tuner plans
    and the simulator judges with it.
    """
    return tuple(
        None if devices[s] == devices[s + 1] else cluster.transfer_ms(devices[s], devices[s + 1], output[s]) +
        in_flight_ms(launch_ms, delivery, output[s])
        for s in range(len(devices) - 1)
    )


def in_flight_ms(launch_ms: float, delivery, nbytes: float) -> float:
    """A cross-device message's in-flight cost beyond its link time: launch plus the busy sender's delivery delay."""
    return launch_ms + (delivery.ms(nbytes) if delivery is not None else 0.0)


def stage_costs(model, stages) -> StageCosts:
    """Sum layer costs over each stage's range; an empty stage forwards its input unchanged.

    The one rule for B's cost: a layer's `fused_ratio` (measured B over its I + W) scales its share of its
    stage's B; without one anywhere, B is bwd + wgrad (no `fused` tuple).
    """
    layers = model.layers
    cut = _cut_bytes(model)
    fwd, bwd, wgrad, act, out, state = [], [], [], [], [], []
    measured_b = any(l.fused_ratio is not None for l in layers)
    fused, walks = [], []
    for st in stages:
        chunk = layers[st.start:st.end]
        fwd.append(sum(l.fwd_ms for l in chunk))
        bwd.append(sum(l.bwd_ms for l in chunk))
        walks.append(walk_ms(chunk))  # W only: a fused B is one walk
        wgrad.append(sum(l.wgrad_ms for l in chunk) + walks[-1])
        # B as measured where a layer measured it (the executor's fused backward is cheaper than its I + W)
        fused.append(sum((l.bwd_ms + l.wgrad_ms) * (l.fused_ratio if l.fused_ratio is not None else 1.0)
                         for l in chunk))
        act.append(sum(l.activation_bytes for l in chunk))
        state.append(sum(l.state_bytes for l in chunk))
        if cut is not None:
            out.append(cut[st.end])
        else:
            last = st.end - 1 if st.end > st.start else st.start - 1
            out.append(layers[last].output_bytes if last >= 0 else 0)
    return StageCosts(tuple(fwd), tuple(bwd), tuple(wgrad), tuple(act), tuple(out), tuple(state),
                      fused=tuple(fused) if measured_b or any(walks) else None)


def walk_ms(chunk) -> float:
    """The split W's graph walks over one stage's layers (ms): each layer's `walk_ms_per_node` times the
    `graph_nodes` of the stage's layers below it (its walks traverse them; a stage's input is cut from the
    producer's graph, so nothing below the stage counts). Layers without the figures add nothing."""
    total, below = 0.0, 0
    for l in chunk:
        if l.walk_ms_per_node is not None:
            total += l.walk_ms_per_node * below
        below += l.graph_nodes or 0
    return total


def _cut_bytes(model) -> list[int] | None:
    """Bytes crossing a boundary before each layer when the model branches (None for a chain).

    A cut inside a branch (e.g. between a vision encoder and the decoder) carries every
    still-needed producer output, not only the last layer's.
    """
    if not model.inputs:
        return None
    from ..graph import boundary_bytes  # networkx is imported only for branched models

    return boundary_bytes(model)
