"""Built-in architecture configs (costs/zoo/*.yaml) and the loading of user architecture or model files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import MappingProxyType

from ..errors import FormatError, OctoPipeError
from ..formats.fields import Said, check_format, is_document_path, load_json
from ..formats.model import Model, model_from_dict
from .analytic import build_model
from .arch import Arch, arch_from_dict

ZOO_DIR = Path(__file__).with_name("zoo")
ZOO = MappingProxyType({p.stem: p for p in sorted(ZOO_DIR.glob("*.yaml"))})
OVERRIDABLE = frozenset(f.name for f in dataclasses.fields(Arch)) - {"name"}


def zoo_description(name: str) -> str:
    """The one-line description of a zoo model."""
    data, _ = load_json(ZOO[name])
    return str(data.get("description", ""))


def _is_model_doc(data: dict) -> bool:
    """Whether a loaded document is a cost-annotated `octopipe-model/1` (rather than an architecture)."""
    return str(data.get("format", "")).startswith("octopipe-model/")


def _load_doc(name_or_path: str, seen: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Raw architecture dict of a zoo name or file, with `base:` (a zoo name or file) merged underneath."""
    if name_or_path in ZOO:
        data, src = load_json(ZOO[name_or_path])
    elif is_document_path(name_or_path):
        data, src = load_json(name_or_path)
    else:
        raise OctoPipeError(
            f"unknown model {name_or_path!r}: expected a zoo name ({', '.join(ZOO)}) or a .json/.yaml file")
    base = data.get("base")
    if base is None or _is_model_doc(data):
        return data, src
    if not isinstance(base, str) or base in seen:
        raise FormatError(src, "$.base", "a zoo name or architecture file that does not refer back", base)
    if is_document_path(base) and not os.path.isabs(base) and not os.path.exists(base):
        base = os.path.join(os.path.dirname(src), base)
    parent, _ = _load_doc(base, seen + (name_or_path,))
    if _is_model_doc(parent):
        raise FormatError(src, "$.base", "a zoo name or architecture file (not an octopipe-model file)", base)
    merged = {k: v for k, v in parent.items() if k not in ("description",)}
    merged.update({k: v for k, v in data.items() if k != "base"})
    return merged, src


def load_arch(name_or_path: str, **overrides) -> Arch:
    """Architecture of a zoo name or an arch file, with keyword overrides (None values are ignored)."""
    data, src = _load_doc(str(name_or_path))
    return _arch_of_doc(data, src, overrides)


def _arch_of_doc(data: dict, src: str, overrides: dict) -> Arch:
    """The Arch of a loaded architecture document with the given overrides applied."""
    _refuse_other_documents(data, src)
    if "format" in data:
        check_format(data, src, "octopipe-arch")
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - OVERRIDABLE)
    if unknown:
        raise OctoPipeError(f"unknown architecture override(s) {unknown}; expected among {sorted(OVERRIDABLE)}")
    if given:
        src = f"{src} (with {', '.join(f'{k}={v}' for k, v in sorted(given.items()))})"
    return arch_from_dict({**data, **given}, src)


_MODEL_EXPECTED = ("an 'octopipe-model/1' file (per-layer costs, e.g. written by `octopipe model -o`) or an "
                   "architecture file (num_layers, hidden, ffn, heads, vocab; 'octopipe-arch/1')")


def _refuse_other_documents(data: dict, src: str) -> None:
    """A plan, a cluster or a model file without `format` given where a model is expected: say what it is."""
    fmt = data.get("format")
    if isinstance(fmt, str) and fmt.split("/")[0] in ("octopipe-plan", "octopipe-cluster"):
        kind = fmt.split("/")[0].removeprefix("octopipe-")
        fix = "pass it as the plan (`octopipe simulate --plan FILE`, `octopipe dryrun FILE`)" if kind == "plan" \
            else "pass it to --cluster"
        raise FormatError(src, "$.format", f"{_MODEL_EXPECTED}; this is a {kind} file: {fix}", fmt)
    if "format" not in data and isinstance(data.get("layers"), list):
        raise FormatError(src, "$.format", f"{_MODEL_EXPECTED}; the file has a `layers` list like a model file: "
                                           f"add \"format\": \"octopipe-model/1\"", Said("no format field"))


def resolve_model(name_or_path: str, gpu: str = "H100", **overrides) -> Model:
    """Zoo name or arch file -> analytic-costed Model; an `octopipe-model/1` file is read as it is."""
    return load_model(name_or_path, gpu, **overrides)[0]


def is_model_file(name_or_path: str) -> bool:
    """Whether a name is a cost-annotated `octopipe-model/1` file (False for zoo names and architectures)."""
    name = str(name_or_path)
    if name in ZOO or not is_document_path(name):
        return False
    try:
        data, _ = load_json(name)
    except OctoPipeError:
        return False
    return _is_model_doc(data)


def load_model(name_or_path: str, gpu: str = "H100", **overrides) -> tuple[Model, bool]:
    """Like `resolve_model`, also saying whether the costs came from an `octopipe-model/1` file (True)."""
    data, src = _load_doc(str(name_or_path))
    if _is_model_doc(data):
        given = sorted(k for k, v in overrides.items() if v is not None)
        if given:
            raise OctoPipeError(f"{src}: a cost-annotated octopipe-model file cannot take overrides {given}; "
                                "pass an architecture file or zoo name instead")
        return model_from_dict(data, src), True
    model = build_model(_arch_of_doc(data, src, overrides), gpu)
    _check_costs(model, src)
    return model, False


def _check_costs(model: Model, src: str) -> None:
    """Refuse an architecture whose costed layers leave the ranges a model file may hold (it could not be read back)."""
    from ..limits import MAX_BYTES, MAX_LAYER_MS

    for layer in model.layers:
        worst_ms = max(layer.fwd_ms, layer.bwd_ms, layer.wgrad_ms)
        worst_b = max(layer.state_bytes, layer.activation_bytes, layer.output_bytes)
        if worst_ms > MAX_LAYER_MS or worst_b > MAX_BYTES:
            raise FormatError(src, "$", f"an architecture whose layers cost at most {MAX_LAYER_MS:g} ms and "
                                        f"{MAX_BYTES >> 50} PiB each per micro-batch",
                              Said(f"layer {layer.name!r} at {worst_ms:.3g} ms and {worst_b / 2**50:.3g} PiB; check "
                                   f"hidden, ffn, seq_len and vocab"))
