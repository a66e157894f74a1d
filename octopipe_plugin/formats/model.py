"""`octopipe-model/1`: the layer sequence with per-layer costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field as dc_field, replace

from .fields import check_format, check_value, field, load_json, objects, write_json
from .memory import SELECTIVE_MODULES
from .. import limits as L
from ..errors import FormatError

MODEL_FORMAT = "octopipe-model/1"

_COST_FIELDS = ("fwd_ms", "bwd_ms", "wgrad_ms")
_BYTE_FIELDS = ("state_bytes", "activation_bytes", "output_bytes")
# Where a layer's figures came from (optional per-layer "source"; absent: not recorded).
SOURCES = ("measured", "analytic")
# What a phase of a layer occupies (docs/formats.md, "Phases"): the device's compute, or the link its communication
# (an expert-parallel all-to-all) runs on, which another action's compute can overlap inside a pair.
RESOURCES = ("compute", "comm")
# Phase times must add up to the layer's: relative slack for the rounding of a written file.
PHASE_SUM_RTOL = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """One sub-layer phase: its resource and its share of the layer's F (`fwd_ms`) and I (`bwd_ms`) time.

    The forward runs a layer's phases in order, the input-gradient backward in reverse order; the layer's
    `wgrad_ms` is one compute phase after them (simulator/pairs.py `stage_phases` is the rule).
    """

    name: str
    resource: str
    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SubmoduleCost:
    """One sub-module of a profiled layer under selective recompute (docs/formats.md "Memory choices"): the
    activation bytes its checkpoint frees and the ms its re-run adds to the backward, as measured."""

    module: str  # a name of formats/memory.py SELECTIVE_MODULES
    freed_bytes: int
    rerun_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    """One partitioning unit: its kind and its costs for one micro-batch (docs/formats.md)."""

    name: str
    kind: str
    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    state_bytes: int
    activation_bytes: int
    output_bytes: int
    # Activation memory when the layer is fully recomputed (input kept only); informational.
    recompute_activation_bytes: int | None = None
    # What a full recompute of the layer adds to its backward, as measured (its forward re-run under the checkpoint,
    # `octopipe profile`); None: its fwd_ms. simulator/costs.py `layer_memory` is the rule that reads both.
    recompute_ms: float | None = None
    # Per sub-module the profile found in the layer, what selective recompute of it frees and re-runs (measured);
    # empty: the analytic model's shares where the model is analytic (costs/recompute.py `module_shares`).
    selective: tuple[SubmoduleCost, ...] = ()
    # "measured" (profiled on a device) or "analytic" (cost model); None when not recorded.
    source: str | None = None
    # The fused backward B's measured time over bwd_ms + wgrad_ms (the split backward's second graph walk and
    # bookkeeping make I + W dearer than B); None: B costs bwd_ms + wgrad_ms. A ratio, so scaling the layer's
    # times keeps B's share (simulator/costs.py `stage_costs` is the rule that reads it).
    fused_ratio: float | None = None
    # Autograd nodes the layer's forward records, and the split W's extra ms per such node of the layers below it
    # in its stage (W walks the retained graph once per parameter group, each walk traversing everything below:
    # profile/measure.py). Both given: simulator/costs.py `stage_costs` charges the walk; None: no such charge.
    graph_nodes: int | None = None
    walk_ms_per_node: float | None = None
    # Sub-layer phases (a MoE layer's attention, dispatch all-to-all, experts, combine all-to-all); their fwd_ms and
    # bwd_ms add up to the layer's. Empty: one compute phase (the layer prices and runs as a whole).
    phases: tuple[Phase, ...] = ()

    def scaled(self, factor: float, **changes) -> "Layer":
        """The layer with every duration (its phases' and its walk's too) times `factor`, plus `changes`."""
        walk = None if self.walk_ms_per_node is None else self.walk_ms_per_node * factor
        phases = tuple(replace(p, fwd_ms=p.fwd_ms * factor, bwd_ms=p.bwd_ms * factor) for p in self.phases)
        rec = None if self.recompute_ms is None else self.recompute_ms * factor
        sel = tuple(replace(c, rerun_ms=c.rerun_ms * factor) for c in self.selective)
        fields = {"fwd_ms": self.fwd_ms * factor, "bwd_ms": self.bwd_ms * factor, "wgrad_ms": self.wgrad_ms * factor,
                  "walk_ms_per_node": walk, "phases": phases, "recompute_ms": rec, "selective": sel}
        return replace(self, **{**fields, **changes})

    @property
    def comm_ms(self) -> tuple[float, float]:
        """(F, I) milliseconds of the layer's communication phases (0, 0 without phases)."""
        comm = [p for p in self.phases if p.resource == "comm"]
        return sum(p.fwd_ms for p in comm), sum(p.bwd_ms for p in comm)

    @property
    def total_ms(self) -> float:
        """F + I + W time of one micro-batch."""
        return self.fwd_ms + self.bwd_ms + self.wgrad_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    """A cost-annotated model: layers in execution order (layer i feeds layer i+1)."""

    name: str
    layers: tuple[Layer, ...]
    # Producer layer indices per layer where the model branches (e.g. encoder -> decoder);
    # empty means a plain chain. Keys and values are layer indices.
    inputs: dict[int, tuple[int, ...]] = dc_field(default_factory=dict)
    meta: dict = dc_field(default_factory=dict)
    # Pairs of layers sharing one weight (a tied embedding and LM head); empty: none (docs/formats.md).
    tied: tuple[tuple[int, int], ...] = ()
    # Device<->host copy rate (GB/s) measured where the layers were profiled (`octopipe profile`); offloads are
    # priced with it where the cluster file gives none (formats/cluster.py `Cluster.host_rate`). None: not measured.
    host_link_gb_per_s: float | None = None

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)


