"""Per-stage costs of a plan, folded once from the model's layers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage F/I/W time, activation bytes, output bytes, and per-device static state."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    activation: tuple[int, ...]
    output: tuple[int, ...]
    state: tuple[int, ...]  # per stage

    def device_state(self, stages, num_devices: int) -> list[int]:
        """Static bytes of each device: the state of every layer it owns."""
        out = [0] * num_devices
        for s, st in enumerate(stages):
            out[st.device] += self.state[s]
        return out


def stage_costs(model, stages) -> StageCosts:
    """Sum layer costs over each stage's range; an empty stage forwards its input unchanged."""
    layers = model.layers
    cut = _cut_bytes(model)
    fwd, bwd, wgrad, act, out, state = [], [], [], [], [], []
    for st in stages:
        chunk = layers[st.start:st.end]
        fwd.append(sum(l.fwd_ms for l in chunk))
        bwd.append(sum(l.bwd_ms for l in chunk))
        wgrad.append(sum(l.wgrad_ms for l in chunk))
        act.append(sum(l.activation_bytes for l in chunk))
        state.append(sum(l.state_bytes for l in chunk))
        if cut is not None:
            out.append(cut[st.end])
        else:
            last = st.end - 1 if st.end > st.start else st.start - 1
            out.append(layers[last].output_bytes if last >= 0 else 0)
    return StageCosts(tuple(fwd), tuple(bwd), tuple(wgrad), tuple(act), tuple(out), tuple(state))


def _cut_bytes(model) -> list[int] | None:
    """Bytes crossing a boundary before each layer when the model branches (None for a chain).

    A cut inside a branch (e.g. between a vision encoder and the decoder) carries every
    still-needed producer output, not only the last layer's.
    """
    if not model.inputs:
        return None
    from ..graph import boundary_bytes  # networkx is imported only for branched models

    return boundary_bytes(model)
