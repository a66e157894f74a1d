"""Calibration of the analytic model: per GPU and layer kind, how much faster than the table a layer runs.

The data file (`calibration.json` next to this module, or $OCTOPIPE_CALIBRATION) holds, per GPU
of the table and per layer kind, an efficiency scale for each of F, I and W: the summed analytic
time over the summed measured time of every profiled sample (`octopipe calibrate --write`,
scripts/gpu_profile.sh). The achieved efficiency of that kind is the table's times the scale, so
the analytic time is divided by it. Kinds and GPUs without samples keep the table's efficiency.

Document: {"format": "octopipe-calibration/1", "gpus": {GPU: {KIND: {"scale": {"fwd", "bwd", "wgrad"},
"samples": {ID: {"analytic_ms": [F, I, W], "measured_ms": [F, I, W], "device": str, "arch": str}}}}}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..errors import FormatError

CALIBRATION_FORMAT = "octopipe-calibration/1"
CALIBRATION_ENV = "OCTOPIPE_CALIBRATION"
PHASES = ("fwd", "bwd", "wgrad")
SHIPPED = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True, kw_only=True, slots=True)
class KindScale:
    """Efficiency scales of one (GPU, kind): analytic / measured time of F, I and W."""

    fwd: float = 1.0
    bwd: float = 1.0
    wgrad: float = 1.0
    samples: int = 0


IDENTITY = KindScale()


def calibration_path() -> Path:
    """The data file the analytic model reads: $OCTOPIPE_CALIBRATION, else the shipped one."""
    env = os.environ.get(CALIBRATION_ENV)
    return Path(env) if env else SHIPPED


def empty_document() -> dict:
    """A calibration document without samples."""
    return {"format": CALIBRATION_FORMAT, "gpus": {}}


def read_document(path: str | os.PathLike | None = None) -> dict:
    """The calibration document at `path` (default: calibration_path()); a missing file is an empty one."""
    path = Path(path) if path is not None else calibration_path()
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return empty_document()
    except json.JSONDecodeError as exc:
        raise FormatError(str(path), "$", f"valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != CALIBRATION_FORMAT:
        raise FormatError(str(path), "$.format", f"'{CALIBRATION_FORMAT}'", doc.get("format") if isinstance(doc, dict)
                          else doc)
    if not isinstance(doc.get("gpus", {}), dict):
        raise FormatError(str(path), "$.gpus", "an object", doc.get("gpus"))
    return doc


_memo: dict[tuple[str, float], MappingProxyType] = {}


def scales(path: str | os.PathLike | None = None) -> MappingProxyType:
    """(GPU name, kind) -> KindScale of the data file, re-read when the file changes."""
    path = Path(path) if path is not None else calibration_path()
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return MappingProxyType({})
    key = (str(path), stamp)
    if key not in _memo:
        doc = read_document(path)
        table = {}
        for gpu, kinds in doc.get("gpus", {}).items():
            for kind, entry in kinds.items():
                sc = entry.get("scale", {})
                where = f"$.gpus.{gpu}.{kind}.scale"
                vals = {}
                for ph in PHASES:
                    v = sc.get(ph, 1.0)
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                        raise FormatError(str(path), f"{where}.{ph}", "a number > 0", v)
                    vals[ph] = float(v)
                table[(gpu, kind)] = KindScale(**vals, samples=len(entry.get("samples", {})))
        _memo.clear()
        _memo[key] = MappingProxyType(table)
    return _memo[key]


def kind_scale(gpu: str, kind: str) -> KindScale:
    """The efficiency scales of one GPU and kind (the identity when never measured)."""
    return scales().get((gpu, kind), IDENTITY)