def head_inputs(model: Model) -> int:
    """Hidden states the model's LM head takes: 1 + the `mtp` layers right before a last `lm_head` layer.

    Multi-token prediction (DeepSeek-V3 Sec. 2.2) shares the main model's output head: each MTP
    depth's hidden states go through the same weight, in the `lm_head` layer (docs/formats.md).
    """
    kinds = [layer.kind for layer in model.layers]
    if len(kinds) < 2 or kinds[-1] != "lm_head":
        return 1
    depth = 0
    while depth < len(kinds) - 1 and kinds[-2 - depth] == "mtp":
        depth += 1
    return 1 + depth


def microbatch_tokens(model: Model) -> int:
    """Tokens of one micro-batch, from the model's `meta.arch` (`seq_len` x `micro_batch_size`); 0 when unknown."""
    arch = (model.meta or {}).get("arch") or {}
    return int(arch.get("seq_len", 0)) * int(arch.get("micro_batch_size", 1))


def model_from_dict(data: dict, src: str = "<dict>") -> Model:
    """Build a Model from a parsed `octopipe-model/1` document, refusing bad input."""
    check_format(data, src, "octopipe-model")
    name = field(data, "name", src, "$", str)
    layers = []
    for i, (path, raw) in enumerate(objects(data, "layers", src, maximum=L.MAX_LAYERS)):
        costs = {k: field(raw, k, src, path, float, minimum=0, maximum=L.MAX_LAYER_MS) for k in _COST_FIELDS}
        sizes = {k: field(raw, k, src, path, int, minimum=0, maximum=L.MAX_BYTES) for k in _BYTE_FIELDS}
        rec = field(raw, "recompute_activation_bytes", src, path, int, minimum=0, maximum=L.MAX_BYTES, default=None)
        source = field(raw, "source", src, path, str, default=None)
        fused_ratio = field(raw, "fused_ratio", src, path, float, positive=True, maximum=L.MAX_FUSED_RATIO,
                            default=None)
        nodes = field(raw, "graph_nodes", src, path, int, minimum=0, maximum=L.MAX_GRAPH_NODES, default=None)
        walk = field(raw, "walk_ms_per_node", src, path, float, minimum=0, maximum=L.MAX_LAYER_MS, default=None)
        recompute_ms = field(raw, "recompute_ms", src, path, float, minimum=0, maximum=L.MAX_LAYER_MS, default=None)
        if source is not None and source not in SOURCES:
            raise FormatError(src, f"{path}.source", " or ".join(repr(x) for x in SOURCES), source)
        phases = _read_phases(raw, src, path, costs)
        selective = _read_selective(raw, src, path, sizes["activation_bytes"])
        layers.append(
            Layer(
                name=field(raw, "name", src, path, str, default=f"layer{i}"),
                kind=field(raw, "kind", src, path, str, default="layer"),
                recompute_activation_bytes=rec,
                source=source,
                fused_ratio=fused_ratio,
                graph_nodes=nodes,
                walk_ms_per_node=walk,
                recompute_ms=recompute_ms,
                selective=selective,
                phases=phases,
                **costs,
                **sizes,
            )
        )
    inputs = _read_inputs(data, src, len(layers))
    meta = field(data, "meta", src, "$", dict, default={})
    host = field(data, "host_link_gb_per_s", src, "$", float, positive=True, maximum=L.MAX_BANDWIDTH_GB_PER_S,
                 default=None)
    return Model(name=name, layers=tuple(layers), inputs=inputs, meta=meta, tied=_read_tied(data, src, len(layers)),
                 host_link_gb_per_s=host)


def _read_selective(raw: dict, src: str, path: str, activation: int) -> tuple[SubmoduleCost, ...]:
    """The optional `selective` map of one layer: per sub-module its measured freed bytes and re-run ms."""
    items = field(raw, "selective", src, path, dict, default={})
    out = []
    for module, cost in items.items():
        mpath = f"{path}.selective.{module}"
        if module not in SELECTIVE_MODULES:
            raise FormatError(src, mpath, f"a sub-module of {', '.join(SELECTIVE_MODULES)}", module)
        c = check_value(cost, src, mpath, dict)
        out.append(SubmoduleCost(module=module,
                                 freed_bytes=field(c, "freed_bytes", src, mpath, int, minimum=0, maximum=activation),
                                 rerun_ms=field(c, "rerun_ms", src, mpath, float, minimum=0, maximum=L.MAX_LAYER_MS)))
    return tuple(out)


