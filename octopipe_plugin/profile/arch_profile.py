"""Profile a whole architecture: each distinct layer kind built by an implementation, the rest analytic.

`builders` maps a kind to a module factory (plain torch: torch_layers.builders; Megatron:
adapters/megatron/profile.py). Kinds without a builder (e.g. Mamba where its kernels are not
installed) take the analytic model's figures, scaled on a device outside the GPU table by the
measured / analytic ratio of the kinds that were measured, and are marked `"source": "analytic"`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, replace
from typing import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from ..costs.analytic import layer_cost
from ..costs.arch import Arch, layer_plan
from ..errors import OctoPipeError
from ..formats.model import Layer, Model
from .device import gpu_spec_for, resolve_device
from .layer import ProfileLayer
from .profiler import ProfileResult, ProfileSettings, ProfileStats, profile_layers, profiled_host_link
from .torch_layers import hidden_input, token_input

log = logging.getLogger(__name__)

# Arch fields that do not change one layer of a kind: a model with more layers reuses the cache.
_NOT_PER_LAYER = ("name", "num_layers", "hybrid_pattern", "first_dense_layers", "moe_layer_freq",
                  "local_per_global", "mtp_depth", "dp", "recompute", "tie_embeddings")
REFERENCE_GPU = "H100"  # analytic figures on a CPU are scaled from this GPU's


def kind_signature(arch: Arch, kind: str, impl: str, dtype: torch.dtype) -> str:
    """Signature of one layer of `kind` built by `impl` from `arch`, without building it."""
    fields = {k: v for k, v in asdict(arch).items() if k not in _NOT_PER_LAYER}
    text = json.dumps({"impl": impl, "kind": kind, "dtype": str(dtype), "arch": fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def arch_layers(arch: Arch, builders: Mapping[str, Callable[[], nn.Module]], *, impl: str,
                dtype: torch.dtype, inputs: Mapping[str, Callable] | None = None) -> list[ProfileLayer | None]:
    """One ProfileLayer per layer of `arch` whose kind has a builder (None elsewhere)."""
    out = []
    for name, kind in layer_plan(arch):
        if kind not in builders:
            out.append(None)
            continue
        make = builders[kind]
        example = (inputs or {}).get(kind) or (token_input(arch) if kind == "embedding" else hidden_input(arch, dtype))
        out.append(ProfileLayer(name=name, kind=kind, build=lambda make=make: make().to(dtype), example_input=example,
                                signature=kind_signature(arch, kind, impl, dtype)))
    return out


def profile_arch(arch: Arch, builders: Mapping[str, Callable[[], nn.Module]], *, impl: str = "torch",
                 dtype: torch.dtype = torch.float32, settings: ProfileSettings | None = None,
                 inputs: Mapping[str, Callable] | None = None) -> ProfileResult:
    """Profile every buildable kind of `arch` once and assemble the full cost-annotated Model.

    Every layer of a kind is the same module on the same input, so one representative per kind is
    measured. A kind whose layer fails to build or run (a missing kernel, an unsupported option)
    is logged and falls back to the analytic model, like a kind without a builder.
    """
    s = settings or ProfileSettings()
    s = replace(s, parallel=(("tp", arch.tp), ("pp", 1), ("dp", arch.dp), ("ep", arch.ep)))
    plan = layer_plan(arch)
    planned = arch_layers(arch, builders, impl=impl, dtype=dtype, inputs=inputs)
    reps: dict[str, ProfileLayer] = {}
    for p in planned:
        if p is not None:
            reps.setdefault(p.kind, p)
    measured: dict[str, tuple[Layer, object, dict]] = {}
    failed: dict[str, str] = {}
    info = None
    for kind, rep in tqdm(reps.items(), desc=f"profile {arch.name}", unit="kind", leave=False,
                          disable=None if s.progress is None else not s.progress):
        try:
            r = profile_layers([rep], name=arch.name, settings=replace(s, progress=False, host_link=False))
        except (RuntimeError, ValueError, TypeError, ImportError, AssertionError, NotImplementedError) as exc:
            failed[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            log.warning("profile %s: %s layer of kind %s failed (%s): using the analytic model", arch.name, impl,
                        kind, failed[kind])
            continue
        info = r.model.meta["profile"]
        measured[kind] = (r.model.layers[0], r.profiles[0], r.model.meta["profile"]["layers"][0])
    if not measured:
        reasons = "; ".join(f"{k}: {v}" for k, v in failed.items())
        raise OctoPipeError(f"profile {arch.name}: no layer kind of this model could be measured with '{impl}' "
                            f"layers{' (' + reasons + ')' if reasons else ''}")
    spec = gpu_spec_for(info["device"]) if info["device_type"] == "cuda" else None
    missing = sorted({k for _, k in plan} - set(measured))
    scale = 1.0 if spec is not None or not missing else _cpu_scale(arch, [m[0] for m in measured.values()])
    analytic = {k: layer_cost(arch, k, spec or REFERENCE_GPU) for k in missing}
    if missing:
        log.warning("profile %s: kind(s) %s not measured with %s layers: analytic model%s", arch.name,
                    ", ".join(missing), impl,
                    "" if spec else f" ({REFERENCE_GPU} times x {scale:.3g}, the measured ratio)")
    layers, profiles, records = [], [], []
    for name, kind in plan:
        if kind in measured:
            layer, prof, rec = measured[kind]
            layers.append(replace(layer, name=name))
            profiles.append(prof)
            records.append(rec)
            continue
        c = analytic[kind]
        layers.append(Layer(name=name, kind=kind, fwd_ms=c.fwd_ms * scale, bwd_ms=c.bwd_ms * scale,
                            wgrad_ms=c.wgrad_ms * scale, state_bytes=c.state_bytes,
                            activation_bytes=c.activation_bytes, output_bytes=c.output_bytes, source="analytic"))
        profiles.append(None)
        records.append(None)
    meta = {"cost_model": "measured", "impl": impl, "dtype": str(dtype).removeprefix("torch."),
            "arch": asdict(arch), "gpu": spec.name if spec else info["device"],
            "profile": {**info, "layers": records, "analytic_kinds": missing, "analytic_scale": scale,
                        "failed_kinds": failed}}
    model = Model(name=arch.name, layers=tuple(layers), inputs=_branches(arch), meta=meta,
                  host_link_gb_per_s=profiled_host_link(resolve_device(s.device), s) if s.host_link else None)
    cached = sum(1 for _, _, rec in measured.values() if rec["cache"] == "hit")
    stats = ProfileStats(layers=len(layers), distinct=len(measured), measured=len(measured) - cached,
                         cache_hits=cached)
    return ProfileResult(model=model, profiles=tuple(profiles), stats=stats)


def _cpu_scale(arch: Arch, measured: list[Layer]) -> float:
    """Measured / analytic time of the measured layers (analytic on the reference GPU)."""
    ana = sum(layer_cost(arch, l.kind, REFERENCE_GPU).fwd_ms + layer_cost(arch, l.kind, REFERENCE_GPU).bwd_ms
              + layer_cost(arch, l.kind, REFERENCE_GPU).wgrad_ms for l in measured)
    meas = sum(l.total_ms for l in measured)
    return meas / ana if ana > 0 else 1.0


def _branches(arch: Arch) -> dict[int, tuple[int, ...]]:
    """The analytic model's branch map (vision encoder -> decoder) for the same layer plan."""
    if not arch.vision_layers:
        return {}
    emb, proj = arch.vision_layers + 1, arch.vision_layers
    return {emb: (), emb + 1: (proj, emb)}
