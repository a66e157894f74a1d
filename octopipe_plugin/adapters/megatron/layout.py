"""A plan's stage boundaries as Megatron's layout arguments, and back.

Megatron places stage i on pipeline rank i % P as virtual stage i // P (round-robin) and
builds the embedding where `pre_process` holds (rank 0, virtual stage 0) and the LM head and
loss where `post_process` holds (rank P-1, last virtual stage), whatever a layout string says.
GPT-style models take `--pipeline-model-parallel-layout` (E embedding, t decoder layer,
m MTP layer, L loss, '|' between stages); hybrid models (Mamba / attention / MLP layers)
take `--hybrid-layer-pattern` with '|' between stages instead. Pure string work: nothing
here imports Megatron, whose own parser and validator are the tests' oracle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from ...errors import OctoPipeError, PlanError
from ...formats.ranges import stage_range_problem

GPT_SYMBOLS = MappingProxyType(
    {"embedding": "E", "dense": "t", "dense_local": "t", "moe": "t", "mtp": "m", "lm_head": "L"})
# megatron.core.models.hybrid.hybrid_layer_allocation.Symbols
HYBRID_SYMBOLS = MappingProxyType({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"})
HYBRID_ONLY_KINDS = frozenset({"mamba", "attention", "mlp"})
# Layers Megatron builds from pre_process / post_process, never from a layout position.
_ENDS = MappingProxyType({"embedding": "first", "lm_head": "last"})
# PipelineParallelLayerLayout.parse_str_to_list: '(...)*n' first, then 'x*n'; commas are cosmetic.
_REPEAT_PATTERNS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")

EXECUTOR_HINT = ("run it as it is with OctoPipe's own executor (octopipe_plugin.executor), which takes the "
                 "plan's stages and stage->device map directly")
_LOOPED_HINT = "or pick a looped plan (e.g. build_plan(model, 'interleaved-1f1b', ...))"


def plan_to_layout(plan, model) -> str:
    """The `--pipeline-model-parallel-layout` string of a plan Megatron can express; refuses any other."""
    if HYBRID_ONLY_KINDS & {layer.kind for layer in model.layers}:
        raise OctoPipeError(f"model {model.name!r} has Mamba/attention-only/MLP-only layers: Megatron builds it as a "
                            "HybridModel, whose stages come from --hybrid-layer-pattern (use plan_to_hybrid_pattern), "
                            "not from --pipeline-model-parallel-layout")
    pp, vp = _round_robin(plan)
    symbols = _symbols(model, GPT_SYMBOLS, "--pipeline-model-parallel-layout")
    _check_ends(plan, model)
    _check_mtp(plan, model, pp, vp)
    return "|".join("".join(symbols[st.start:st.end]) for st in plan.stages)


def layout_to_boundaries(layout_str: str, model) -> list[tuple[int, int]]:
    """The stage layer ranges a Megatron layout string gives `model` (the inverse of plan_to_layout)."""
    stages = [list(stage) for stage in expand_layout(layout_str).split("|")]
    symbols = _symbols(model, GPT_SYMBOLS, "--pipeline-model-parallel-layout")
    ranges = _match(stages, symbols, f"layout {layout_str!r}")
    if "E" not in stages[0] or "L" not in stages[-1]:
        raise OctoPipeError(f"layout {layout_str!r}: Megatron builds the embedding in the first stage and the loss "
                            "in the last whatever the layout says; put E in the first stage and L in the last")
    return ranges


def expand_layout(layout_str: str) -> str:
    """Megatron's layout grammar unrolled: commas dropped, '(ab|)*2' and 't*3' repeated."""
    text = layout_str.replace(",", "")
    for pattern in _REPEAT_PATTERNS:
        text = re.sub(pattern, lambda mt: mt.group(1) * int(mt.group(2)), text)
    bad = sorted(set(text) - set("ELtm|"))
    if bad:
        raise OctoPipeError(f"layout {layout_str!r}: unknown character(s) {bad}; expected E, L, t, m, '|' "
                            "(and Megatron's '(...)*n', 'x*n', ',' shorthands)")
    return text


