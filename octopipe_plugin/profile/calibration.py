"""Fit the analytic model's per-kind efficiency from profiles, and show analytic against measured per kind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..costs.analytic import layer_cost
from ..costs.arch import Arch
from ..costs.calibration import PHASES, calibration_path, read_document
from ..gpus import get_gpu
from ..errors import OctoPipeError
from ..formats.model import Model
from .device import gpu_spec_for

Triple = tuple[float, float, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class KindComparison:
    """One layer kind of one profile: analytic (table, and calibrated) against measured F / I / W ms."""

    kind: str
    count: int
    analytic_ms: Triple
    calibrated_ms: Triple
    measured_ms: Triple

    def ratio(self, phase: int) -> float:
        """Measured over analytic (table efficiency) of one phase; nan when analytic is 0."""
        a = self.analytic_ms[phase]
        return self.measured_ms[phase] / a if a > 0 else float("nan")


def profile_gpu(model: Model, gpu: str | None = None) -> str:
    """The GPU-table name a profiled model's figures belong to: `gpu`, else the one its device matches."""
    if gpu:
        return get_gpu(gpu).name
    try:
        return get_gpu(model.meta.get("gpu", "")).name
    except OctoPipeError:
        pass  # a CPU profile names its device there
    device = model.meta.get("profile", {}).get("device", "")
    spec = gpu_spec_for(device) if model.meta.get("profile", {}).get("device_type") == "cuda" else None
    if spec is None:
        raise OctoPipeError(f"profile of {model.name}: device {device!r} is not a GPU of the table (A100, H100, H200, "
                            "B200); the analytic model has nothing to compare with (give --gpu to compare anyway)")
    return spec.name


def _arch(model: Model) -> Arch:
    raw = model.meta.get("arch")
    if not isinstance(raw, dict):
        raise OctoPipeError(f"profile of {model.name}: meta.arch is missing; only profiles of an architecture "
                            "(octopipe profile MODEL) have an analytic counterpart")
    known = {f.name for f in dataclasses.fields(Arch)}
    return Arch(**{k: v for k, v in raw.items() if k in known})


def compare(model: Model, gpu: str | None = None) -> list[KindComparison]:
    """Per measured kind: the median measured F / I / W against the analytic model's on `gpu`."""
    arch, gpu_name = _arch(model), profile_gpu(model, gpu)
    kinds: dict[str, list] = {}
    for layer in model.layers:
        if layer.source == "measured":
            kinds.setdefault(layer.kind, []).append(layer)
    if not kinds:
        raise OctoPipeError(f"profile of {model.name}: no layer is marked \"source\": \"measured\"")
    rows = []
    for kind, layers in kinds.items():
        plain = layer_cost(arch, kind, gpu_name, calibrated=False)
        cal = layer_cost(arch, kind, gpu_name)
        measured = tuple(statistics.median(getattr(l, f"{ph}_ms") for l in layers) for ph in PHASES)
        rows.append(KindComparison(kind=kind, count=len(layers),
                                   analytic_ms=(plain.fwd_ms, plain.bwd_ms, plain.wgrad_ms),
                                   calibrated_ms=(cal.fwd_ms, cal.bwd_ms, cal.wgrad_ms), measured_ms=measured))
    return rows


def fit(models: list[Model], gpu: str | None = None, doc: dict | None = None) -> dict:
    """The calibration document `doc` (default: the current data file) with these profiles' samples added.

    A sample is one (architecture, kind, device, dtype); measuring it again replaces it. Each kind's
    scale is the summed analytic over the summed measured time of its samples, per phase.
    """
    doc = json.loads(json.dumps(doc if doc is not None else read_document()))
    for model in models:
        gpu_name = profile_gpu(model, gpu)
        device = model.meta.get("profile", {}).get("device", "unknown")
        arch_id = json.dumps([model.meta.get("arch"), model.meta.get("dtype"), model.meta.get("impl"), device],
                             sort_keys=True)
        for row in compare(model, gpu_name):
            entry = doc["gpus"].setdefault(gpu_name, {}).setdefault(row.kind, {"scale": {}, "samples": {}})
            sid = hashlib.sha256(f"{arch_id}/{row.kind}".encode()).hexdigest()[:16]
            entry["samples"][sid] = {"analytic_ms": list(row.analytic_ms), "measured_ms": list(row.measured_ms),
                                     "device": device, "arch": model.name, "impl": model.meta.get("impl")}
            entry["scale"] = _scale(entry["samples"].values())
    return doc


def _scale(samples) -> dict:
    out = {}
    for i, ph in enumerate(PHASES):
        a = sum(s["analytic_ms"][i] for s in samples)
        m = sum(s["measured_ms"][i] for s in samples)
        out[ph] = round(a / m, 6) if a > 0 and m > 0 else 1.0
    return out


def write_document(doc: dict, path: str | os.PathLike | None = None) -> Path:
    """Write a calibration document atomically (default: the data file the analytic model reads)."""
    path = Path(path) if path is not None else calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def format_comparison(rows: list[KindComparison], title: str) -> str:
    """Table: per kind, analytic / calibrated / measured ms of F, I and W and measured over analytic."""
    lines = [title, f"{'kind':<12}{'n':>4}  {'phase':<6}{'analytic':>10}{'calibrated':>12}{'measured':>10}"
                    f"{'meas/ana':>10}"]
    for r in sorted(rows, key=lambda r: r.kind):
        for i, ph in enumerate(("F", "I", "W")):
            head = f"{r.kind:<12}{r.count:>4}" if i == 0 else " " * 16
            lines.append(f"{head}  {ph:<6}{r.analytic_ms[i]:>10.3f}{r.calibrated_ms[i]:>12.3f}{r.measured_ms[i]:>10.3f}"
                         f"{r.ratio(i):>10.2f}")
    return "\n".join(lines)


def format_document(doc: dict) -> str:
    """Table of a calibration document: per GPU and kind, the F / I / W efficiency scales and sample count."""
    lines = [f"{'gpu':<10}{'kind':<12}{'F scale':>9}{'I scale':>9}{'W scale':>9}{'samples':>9}"]
    for gpu, kinds in sorted(doc.get("gpus", {}).items()):
        for kind, e in sorted(kinds.items()):
            sc = e.get("scale", {})
            lines.append(f"{gpu:<10}{kind:<12}" + "".join(f"{sc.get(p, 1.0):>9.3f}" for p in PHASES)
                         + f"{len(e.get('samples', {})):>9}")
    if len(lines) == 1:
        lines.append("(no samples yet: run scripts/gpu_profile.sh or `octopipe calibrate PROFILE.json --write`)")
    return "\n".join(lines)
