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


@dataclass(frozen=True, slots=True)
class MemoryCosts:
    """Per stage, what a plan's memory choices (Plan.memory; docs/formats.md "Memory choices") change.

    `kept`: bytes F makes live (the stage's activation less what recompute frees; offloaded bytes included, they
    leave when their copy-out ends); `extra_ms`: the recomputed forwards, added to the stage's I and B;
    `remat_b` / `remat_i`: bytes recompute brings back when a B / an I starts (B one layer at a time: the largest;
    I every recomputed layer, which W still reads: the sum), freed with the rest; `offload`: bytes copied to the
    host after F and back before the backward, each way `copy_ms` on the device's host link; `offload_w`: bytes
    (of `kept`) copied to the host after I and back before W (`offload_w` layers), each way `copy_w_ms`.
    """

    kept: tuple[int, ...]
    extra_ms: tuple[float, ...]
    remat_b: tuple[int, ...]
    remat_i: tuple[int, ...]
    offload: tuple[int, ...]
    copy_ms: tuple[float, ...]
    offload_w: tuple[int, ...] = ()
    copy_w_ms: tuple[float, ...] = ()

    def apply(self, sc: StageCosts) -> StageCosts:
        """The stage costs the simulator's loop runs: F keeps `kept`, I and B also run the recomputed forwards."""
        fused = None if sc.fused is None else tuple(f + x for f, x in zip(sc.fused, self.extra_ms))
        return StageCosts(sc.fwd, tuple(b + x for b, x in zip(sc.bwd, self.extra_ms)), sc.wgrad, self.kept,
                          sc.output, sc.state, fused=fused)


def layer_memory(model, layer: int, choice, where: str = "plan") -> tuple[int, float, int, int]:
    """(bytes F keeps, recomputed-forward ms, bytes recompute brings back in the backward, bytes offloaded) of one
    layer under `choice` (formats/memory.py); PlanError in one line where the choice does not fit the layer."""
    from ..errors import PlanError
    from ..formats.memory import OFFLOAD, OFFLOAD_W, RECOMPUTE, SELECTIVE

    lay = model.layers[layer]
    act = lay.activation_bytes
    path = f"{where} $.memory.{layer}"
    if choice.kind == OFFLOAD:
        return act, 0.0, 0, act
    if choice.kind == OFFLOAD_W:  # kept from F to I like a kept layer; memory_costs counts its I->W copies
        return act, 0.0, 0, 0
    arch = _analytic_arch(model)
    if arch is not None and arch.recompute:
        from ..costs.analytic import RECOMPUTED_KINDS

        if lay.kind in RECOMPUTED_KINDS:
            raise PlanError(f"{path}: {choice.text} on layer {layer} ({lay.kind}), which the model already costs "
                            f"fully recomputed (its arch has recompute: true); fix: cost the model without "
                            f"recompute, or drop the entry")
    if choice.kind == RECOMPUTE:
        rec = lay.recompute_activation_bytes
        if rec is None:  # the layer's input: what the previous layer sends on (layer 0 keeps what it saves)
            rec = model.layers[layer - 1].output_bytes if layer > 0 else act
        rec = min(rec, act)
        # a profiled re-run (Layer.recompute_ms) takes precedence over the forward's time
        return rec, lay.fwd_ms if lay.recompute_ms is None else lay.recompute_ms, act - rec, 0
    assert choice.kind == SELECTIVE
    if lay.selective:  # profiled sub-modules take precedence over the analytic shares; a set sums its modules'
        measured = {c.module: c for c in lay.selective}
        missing = [m for m in choice.modules if m not in measured]
        if missing:
            raise PlanError(f"{path}: selective:{','.join(missing)} on layer {layer} ({lay.kind}), whose profile "
                            f"measured no {', '.join(missing)}; expected modules it measured: "
                            f"{', '.join(sorted(measured))}; fix: name those, or use recompute or offload")
        freed = min(act, sum(measured[m].freed_bytes for m in choice.modules))
        return act - freed, sum(measured[m].rerun_ms for m in choice.modules), freed, 0
    shares = _selective_shares(model, layer, path, choice)
    freed = min(act, int(round(sum(shares[m].freed for m in choice.modules) * act)))
    rerun = sum(shares[m].rerun for m in choice.modules) * lay.fwd_ms
    return act - freed, rerun, freed, 0


def selective_modules(model, layer: int) -> tuple[str, ...]:
    """The sub-modules selective recompute may name on a layer (what `layer_memory` prices): those its profile
    measured, else its kind's in the analytic model (an analytic layer of an analytic model), else none."""
    lay = model.layers[layer]
    if lay.selective:
        return tuple(sorted(c.module for c in lay.selective))
    arch = _analytic_arch(model)
    if arch is None or lay.source == "measured":
        return ()
    from ..costs.recompute import module_shares
    from ..gpus import get_gpu

    return tuple(sorted(module_shares(arch, lay.kind, get_gpu(model.meta.get("gpu", "H100")))))


