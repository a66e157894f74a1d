"""The `"octopipe"` block of a DeepSpeed config, checked field by field.

    "octopipe": {
      "enabled": true,                  # false (or no block): DeepSpeed runs as it always does
      "plan": "plan.json",              # an octopipe-plan/1 file ...
      "tune": {"cluster": "h100x8", "gpu": "H100", "time_budget_s": 60, "seed": 0, "seq_len": 4096,  # or tune
               "memory_headroom": "8%",  # left free per rank (GiB or a fraction; default 8%, headroom.py)
               "profile": true, "profile_repeats": 10, "profile_input": [1, 4096]},  # measure layers first
      "save_plan": "run/plan.json",     # where rank 0 writes the plan it tuned (or was given)
      "model": "model.json",            # optional octopipe-model/1 file: measured costs for tuning
      "layer_of_spec": [0, 1, 1, 2],    # optional: OctoPipe layer of each PipelineModule list entry
      "timeout_s": 300,                 # optional: bound of every pipeline wait (seconds)
      "overlap_dp_reduction": true      # optional: start each stage's DP all-reduce at its last backward
    }

Exactly one of `plan` and `tune` is given. Every refusal names the field
(`ds_config: field $.octopipe.tune.gpu: expected ...`). Pure Python: no DeepSpeed import.
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass

from ...errors import FormatError, OctoPipeError
from ...headroom import DEFAULT as HEADROOM, parse_headroom
from ...plan_startup import one_line

CONFIG_KEY = "octopipe"
_SRC = "ds_config"
_FIELDS = ("enabled", "plan", "tune", "save_plan", "model", "layer_of_spec", "timeout_s", "overlap_dp_reduction")
_TUNE_FIELDS = ("cluster", "gpu", "time_budget_s", "seed", "seq_len", "profile", "profile_repeats", "profile_input",
                "memory_headroom")


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSpec:
    """Tuning at start-up: the cluster (named or file), the GPU of the cost model, the search budget."""

    cluster: str
    gpu: str = "H100"
    time_budget_s: float = 60.0
    seed: int = 0
    seq_len: int = 2048  # tokens per sample, for the analytic costs of the layer list
    profile: bool = False  # measure the layer list on this device (profiler, disk-cached) and tune on that
    profile_repeats: int = 10  # timed runs per distinct layer when profiling
    profile_input: tuple[int, ...] | None = None  # shape of a float first-layer input; None: token ids
    memory_headroom: str = HEADROOM  # left free on every rank: GiB ("6", 6) or a fraction ("8%", 0.08); headroom.py


@dataclass(frozen=True, kw_only=True, slots=True)
class OctoPipeBlock:
    """The validated block; `plan` xor `tune` is set."""

    enabled: bool = True
    plan: str | None = None
    tune: TuneSpec | None = None
    save_plan: str | None = None
    model: str | None = None
    layer_of_spec: tuple[int, ...] | None = None
    timeout_s: float = 300.0
    overlap_dp_reduction: bool = True


def _path(key: str) -> str:
    return f"$.{CONFIG_KEY}.{key}"


def _unknown(obj: dict, known: tuple[str, ...], where: str) -> None:
    extra = sorted(set(obj) - set(known))
    if extra:
        raise FormatError(_SRC, f"{where}.{extra[0]}", f"one of the known fields {list(known)}", extra[0])


def _string(block: dict, key: str, what: str, where: str | None = None) -> str | None:
    value = block.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise FormatError(_SRC, where or _path(key), what, value)
    return value


def _number(obj: dict, key: str, where: str, default: float) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise FormatError(_SRC, where, "a positive number of seconds", value)
    return float(value)


def _tune(spec) -> TuneSpec:
    where = _path("tune")
    if not isinstance(spec, dict):
        raise FormatError(_SRC, where, 'an object like {"cluster": "h100x8", "gpu": "H100", "time_budget_s": 60}',
                          spec)
    _unknown(spec, _TUNE_FIELDS, where)
    cluster = _string(spec, "cluster", "a named cluster (<gpu>x<count>) or a cluster file", f"{where}.cluster")
    if cluster is None:
        raise FormatError(_SRC, f"{where}.cluster", "a named cluster (<gpu>x<count>) or a cluster file")
    gpu = _string(spec, "gpu", "a GPU name of the cost model (e.g. H100)", f"{where}.gpu") or "H100"
    _check_gpu(gpu, f"{where}.gpu")
    seed = spec.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FormatError(_SRC, f"{where}.seed", "an integer", seed)
    seq_len = spec.get("seq_len", 2048)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise FormatError(_SRC, f"{where}.seq_len", "a positive integer (tokens per sample)", seq_len)
    profile = spec.get("profile", False)
    if not isinstance(profile, bool):
        raise FormatError(_SRC, f"{where}.profile", "true or false (measure the layers before tuning)", profile)
    repeats = spec.get("profile_repeats", 10)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise FormatError(_SRC, f"{where}.profile_repeats", "a positive integer (timed runs per layer)", repeats)
    shape = spec.get("profile_input")
    if shape is not None and (not isinstance(shape, list) or not shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise FormatError(_SRC, f"{where}.profile_input",
                          "the shape of the first layer's input, a list of positive integers", shape)
    headroom = spec.get("memory_headroom", HEADROOM)
    try:
        parse_headroom(headroom, "")
    except OctoPipeError:
        raise FormatError(_SRC, f"{where}.memory_headroom", 'GiB (6, "6GiB") or a fraction of device memory '
                          '("8%", 0.08)', headroom) from None
    return TuneSpec(memory_headroom=str(headroom), cluster=cluster, gpu=gpu, time_budget_s=_number(spec, "time_budget_s", f"{where}.time_budget_s",
                                                                    60.0), seed=seed, seq_len=seq_len,
                    profile=profile, profile_repeats=repeats,
                    profile_input=tuple(shape) if shape is not None else None)


def _check_gpu(gpu: str, where: str) -> None:
    from ...gpus import get_gpu
    from ...errors import OctoPipeError

    try:
        get_gpu(gpu)
    except OctoPipeError as exc:
        raise FormatError(_SRC, where, str(exc).split("expected ", 1)[-1], gpu) from None


def parse_block(ds_config) -> OctoPipeBlock | None:
    """The checked block of a DeepSpeed config dict; None when there is no block or it is disabled."""
    if not isinstance(ds_config, dict):
        raise FormatError(_SRC, "$", "a DeepSpeed config dict", type(ds_config).__name__)
    if CONFIG_KEY not in ds_config:
        return None
    block = ds_config[CONFIG_KEY]
    if not isinstance(block, dict):
        raise FormatError(_SRC, f"$.{CONFIG_KEY}", 'an object like {"plan": "plan.json"}', block)
    _unknown(block, _FIELDS, f"$.{CONFIG_KEY}")
    enabled = block.get("enabled", True)
    if not isinstance(enabled, bool):
        raise FormatError(_SRC, _path("enabled"), "true or false", enabled)
    if not enabled:
        return None
    plan = _string(block, "plan", "the path of an octopipe-plan/1 file (a string)")
    tune = _tune(block["tune"]) if "tune" in block else None
    if (plan is None) == (tune is None):
        raise FormatError(_SRC, _path("plan"), 'either "plan" (a plan file) or "tune" (tune at start-up), not both'
                          if plan else 'the path of an octopipe-plan/1 file (a string), or a "tune" object')
    overlap = block.get("overlap_dp_reduction", True)
    if not isinstance(overlap, bool):
        raise FormatError(_SRC, _path("overlap_dp_reduction"), "true or false", overlap)
    owners = block.get("layer_of_spec")
    if owners is not None and (not isinstance(owners, list)
                               or not all(isinstance(x, int) and not isinstance(x, bool) for x in owners)):
        raise FormatError(_SRC, _path("layer_of_spec"),
                          "a list of OctoPipe layer indices, one per PipelineModule layer", owners)
    return OctoPipeBlock(
        enabled=True, plan=plan, tune=tune,
        save_plan=_string(block, "save_plan", "a file path to write the plan to (a string)"),
        model=_string(block, "model", "the path of an octopipe-model/1 file (a string) or a zoo name"),
        layer_of_spec=tuple(owners) if owners is not None else None,
        timeout_s=_number(block, "timeout_s", _path("timeout_s"), 300.0),
        overlap_dp_reduction=overlap,
    )


def check_microbatches(plan_microbatches: int, gradient_accumulation_steps: int, source: str = _SRC) -> None:
    """Refuse a plan whose micro-batch count is not DeepSpeed's gradient_accumulation_steps."""
    if plan_microbatches != gradient_accumulation_steps:
        raise FormatError(source, "$.gradient_accumulation_steps",
                          f"the plan's micro-batch count {plan_microbatches} (DeepSpeed runs "
                          "gradient_accumulation_steps micro-batches per train_batch; tune or pick a plan for "
                          f"{gradient_accumulation_steps} micro-batches, or set train_batch_size to "
                          f"micro-batch size x {plan_microbatches} x data-parallel size)",
                          gradient_accumulation_steps)


class BlockRefused(OctoPipeError, SystemExit):
    """An enabled block that cannot be honoured: one line on every rank.

    Catchable as an ordinary exception (an OctoPipeError); left uncaught it ends the process as
    SystemExit does, printing the line alone and exiting with 1 (no traceback for a refusal the
    message already explains)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = message
        _release_group_at_exit()


_RELEASE_REGISTERED = []


def _release_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, once, if a refusal may end the process.

    A refusal leaves the process by SystemExit with the gloo group (and DeepSpeed's shared-memory
    communicator) alive; torn down by the interpreter instead, a still-joinable C++ thread ended the
    process by std::terminate (exit status -6 instead of the refusal's 1, now and then)."""
    if _RELEASE_REGISTERED:
        return
    _RELEASE_REGISTERED.append(True)

    def release() -> None:
        # never import torch here: at exit an import may not register its own exit hooks (and no group exists)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(release)


def refused(exc: BaseException) -> BlockRefused:
    """`exc` as a BlockRefused carrying its one-line message."""
    return exc if isinstance(exc, BlockRefused) else BlockRefused(one_line(exc))
