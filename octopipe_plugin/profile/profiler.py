"""Profile a sequence of layers into a cost-annotated `octopipe-model/1` Model.

Layer i's input is its own example input or, by default, a tensor shaped like layer i-1's
output. Layers with the same signature and input are measured once per run; every measurement
is cached on disk (cache.py), so a second run over the same layers measures nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .. import limits as L
from ..errors import OctoPipeError
from ..formats.model import Layer, Model, SubmoduleCost
from .cache import ProfileCache, cache_key
from .device import device_name, library_versions, resolve_device
from .layer import ProfileLayer, module_signature, tensor_from_meta, tensor_meta
from .measure import LayerProfile, measure_layer
from .timing import STATISTICS

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileStats:
    """How a profile run got its figures."""

    layers: int
    distinct: int  # distinct (signature, input) pairs
    measured: int  # of those, measured in this run
    cache_hits: int  # of those, read from the disk cache


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileResult:
    """The cost-annotated model, each layer's profile, and where the figures came from."""

    model: Model
    profiles: tuple[LayerProfile, ...]
    stats: ProfileStats


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSettings:
    """How to measure: device, samples, parallel sizes (part of the cache key) and the cache."""

    device: str | torch.device | None = None
    warmup: int = 2
    repeats: int = 10
    parallel: tuple[tuple[str, int], ...] = (("tp", 1), ("pp", 1), ("dp", 1), ("ep", 1))
    versions_extra: tuple[str, ...] = ()  # distributions whose version joins the key (e.g. megatron-core)
    cache_dir: str | None = None
    use_cache: bool = True
    progress: bool | None = None  # None: a bar when stderr is a terminal
    statistic: str = "median"  # which figure of the samples the layers get (timing.STATISTICS; the cache keeps all)
    host_link: bool = True  # measure the device<->host copy rate too (Model.host_link_gb_per_s)


def fused_ratio(prof: LayerProfile, statistic: str = "median") -> float | None:
    """The layer's measured fused backward B over its split halves I + W (medians), what the simulator charges B
    with (Layer.fused_ratio); None when the split halves took no time (nothing to scale).

    The executor's fused B runs one autograd pass where I + W run two plus the split's bookkeeping: on the 2-core
    CPU machine B came to 0.87-0.94 of I + W, profile and executor alike (benchmarks/action_costs.py).
    """
    split = prof.bwd.at(statistic) + prof.wgrad.at(statistic)
    fused = prof.fused.at(statistic)
    if split <= 0 or fused <= 0:
        return None
    return min(fused / split, L.MAX_FUSED_RATIO)


def profiled_layer(name: str, kind: str, prof: LayerProfile, statistic: str = "median") -> Layer:
    """The model's Layer from one layer's profile, every time taken by the same `statistic` (timing.STATISTICS)."""
    return Layer(name=name, kind=kind, fwd_ms=prof.fwd.at(statistic), bwd_ms=prof.bwd.at(statistic),
                 wgrad_ms=prof.wgrad.at(statistic), state_bytes=prof.state_bytes,
                 activation_bytes=prof.activation_bytes, output_bytes=prof.output_bytes, source="measured",
                 fused_ratio=fused_ratio(prof, statistic), graph_nodes=prof.graph_nodes,
                 walk_ms_per_node=prof.walk_ms_per_node,
                 recompute_ms=prof.recompute.at(statistic) if prof.recompute is not None else None,
                 selective=tuple(SubmoduleCost(module=m, freed_bytes=freed, rerun_ms=t.at(statistic))
                                 for m, freed, t in prof.selective))


def profiled_host_link(device: torch.device, settings: ProfileSettings) -> float:
    """This device's device<->host copy rate in GB/s (profile/links.py `measure_host_link`, what offloads copy
    at), cached like the layers' figures."""
    from .links import measure_host_link

    fields = {"host_link": "device<->host copy", "device": device_name(device),
              "versions": library_versions(settings.versions_extra)}
    cache = ProfileCache(settings.cache_dir) if settings.use_cache else None
    rec = cache.get(cache_key(fields)) if cache is not None else None
    if rec is not None and isinstance(rec.get("gb_per_s"), (int, float)) and rec["gb_per_s"] > 0:
        return float(rec["gb_per_s"])
    rate = measure_host_link(device)
    if cache is not None:
        cache.put(cache_key(fields), {"gb_per_s": rate}, fields)
    return rate