def _analytic_arch(model):
    """The architecture of an analytic model (its meta), None for a profiled or hand-written one."""
    meta = model.meta if isinstance(model.meta, dict) else {}
    if meta.get("cost_model") != "analytic":
        return None
    from ..costs.recompute import arch_of

    return arch_of(meta)


def _selective_shares(model, layer: int, path: str, choice):
    from ..errors import PlanError

    lay = model.layers[layer]
    arch = _analytic_arch(model)
    if arch is None or lay.source == "measured":
        raise PlanError(f"{path}: {choice.text} on layer {layer} ({lay.kind}): what a sub-module frees and re-runs "
                        f"is known for analytic layers and for profiled ones with sub-module figures only (this "
                        f"layer is {'measured, without them' if lay.source == 'measured' else 'not from the analytic model'}"
                        f"); fix: use recompute or offload, or profile it again (`octopipe profile` measures them)")
    from ..costs.recompute import module_shares
    from ..gpus import get_gpu

    shares = module_shares(arch, lay.kind, get_gpu(model.meta.get("gpu", "H100")))
    missing = [m for m in choice.modules if m not in shares]
    if missing:
        has = ", ".join(sorted(shares)) if shares else "none (use recompute or offload)"
        raise PlanError(f"{path}: selective:{','.join(missing)} on layer {layer}, whose kind {lay.kind!r} has no "
                        f"{', '.join(missing)}; expected modules of {lay.kind!r}: {has}; fix: name those")
    return shares


def memory_costs(model, plan, cluster=None, where: str = "plan") -> MemoryCosts:
    """Per-stage MemoryCosts of `plan.memory` (refusing, in one line, a choice the model's layer cannot take, and an
    offload the cluster's host memory cannot hold: counted in each device's list order, from F to the backward)."""
    from ..errors import PlanError
    from ..formats.memory import OFFLOAD_W, memory_problem

    problem = memory_problem(plan.memory, model.num_layers)
    if problem is not None:
        raise PlanError(problem)
    per_layer = {layer: layer_memory(model, layer, choice, where) for layer, choice in plan.memory}
    w_layers = {layer for layer, choice in plan.memory if choice.kind == OFFLOAD_W}
    kept, extra, remat_b, remat_i, off, copy, off_w, copy_w = [], [], [], [], [], [], [], []
    rate = getattr(model, "host_link_gb_per_s", None)  # a profiled copy rate (Cluster.host_rate says which counts)
    for st in plan.stages:
        k = x = rb = ri = o = ow = 0
        for i in range(st.start, st.end):
            lay = model.layers[i]
            got = per_layer.get(i)
            if got is None:
                k += lay.activation_bytes
                continue
            k += got[0]
            x += got[1]
            rb = max(rb, got[2])
            ri += got[2]
            o += got[3]
            ow += got[0] if i in w_layers else 0
        kept.append(k)
        extra.append(float(x))
        remat_b.append(rb)
        remat_i.append(ri)
        off.append(o)
        copy.append(cluster.host_copy_ms(o, rate) if cluster is not None and o else 0.0)
        off_w.append(ow)
        copy_w.append(cluster.host_copy_ms(ow, rate) if cluster is not None and ow else 0.0)
    mc = MemoryCosts(tuple(kept), tuple(extra), tuple(remat_b), tuple(remat_i), tuple(off), tuple(copy),
                     tuple(off_w), tuple(copy_w))
    if cluster is not None and (any(off) or any(off_w)):
        _check_host_memory(plan, mc, cluster, where)
    return mc


def host_bytes_bound(plan, offload, offload_w=None) -> list[int]:
    """Per device, the most offloaded bytes its list order can hold at once: a micro-batch's from its F to its B
    or I (the host holds them within that span: copy-out after F, copy-in done before the backward), and its
    `offload_w` bytes from its I to its W."""
    from ..actions import Kind

    out = []
    for row in plan.schedule:
        cur = peak = 0
        for a in row:
            if a.kind is Kind.F:
                cur += offload[a.stage]
            elif a.kind in (Kind.B, Kind.I):
                cur -= offload[a.stage]
                if a.kind is Kind.I and offload_w:
                    cur += offload_w[a.stage]
            elif a.kind is Kind.W and offload_w:
                cur -= offload_w[a.stage]
            peak = max(peak, cur)
        out.append(peak)
    return out


def _check_host_memory(plan, mc: MemoryCosts, cluster, where: str) -> None:
    from ..errors import PlanError

    gib = float(1 << 30)
    for d, got in enumerate(host_bytes_bound(plan, mc.offload, mc.offload_w)):
        if got > cluster.host_memory:
            layers = [layer for layer, c in plan.memory if c.kind in ("offload", "offload_w")
                      and plan.stages[_stage_of(plan, layer)].device == d]
            raise PlanError(f"{where} $.memory: device {d} holds up to {got / gib:.3g} GiB offloaded (layers "
                            f"{', '.join(map(str, layers))}), over its host memory of {cluster.host_memory / gib:.3g} "
                            f"GiB (cluster host_memory_bytes); fix: offload fewer layers or raise host_memory_bytes")


def _stage_of(plan, layer: int) -> int:
    return next(s for s, st in enumerate(plan.stages) if st.start <= layer < st.end)
