"""Transformer Engine linears, safe first: fused B unless their I/W split was verified on a GPU and asked for.

Megatron-LM builds its decoder layers from Transformer Engine (the default `--transformer-impl
transformer_engine` wherever TE imports). A TE linear is one fused autograd Function: splitting its
backward into I and W needs TE's own `delay_wgrad_compute` queue, which this project has not run on
a GPU in CI. Until `scripts/gpu_check.sh --te-split` has verified it on the machine (the record below)
and the run asks for it (`--octopipe-te-split`), stages holding TE linears run fused B: start-up
rewrites a plan's I/W of those stages into B (nothing computed twice) and says so in one line, and
the graph handed to the tuner carries their backward as B (`fused_backward_model`).

The record: `$OCTOPIPE_TE_SPLIT_RECORD`, else `$XDG_CACHE_HOME/octopipe/gpu-check/te-split.json`
(`~/.cache/...`), an `octopipe-te-split-check/1` document naming the TE and megatron-core versions and
the GPU it passed on; another TE or megatron-core version needs the check again.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import logging
import os
from pathlib import Path

from ...errors import OctoPipeError
from .mapping import fuse_backward, split_stages

log = logging.getLogger("octopipe.megatron")

RECORD_FORMAT = "octopipe-te-split-check/1"
# Layer kinds Megatron builds with TE linears under the TE spec (the embedding and the output layer are
# Megatron's own VocabParallelEmbedding / ColumnParallelLinear, split-capable either way).
TE_KINDS = frozenset({"dense", "dense_local", "moe", "mtp", "attention", "mlp", "mamba"})


def record_path() -> Path:
    """Where scripts/gpu_check.sh records that TE's I/W split passed on this machine."""
    given = os.environ.get("OCTOPIPE_TE_SPLIT_RECORD")
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "octopipe" / "gpu-check" / "te-split.json"


def te_available() -> bool:
    """Whether Transformer Engine imports here (Megatron then builds TE linears under the TE spec)."""
    return importlib.util.find_spec("transformer_engine") is not None


def versions() -> dict[str, str | None]:
    """The Transformer Engine and megatron-core versions a record is valid for."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("transformer_engine", "megatron-core"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def write_record(*, passed: bool, gpu: str, detail: str, path: Path | None = None) -> Path:
    """Write the GPU check's verdict on TE's I/W split (called by the check, on the GPU it ran on)."""
    path = path or record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": RECORD_FORMAT, "passed": bool(passed), "gpu": gpu, "detail": detail, "versions": versions(),
           "checked_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def unverified_reason(path: Path | None = None) -> str | None:
    """Why TE's split may not run here (None: a passing record for these versions)."""
    path = path or record_path()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return f"no record at {path} (run `bash scripts/gpu_check.sh --te-split` on this GPU machine)"
    except (OSError, json.JSONDecodeError) as exc:
        return f"{path}: unreadable record ({exc})"
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        return f"{path}: field format: expected {RECORD_FORMAT!r}; run scripts/gpu_check.sh --te-split again"
    if not doc.get("passed"):
        return f"{path}: the check failed on {doc.get('gpu')} ({doc.get('detail')})"
    if doc.get("versions") != versions():
        return (f"{path}: checked with {doc.get('versions')}, this machine has {versions()}; run "
                "scripts/gpu_check.sh --te-split again")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TeBackward:
    """How this run's TE layers take their backward: `split` (I/W, verified and asked for) or fused B."""

    te: bool  # the run builds TE linears
    split: bool  # their I/W split runs (else fused B)


def te_backward(args) -> TeBackward:
    """The run's TE decision; `--octopipe-te-split` without a passing GPU record is refused in one line."""
    te = getattr(args, "transformer_impl", "local") == "transformer_engine" and te_available()
    asked = bool(getattr(args, "octopipe_te_split", False))
    if asked and te:
        reason = unverified_reason()
        if reason is not None:
            raise OctoPipeError(f"--octopipe-te-split: Transformer Engine's I/W split is not verified on this "
                                f"machine: {reason}; or drop --octopipe-te-split (those layers then run fused B)")
    return TeBackward(te=te, split=te and asked)


def te_stages(plan, specs) -> list[int]:
    """Stages of `plan` holding layers Megatron builds with TE linears."""
    return [s for s, st in enumerate(plan.stages) if any(sp.kind in TE_KINDS for sp in specs[st.start:st.end])]


def fuse_te_stages(plan, specs, decision: TeBackward, *, source: str = "the plan"):
    """The plan the run executes: I/W of TE stages as fused B unless their split is on; says so in one line."""
    if not decision.te or decision.split:
        return plan
    stages = te_stages(plan, specs)
    split = [s for s in split_stages(plan) if s in set(stages)]
    fused, pairs = fuse_backward(plan, stages)
    what = (f"{pairs} I/W pairs of {source} (stages {split}) run as B" if pairs
            else f"{source} schedules B for them already")
    log.warning("octopipe: Transformer Engine linears (stages %s) run fused B, their I/W split unverified on a GPU "
                "(%s): %s; --octopipe-te-split after the check passes splits them", stages,
                unverified_reason() or "not asked for with --octopipe-te-split", what)
    return fused


def fused_backward_model(model, decision: TeBackward):
    """The graph for the tuner: TE layers' backward as one B (bwd = I + W, wgrad 0) when they run fused.

    With no W left to move, a split of those layers buys the tuner nothing, and the plan it makes
    costs the same after `fuse_te_stages`; `meta.fused_backward_layers` names them for tuners that
    take the constraint directly."""
    if not decision.te or decision.split:
        return model
    return fused_backward_layers(model, lambda layer: layer.kind in TE_KINDS)


def fused_backward_layers(model, fused):
    """The graph with the backward of each layer where `fused(layer)` as one B (bwd = I + W, wgrad 0), named in
    `meta.fused_backward_layers`."""
    names = [layer.name for layer in model.layers if fused(layer)]
    layers = tuple(dataclasses.replace(layer, bwd_ms=layer.bwd_ms + layer.wgrad_ms, wgrad_ms=0.0)
                   if fused(layer) else layer for layer in model.layers)
    return dataclasses.replace(model, layers=layers, meta={**model.meta, "fused_backward_layers": names})


def te_chunk_problem(plan, rank: int, model, decision_split: bool) -> str | None:
    """For the runtime: a chunk holding TE linears that the plan gives I/W without the verified split (None: fine)."""
    split = set(split_stages(plan))
    for chunk, stage in zip(model, plan.stages_of(rank)):
        if stage in split and not decision_split and any(
                type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))
                for m in chunk.modules()):
            return (f"plan: stage {stage} on pipeline rank {rank} holds Transformer Engine linears and runs I/W, but "
                    "their split is not verified on a GPU (its W would recompute the weight GEMM); run it with B "
                    "(start-up does: --pipeline-schedule octopipe) or verify it (scripts/gpu_check.sh --te-split, "
                    "--octopipe-te-split)")
    return None