def profile_layers(layers: Sequence[ProfileLayer], *, name: str = "profiled",
                   settings: ProfileSettings | None = None, meta: dict | None = None) -> ProfileResult:
    """Measure every distinct layer once (or read it from the cache) and build the Model."""
    s = settings or ProfileSettings()
    if s.repeats < 1 or s.warmup < 0:
        raise OctoPipeError(f"profile: repeats must be >= 1 and warmup >= 0, got {s.repeats} and {s.warmup}")
    if s.statistic not in STATISTICS:
        raise OctoPipeError(f"profile: statistic must be one of {', '.join(STATISTICS)}, got {s.statistic!r}")
    if not layers:
        raise OctoPipeError("profile: no layers to profile")
    device = resolve_device(s.device)
    dev_name = device_name(device)
    versions = library_versions(s.versions_extra)
    parallel = dict(s.parallel)
    cache = ProfileCache(s.cache_dir) if s.use_cache else None
    memo: dict[str, LayerProfile] = {}
    profiles: list[LayerProfile] = []
    records: list[dict] = []
    measured = hits = 0
    prev_out: dict | None = None
    # tqdm's disable=None: a bar only when stderr is a terminal
    bar = tqdm(total=len(layers), desc="profile", unit="layer", leave=False,
               disable=None if s.progress is None else not s.progress)
    try:
        for i, layer in enumerate(layers):
            module = None
            x = layer.example_input(device) if layer.example_input is not None else None
            if x is None and prev_out is None:
                raise OctoPipeError(f"profile: layer {i} ({layer.name}) has no example input and no previous layer")
            in_meta = tensor_meta(x) if x is not None else prev_out
            signature = layer.signature
            if signature is None:
                module = layer.build()
                signature = module_signature(module)
            fields = {"signature": signature, "kind": layer.kind, "input": in_meta, "parallel": parallel,
                      "device": dev_name, "versions": versions}
            key = cache_key(fields)
            how = "repeat"
            prof = memo.get(key)
            if prof is None and cache is not None:
                rec = cache.get(key)
                if rec is not None:
                    prof, how = LayerProfile.from_dict(rec), "hit"
                    hits += 1
            if prof is None:
                module = module if module is not None else layer.build()
                x = x if x is not None else tensor_from_meta(in_meta, device, seed=i)
                bar.set_postfix_str(f"measuring {layer.name}")
                log.info("profile: measuring %s (%s) on %s", layer.name, layer.kind, dev_name)
                prof = measure_layer(module, x, device, warmup=s.warmup, repeats=s.repeats, dp=parallel.get("dp", 1),
                                     kind=layer.kind)
                how = "miss"
                measured += 1
                if cache is not None:
                    cache.put(key, prof.to_dict(), fields)
            memo[key] = prof
            del module, x
            profiles.append(prof)
            records.append({"signature": signature, "key": key[:16], "cache": how,
                            "fused_bwd_ms": prof.fused.median_ms, "split_ratio": prof.split_ratio,
                            "graph_nodes": prof.graph_nodes, "walk_ms_per_node": prof.walk_ms_per_node,
                            "input": prof.input, "params": prof.params,
                            "spread": {"fwd": round(prof.fwd.spread, 4), "bwd": round(prof.bwd.spread, 4),
                                       "wgrad": round(prof.wgrad.spread, 4)}})
            prev_out = prof.output
            bar.update(1)
    finally:
        bar.close()
    model_layers = tuple(profiled_layer(l.name, l.kind, p, s.statistic) for l, p in zip(layers, profiles))
    info = {"device": dev_name, "device_type": device.type, "warmup": s.warmup, "repeats": s.repeats,
            "statistic": s.statistic,
            "parallel": parallel, "versions": versions, "layers": records}
    model = Model(name=name, layers=model_layers, meta={"cost_model": "measured", **(meta or {}), "profile": info},
                  host_link_gb_per_s=profiled_host_link(device, s) if s.host_link else None)
    stats = ProfileStats(layers=len(layers), distinct=len(memo), measured=measured, cache_hits=hits)
    return ProfileResult(model=model, profiles=tuple(profiles), stats=stats)