def plan_to_hybrid_pattern(plan, model) -> str:
    """The `--hybrid-layer-pattern` (with '|' between stages) of a hybrid-model plan Megatron can express."""
    _round_robin(plan)
    _check_ends(plan, model)
    if any(layer.kind == "mtp" for layer in model.layers):
        raise OctoPipeError(f"model {model.name!r}: MTP layers of a HybridModel sit in the pattern's '/' part on the "
                            f"final stage and cannot follow a plan's boundaries; {EXECUTOR_HINT}")
    symbols = _hybrid_symbols(model)
    return "|".join("".join(symbols[st.start:st.end]) for st in plan.stages)


def hybrid_pattern_to_boundaries(pattern: str, model) -> list[tuple[int, int]]:
    """The stage layer ranges a '|'-separated `--hybrid-layer-pattern` gives `model`."""
    if "/" in pattern:
        raise OctoPipeError(f"hybrid pattern {pattern!r}: the MTP part after '/' is not a pipeline stage; "
                            "pass the main pattern only")
    symbols = _hybrid_symbols(model)
    stages = [list(seg) for seg in pattern.split("|")]
    return _match(stages, symbols, f"hybrid pattern {pattern!r}")


def megatron_launch_args(plan, model) -> list[str]:
    """Megatron-LM training arguments that build the plan's stages (layout or hybrid pattern)."""
    pp, _ = _round_robin(plan)
    args = ["--pipeline-model-parallel-size", str(pp)]
    if HYBRID_ONLY_KINDS & {layer.kind for layer in model.layers}:
        # Megatron derives the virtual stage count from the segments (and refuses
        # --num-virtual-stages-per-pipeline-rank next to the pattern).
        return args + ["--hybrid-layer-pattern", plan_to_hybrid_pattern(plan, model)]
    layout = plan_to_layout(plan, model)
    decoder = sum(1 for layer in model.layers if GPT_SYMBOLS[layer.kind] == "t")
    # Megatron refuses --num-virtual-stages-per-pipeline-rank together with a layout: the
    # layout's stage count divided by P is the virtual stage count.
    args += ["--num-layers", str(decoder), "--pipeline-model-parallel-layout", layout]
    mtp = sum(1 for layer in model.layers if layer.kind == "mtp")
    if mtp:
        args += ["--mtp-num-layers", str(mtp)]
    return args


def _round_robin(plan) -> tuple[int, int]:
    """(P, V) of a plan placed round-robin; refuses any other placement with the reason."""
    pp, ns = plan.num_devices, plan.num_stages
    if ns % pp:
        raise OctoPipeError(f"plan has {ns} stages on {pp} devices: Megatron gives every pipeline rank the same "
                            f"number of virtual stages; {EXECUTOR_HINT}, {_LOOPED_HINT}")
    for i, st in enumerate(plan.stages):
        if st.device != i % pp:
            shape = " (a V-shape placement, as ZB-V and DualPipeV use)" if _is_v(plan) else ""
            raise OctoPipeError(
                f"plan places stage {i} on device {st.device}{shape}; Megatron places stage i on pipeline rank "
                f"i % {pp} = {i % pp} (virtual stage {i // pp}) and cannot express another stage->rank map; "
                f"{EXECUTOR_HINT}, {_LOOPED_HINT}")
    return pp, ns // pp


def _is_v(plan) -> bool:
    p = plan.num_devices
    return plan.num_stages == 2 * p and all(plan.stages[s].device == plan.stages[2 * p - 1 - s].device
                                            for s in range(p))


def _symbols(model, table: Mapping[str, str], what: str) -> list[str]:
    out = []
    for i, layer in enumerate(model.layers):
        sym = table.get(layer.kind)
        if sym is None:
            why = (" (Megatron builds a vision encoder and projector outside the decoder pipeline; its flexible "
                   "layout has no encoder layers)" if layer.kind in ("vision", "projector") else "")
            raise OctoPipeError(f"model {model.name!r} layer {i} ({layer.name!r}) has kind {layer.kind!r}, which "
                                f"{what} cannot place{why}; kinds it can place: {sorted(table)}; {EXECUTOR_HINT}")
        out.append(sym)
    return out


