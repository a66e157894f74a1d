"""Bind a plan to the model and cluster it was made for, and check that binding before a plan is used.

A plan's stage ranges and predictions only mean something for the model (layer names, kinds,
costs) and the cluster (devices, memory, links) it was tuned on. `bind_plan` records both in
`plan.meta["fingerprint"]`; `check_plan_binding` compares them with what a command or adapter
is about to use: another model is refused, a cost-only change (another GPU, sequence length,
tp...) is a warning that names the difference, a device-count mismatch is refused naming both
counts, and devices whose stages hold no layers are reported. Plans written before
fingerprints existed stay loadable (a warning says what could not be checked).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from ..errors import PlanError
from .ranges import stage_range_problem

FINGERPRINT_KEY = "fingerprint"  # key of plan.meta
_COST_FIELDS = ("fwd_ms", "bwd_ms", "wgrad_ms")
_BYTE_FIELDS = ("state_bytes", "activation_bytes", "output_bytes")
_GIB = 2**30


def _digest(items) -> str:
    """Short stable hash of a JSON-serialisable value."""
    text = json.dumps(items, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _gpu_of(model) -> str | None:
    meta = model.meta if isinstance(model.meta, dict) else {}
    gpu = meta.get("gpu")
    return gpu if isinstance(gpu, str) else None


def layer_kinds_text(kinds) -> str:
    """Layer kinds in order, runs collapsed: 'embedding dense*2 moe*22 mtp lm_head'."""
    out: list[list] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return " ".join(k if n == 1 else f"{k}*{n}" for k, n in out)


def layer_kinds_of(text: str) -> list[str]:
    """The kinds list back from `layer_kinds_text`."""
    out = []
    for part in text.split():
        kind, _, count = part.partition("*")
        out += [kind] * (int(count) if count else 1)
    return out


def model_fingerprint(model) -> dict:
    """Name, layer count, digests of the layer names/kinds/branches and of the costs, the kinds, cost totals.

    `kinds` (the kinds in order, readable) lets a framework adapter compare a plan with a model whose
    layer names follow another convention (Megatron's module paths against the zoo's)."""
    structure = [[layer.name, layer.kind] for layer in model.layers]
    branches = sorted((int(k), list(v)) for k, v in model.inputs.items())
    # 9 significant digits: the same model rebuilt or re-read from JSON hashes alike, any real change differs
    costs = [[f"{getattr(layer, f):.9g}" for f in _COST_FIELDS] + [getattr(layer, f) for f in _BYTE_FIELDS]
             for layer in model.layers]
    totals = {f: sum(getattr(layer, f) for layer in model.layers) for f in _COST_FIELDS + _BYTE_FIELDS}
    return {"name": model.name, "num_layers": model.num_layers, "structure": _digest([structure, branches]),
            "kinds": layer_kinds_text(layer.kind for layer in model.layers),
            "costs": _digest(costs), "gpu": _gpu_of(model), "totals": totals}


def cluster_fingerprint(cluster) -> dict:
    """Name, GPU, device count, devices per node, memory and links of a cluster."""
    def link(lk) -> dict:
        return {"bandwidth_gb_per_s": lk.bandwidth_gb_per_s, "latency_us": lk.latency_us}

    return {"name": cluster.name, "gpu": getattr(cluster, "gpu", None), "num_devices": cluster.num_devices,
            "devices_per_node": cluster.devices_per_node, "memory_bytes": cluster.memory_bytes,
            "intra_node": link(cluster.intra_node), "inter_node": link(cluster.inter_node)}


def bind_plan(plan, model, cluster=None):
    """The plan with the fingerprints of `model` (and `cluster`, when given) in `meta["fingerprint"]`."""
    fp = {"model": model_fingerprint(model)}
    if cluster is not None:
        fp["cluster"] = cluster_fingerprint(cluster)
    return replace(plan, model=model.name, meta={**plan.meta, FINGERPRINT_KEY: fp})


def idle_devices(plan) -> list[int]:
    """Devices that hold no stage, or only stages without layers: they compute nothing."""
    busy = {st.device for st in plan.stages if st.end > st.start}
    return [d for d in range(plan.num_devices) if d not in busy]


def describe_devices(devices: list[int]) -> str:
    """'3, 5 and 7' or, for runs, '34..999' ranges joined by commas."""
    runs, start = [], None
    for i, d in enumerate(devices):
        if start is None:
            start = d
        if i + 1 == len(devices) or devices[i + 1] != d + 1:
            runs.append(f"{start}" if start == d else f"{start}..{d}")
            start = None
    return ", ".join(runs)


def check_plan_binding(plan, model, cluster=None, *, source: str = "the plan",
                       model_source: str | None = None, cluster_source: str | None = None) -> list[str]:
    """Refuse (PlanError) a plan made for another model or device count; return warnings for the rest.

    Refused: another model (name or layer names/kinds differ), a layer count that differs, a
    device count that differs from the cluster's. Warned: the same layers with other costs (the
    difference is named), another cluster of the same size, a plan without a fingerprint, and
    devices left without layers. `source`, `model_source` and `cluster_source` name where each came
    from (a file, an option) in the messages.
    """
    model_src = model_source or f"model {model.name!r}"
    warnings = []
    problem = stage_range_problem([(st.start, st.end) for st in plan.stages], model.num_layers)
    if plan.stages and problem is not None:
        raise PlanError(f"{source}: {problem.message} ({model_src}): the plan was made for another model; make one "
                        f"for this model with `octopipe plan`")
    fp = plan.meta.get(FINGERPRINT_KEY) if isinstance(plan.meta, dict) else None
    if isinstance(fp, dict) and isinstance(fp.get("model"), dict):
        warnings += _check_model(fp["model"], model, source, model_src)
    else:
        note = (f"{source} has no fingerprint of its model (written by an older OctoPipe): only its layer count "
                f"({model.num_layers}) could be checked against {model_src}")
        if plan.model and plan.model != model.name:
            note += f"; it names model {plan.model!r}"
        warnings.append(note + "; write it again with `octopipe simulate --plan ... --save-plan` to bind it")
    if cluster is not None:
        cl_src = cluster_source or f"cluster {cluster.name}"
        if plan.num_devices != cluster.num_devices:
            raise PlanError(f"{source} is for {plan.num_devices} devices but {cl_src} has {cluster.num_devices}: "
                            f"use a cluster of {plan.num_devices} devices (e.g. "
                            f"{(getattr(cluster, 'gpu', None) or 'h100').split('-')[0].lower()}x{plan.num_devices})"
                            f" or make a plan for this one with `octopipe plan`")
        if isinstance(fp, dict) and isinstance(fp.get("cluster"), dict):
            diff = _cluster_difference(fp["cluster"], cluster_fingerprint(cluster))
            if diff:
                warnings.append(f"{source} was made for cluster {fp['cluster'].get('name')!r}, {cl_src} differs: "
                                f"{diff}; its predictions may not hold (re-tune with `octopipe plan`)")
    idle = idle_devices(plan)
    if idle:
        warnings.append(f"{source}: {len(idle)} of {plan.num_devices} devices hold no layers "
                        f"(device{'s' if len(idle) > 1 else ''} {describe_devices(idle)}) and compute nothing")
    return warnings


def _check_model(recorded: dict, model, source: str, model_src: str) -> list[str]:
    now = model_fingerprint(model)
    same_layers = recorded.get("structure") == now["structure"] and recorded.get("num_layers") == now["num_layers"]
    same_costs = recorded.get("costs") == now["costs"]
    was = f"model {recorded.get('name')!r} ({recorded.get('num_layers')} layers)"
    if not same_layers:
        raise PlanError(f"{source} was made for {was}, not {model_src}: their layer names or kinds differ; "
                        f"make a plan for this model with `octopipe plan --model {model.name} ...`")
    if recorded.get("name") != now["name"]:
        if not same_costs:
            raise PlanError(f"{source} was made for {was}, not {model_src}: same layer names and kinds, other "
                            f"costs ({_cost_difference(recorded, now)}); make a plan for this model with "
                            f"`octopipe plan --model {model.name} ...`")
        return [f"{source} was made for {was}; {model_src} has the same layers and costs under another name"]
    if not same_costs:
        return [f"{source} was made for {model.name} with other costs ({_cost_difference(recorded, now)}); "
                f"its stage split and predictions may no longer be the best: re-tune with `octopipe plan`"]
    return []


def cost_difference(recorded: dict, model) -> str | None:
    """What differs between a recorded model fingerprint's costs and `model`'s (None: the same costs)."""
    now = model_fingerprint(model)
    return None if recorded.get("costs") == now["costs"] else _cost_difference(recorded, now)


def _cost_difference(old: dict, new: dict) -> str:
    parts = []
    if old.get("gpu") != new.get("gpu"):
        parts.append(f"GPU {old.get('gpu') or 'unrecorded'} -> {new.get('gpu') or 'unrecorded'}")
    a, b = old.get("totals") or {}, new.get("totals") or {}
    ms_a = sum(float(a.get(f, 0.0)) for f in _COST_FIELDS)
    ms_b = sum(float(b.get(f, 0.0)) for f in _COST_FIELDS)
    if abs(ms_a - ms_b) > 1e-9 * max(ms_a, ms_b, 1.0):
        ratio = f", x{ms_b / ms_a:.3g}" if ms_a > 0 else ""
        parts.append(f"F+I+W of all layers {ms_a:.4g} -> {ms_b:.4g} ms{ratio}")
    for f in _BYTE_FIELDS:
        if a.get(f) != b.get(f) and a.get(f) is not None:
            parts.append(f"{f.replace('_bytes', '')} {a[f] / _GIB:.3g} -> {b[f] / _GIB:.3g} GiB")
    return "; ".join(parts) or "per-layer costs moved between layers"


def _cluster_difference(old: dict, new: dict) -> str:
    parts = []
    for key, label in (("gpu", "GPU"), ("devices_per_node", "devices per node")):
        if old.get(key) != new.get(key):
            parts.append(f"{label} {old.get(key)} -> {new.get(key)}")
    if old.get("memory_bytes") != new.get("memory_bytes") and isinstance(old.get("memory_bytes"), int):
        parts.append(f"memory {old['memory_bytes'] / _GIB:.3g} -> {new['memory_bytes'] / _GIB:.3g} GiB")
    for key in ("intra_node", "inter_node"):
        if old.get(key) != new.get(key):
            parts.append(f"{key.replace('_', '-')} link {_link(old.get(key))} -> {_link(new.get(key))}")
    return ", ".join(parts)


def _link(lk) -> str:
    if not isinstance(lk, dict):
        return "unrecorded"
    return f"{lk.get('bandwidth_gb_per_s')} GB/s {lk.get('latency_us')} us"
