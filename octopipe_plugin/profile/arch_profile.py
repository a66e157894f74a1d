"""Profile a whole architecture: each distinct layer kind built by an implementation, the rest analytic.

`builders` maps a kind to a module factory (plain torch: torch_layers.builders; Megatron:
adapters/megatron/profile.py). Kinds without a builder (e.g. Mamba where its kernels are not
installed) take the analytic model's figures, scaled on a device outside the GPU table by the
measured / analytic ratio of the kinds that were measured, and are marked `"source": "analytic"`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import asdict, replace
from typing import Callable, Mapping

import torch
from torch import nn

from ..costs.analytic import layer_cost
from ..costs.arch import Arch, layer_plan
from ..errors import OctoPipeError
from ..formats.model import Layer, Model
from .device import gpu_spec_for
from .layer import ProfileLayer
from .profiler import ProfileResult, ProfileSettings, ProfileStats, profile_layers
from .torch_layers import hidden_input, token_input

log = logging.getLogger(__name__)

# Arch fields that do not change one layer of a kind: a model with more layers reuses the cache.
_NOT_PER_LAYER = ("name", "num_layers", "hybrid_pattern", "first_dense_layers", "moe_layer_freq",
                  "local_per_global", "mtp_depth", "dp", "recompute")
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
    """Profile every buildable kind of `arch` once and assemble the full cost-annotated Model."""
    s = settings or ProfileSettings()
    s = replace(s, parallel=(("tp", arch.tp), ("pp", 1), ("dp", arch.dp), ("ep", arch.ep)))
    planned = arch_layers(arch, builders, impl=impl, dtype=dtype, inputs=inputs)
    todo = [p for p in planned if p is not None]
    if not todo:
        raise OctoPipeError(f"profile {arch.name}: no layer kind of this model can be built by '{impl}'")
    measured = profile_layers(todo, name=arch.name, settings=s)
    info = measured.model.meta["profile"]
    spec = gpu_spec_for(info["device"]) if info["device_type"] == "cuda" else None
    by_name = {l.name: l for l in measured.model.layers}
    missing = sorted({k for p, (_, k) in zip(planned, layer_plan(arch)) if p is None})
    scale = 1.0 if spec is not None else _cpu_scale(arch, measured.model.layers) if missing else 1.0
    analytic = {k: layer_cost(arch, k, spec or REFERENCE_GPU) for k in missing}
    if missing:
        log.warning("profile %s: no %s layer for kind(s) %s: using the analytic model%s", arch.name, impl,
                    ", ".join(missing), "" if spec else f" ({REFERENCE_GPU} times x {scale:.3g}, the measured ratio)")
    layers, profiles = [], []
    it = iter(measured.profiles)
    for p, (name, kind) in zip(planned, layer_plan(arch)):
        if p is not None:
            layers.append(by_name[name])
            profiles.append(next(it))
            continue
        c = analytic[kind]
        layers.append(Layer(name=name, kind=kind, fwd_ms=c.fwd_ms * scale, bwd_ms=c.bwd_ms * scale,
                            wgrad_ms=c.wgrad_ms * scale, state_bytes=c.state_bytes,
                            activation_bytes=c.activation_bytes, output_bytes=c.output_bytes, source="analytic"))
        profiles.append(None)
    meta = {"cost_model": "measured", "impl": impl, "dtype": str(dtype).removeprefix("torch."),
            "arch": asdict(arch), "gpu": spec.name if spec else info["device"],
            "profile": {**info, "analytic_kinds": missing, "analytic_scale": scale}}
    model = Model(name=arch.name, layers=tuple(layers), inputs=_branches(arch), meta=meta)
    stats = dataclasses.replace(measured.stats, layers=len(layers))
    return ProfileResult(model=model, profiles=tuple(profiles), stats=stats)


def _cpu_scale(arch: Arch, measured: tuple[Layer, ...]) -> float:
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