def _hybrid_symbols(model) -> list[str]:
    """Pattern symbols of the layers between embedding and LM head, which must sit at the two ends."""
    kinds = [layer.kind for layer in model.layers]
    if not kinds or kinds[0] != "embedding" or kinds[-1] != "lm_head" or kinds.count("embedding") != 1 \
            or kinds.count("lm_head") != 1:
        raise OctoPipeError(f"model {model.name!r}: a HybridModel has one embedding first and one lm_head last")
    table = {**HYBRID_SYMBOLS, "embedding": "", "lm_head": ""}
    return _symbols(model, table, "--hybrid-layer-pattern")


def _check_ends(plan, model) -> None:
    """Embedding in stage 0 and LM head in the last stage: where pre/post_process build them."""
    problem = stage_range_problem([(st.start, st.end) for st in plan.stages], model.num_layers)
    if problem is not None:
        raise PlanError(f"model {model.name!r}: {problem.message}")
    last = plan.num_stages - 1
    for i, layer in enumerate(model.layers):
        where = _ENDS.get(layer.kind)
        if where is None:
            continue
        want, hook = (0, "pre_process") if where == "first" else (last, "post_process")
        stage = _stage_of(plan, i)
        if stage != want:
            raise OctoPipeError(
                f"plan puts layer {i} ({layer.kind}) in stage {stage}; Megatron builds the {layer.kind} only in "
                f"the {where} stage ({want}, where {hook} holds), so these boundaries cannot be expressed; "
                f"move layer {i} into stage {want} (no empty {where} stage), or {EXECUTOR_HINT}")


def _check_mtp(plan, model, pp: int, vp: int) -> None:
    """Megatron's MTP rules: after every decoder layer, all in one stage, on a rank's last virtual stage."""
    mtp = [i for i, layer in enumerate(model.layers) if layer.kind == "mtp"]
    if not mtp:
        return
    if any(GPT_SYMBOLS.get(layer.kind) == "t" for layer in model.layers[mtp[0]:]):
        raise OctoPipeError(f"model {model.name!r}: Megatron needs every MTP layer after the last decoder layer")
    stages = sorted({_stage_of(plan, i) for i in mtp})
    if len(stages) > 1:
        raise OctoPipeError(f"plan splits the MTP layers over stages {stages}; Megatron builds all MTP layers in one "
                            f"stage; move them into one stage, or {EXECUTOR_HINT}")
    if stages[0] // pp != vp - 1:
        raise OctoPipeError(
            f"plan puts the MTP layers in stage {stages[0]} (virtual stage {stages[0] // pp} of pipeline rank "
            f"{stages[0] % pp}); Megatron builds MTP only in a rank's last virtual stage ({vp - 1}), i.e. stages "
            f"{pp * (vp - 1)}..{pp * vp - 1}; move the boundaries there, or {EXECUTOR_HINT}")


def _stage_of(plan, layer: int) -> int:
    return next(s for s, st in enumerate(plan.stages) if st.start <= layer < st.end)


def _match(stages: list[list[str]], symbols: list[str], what: str) -> list[tuple[int, int]]:
    """Walk the model's layer symbols through the stages; empty symbols ride with the neighbouring stage."""
    ranges, pos, n = [], 0, len(symbols)
    for s, stage in enumerate(stages):
        start = pos
        if s == 0:  # the embedding (no hybrid symbol) belongs to stage 0
            while pos < n and symbols[pos] == "":
                pos += 1
        for j, sym in enumerate(stage):
            if pos >= n or symbols[pos] != sym:
                got = symbols[pos] if pos < n else "the end of the model"
                raise OctoPipeError(f"{what}: stage {s} position {j} is {sym!r} but the model's layer {pos} is "
                                    f"{got!r}")
            pos += 1
        if s == len(stages) - 1:
            while pos < n and symbols[pos] == "":
                pos += 1
        ranges.append((start, pos))
    if pos != n:
        raise OctoPipeError(f"{what}: its stages hold {pos} of the model's {n} layers")
    return ranges
