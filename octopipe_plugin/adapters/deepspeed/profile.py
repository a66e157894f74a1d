"""DeepSpeed layers for the profiler: a PipelineModule's layer list (LayerSpec, modules, callables) as ProfileLayers.

A DeepSpeed pipeline is a list whose entries are `LayerSpec`s (built lazily), `nn.Module`s or
plain callables; each entry is a partitioning unit (what `partition_method` splits). Each becomes
a ProfileLayer: a LayerSpec is built with its own `build()` and named by its typename and
arguments (so a cache hit builds nothing), a module is profiled as it is, a callable inside a
parameter-free wrapper. The first layer takes the caller's example input; the others a tensor
shaped like the previous layer's output.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch
from torch import nn

from ...profile import ProfileLayer, ProfileResult, ProfileSettings, profile_layers


class CallableLayer(nn.Module):
    """A plain function of a DeepSpeed layer list (e.g. `lambda x: x.float()`) as a module."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the function."""
        return self.fn(x)

    def extra_repr(self) -> str:
        """The function's name and a digest of its code and constants (two lambdas differ in the signature)."""
        code = getattr(self.fn, "__code__", None)
        body = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12] if code else repr(self.fn)
        return f"{getattr(self.fn, '__qualname__', type(self.fn).__name__)} {body}"


def spec_signature(spec) -> str:
    """Signature of a LayerSpec without building it: its class and constructor arguments."""
    from deepspeed.pipe import TiedLayerSpec

    ty = spec.typename
    text = f"{ty.__module__}.{ty.__qualname__}|{spec!r}"
    if isinstance(spec, TiedLayerSpec):
        text += f"|tied:{spec.key}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def profile_layer_list(layers: Sequence, example_input: Callable[[torch.device], torch.Tensor], *,
                       kinds: Sequence[str] | None = None, names: Sequence[str] | None = None,
                       name: str = "deepspeed", settings: ProfileSettings | None = None,
                       meta: dict | None = None) -> ProfileResult:
    """Profile a DeepSpeed pipeline's layer list; `kinds` / `names` default to each entry's type name / index."""
    from deepspeed.pipe import LayerSpec

    out = []
    for i, entry in enumerate(layers):
        if isinstance(entry, LayerSpec):
            build, sig, kind = entry.build, spec_signature(entry), entry.typename.__name__
        elif isinstance(entry, nn.Module):
            build, sig, kind = (lambda m=entry: m), None, type(entry).__name__
        elif callable(entry):
            build, sig, kind = (lambda f=entry: CallableLayer(f)), None, getattr(entry, "__name__", "callable")
        else:
            raise TypeError(f"layer {i}: expected a LayerSpec, nn.Module or callable, got {type(entry).__name__}")
        out.append(ProfileLayer(name=names[i] if names else f"layer{i}", kind=kinds[i] if kinds else kind,
                                build=build, signature=sig, example_input=example_input if i == 0 else None))
    extra = ("deepspeed",) + ((settings.versions_extra) if settings else ())
    settings = ProfileSettings(**{**_fields(settings or ProfileSettings()), "versions_extra": extra})
    return profile_layers(out, name=name, settings=settings, meta={"impl": "deepspeed", **(meta or {})})


def _fields(settings: ProfileSettings) -> dict:
    return {f: getattr(settings, f) for f in settings.__dataclass_fields__}