def _read_phases(raw: dict, src: str, path: str, costs: dict) -> tuple[Phase, ...]:
    """The optional `phases` list of one layer: named phases on a resource whose times add up to the layer's."""
    items = field(raw, "phases", src, path, list, default=[])
    if len(items) > L.MAX_PHASES:
        raise FormatError(src, f"{path}.phases", f"at most {L.MAX_PHASES} phases", f"{len(items)}")
    out = []
    for j, item in enumerate(items):
        ppath = f"{path}.phases[{j}]"
        p = check_value(item, src, ppath, dict)
        resource = field(p, "resource", src, ppath, str)
        if resource not in RESOURCES:
            raise FormatError(src, f"{ppath}.resource", " or ".join(repr(x) for x in RESOURCES), resource)
        out.append(Phase(name=field(p, "name", src, ppath, str, default=f"phase{j}"), resource=resource,
                         fwd_ms=field(p, "fwd_ms", src, ppath, float, minimum=0, maximum=L.MAX_LAYER_MS),
                         bwd_ms=field(p, "bwd_ms", src, ppath, float, minimum=0, maximum=L.MAX_LAYER_MS)))
    for key in ("fwd_ms", "bwd_ms"):
        total = sum(getattr(p, key) for p in out)
        if out and abs(total - costs[key]) > PHASE_SUM_RTOL * max(costs[key], 1e-9):
            raise FormatError(src, f"{path}.phases", f"phases whose {key} add up to the layer's {key}={costs[key]} "
                              f"(fix the phases or the layer's {key})", f"a sum of {total}")
    return tuple(out)


def _read_tied(data: dict, src: str, n: int) -> tuple[tuple[int, int], ...]:
    """The optional `tied` list: pairs of distinct layer indices sharing one weight."""
    raw = field(data, "tied", src, "$", list, default=[])
    out = []
    for j, pair in enumerate(raw):
        path = f"$.tied[{j}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise FormatError(src, path, "a pair [a, b] of layer indices sharing one weight", pair)
        a, b = (check_value(x, src, f"{path}[{k}]", int, minimum=0, maximum=n - 1) for k, x in enumerate(pair))
        if a == b:
            raise FormatError(src, path, "two different layers", pair)
        out.append((min(a, b), max(a, b)))
    return tuple(out)


def _read_inputs(data: dict, src: str, n: int) -> dict[int, tuple[int, ...]]:
    raw = field(data, "inputs", src, "$", dict, default={})
    inputs = {}
    for key, producers in raw.items():
        path = f"$.inputs.{key}"
        if not str(key).isdigit() or int(key) >= n:
            raise FormatError(src, path, f"a layer index in 0..{n - 1} as key", key)
        check_value(producers, src, path, list)
        for j, p in enumerate(producers):
            check_value(p, src, f"{path}[{j}]", int, minimum=0)
            if p >= int(key):
                raise FormatError(src, f"{path}[{j}]", f"a producer before layer {key} (layers are in execution order)", p)
        inputs[int(key)] = tuple(producers)
    return inputs


def model_to_dict(model: Model) -> dict:
    """Serialise a Model as an `octopipe-model/1` document."""
    layers = []
    for layer in model.layers:
        d = asdict(layer)
        for optional in ("recompute_activation_bytes", "source", "fused_ratio", "graph_nodes", "walk_ms_per_node",
                         "recompute_ms"):
            if d[optional] is None:
                del d[optional]
        if d["selective"]:
            d["selective"] = {c.module: {"freed_bytes": c.freed_bytes, "rerun_ms": c.rerun_ms}
                              for c in layer.selective}
        else:
            del d["selective"]
        if d["phases"]:
            d["phases"] = [dict(p) for p in d["phases"]]
        else:
            del d["phases"]
        layers.append(d)
    doc = {"format": MODEL_FORMAT, "name": model.name, "layers": layers}
    if model.inputs:
        doc["inputs"] = {str(k): list(v) for k, v in model.inputs.items()}
    if model.meta:
        doc["meta"] = model.meta
    if model.tied:
        doc["tied"] = [list(p) for p in model.tied]
    if model.host_link_gb_per_s is not None:
        doc["host_link_gb_per_s"] = model.host_link_gb_per_s
    return doc


def read_model(source) -> Model:
    """Read an `octopipe-model/1` file (JSON or YAML) or dict."""
    data, src = load_json(source)
    return model_from_dict(data, src)


def write_model(model: Model, path) -> None:
    """Write a Model as `octopipe-model/1` JSON."""
    write_json(model_to_dict(model), path)
