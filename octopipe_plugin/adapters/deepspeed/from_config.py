"""A DeepSpeed job before it runs: its config, its layer list (built on the meta device) and its partition now.

`octopipe plan --deepspeed-config ds_config.json --module pkg.mod:build` comes here. `build()`
returns the list of LayerSpecs (or modules) the script hands PipelineModule, or a
PipelineModule whose list is read; it is called under `torch.device("meta")`, so no weight is
allocated. The model is what the start-up tunes (`graph.model_from_specs`, the block's
`tune.seq_len` and GPU, the config's micro-batch size); the micro-batch count is DeepSpeed's
gradient_accumulation_steps; the current setup is DeepSpeed's PipelineEngine (1F1B, one stage
per rank) on the partition its `partition_method` gives (DeepSpeed's own partition functions).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import OctoPipeError
from .config import CONFIG_KEY, parse_block
from .plan_source import gradient_accumulation_steps

PARTITION_METHODS = ("parameters", "uniform")  # and 'type:REGEX', DeepSpeed's three


@dataclass(frozen=True, kw_only=True)
class JobView:
    """What a DeepSpeed job says: its config, layer list, model, micro-batch count and current partition."""

    config: dict
    layers: list
    model: object
    num_microbatches: int
    current: tuple[tuple[int, int], ...]  # DeepSpeed's parts as stage layer ranges
    current_source: str


def import_deepspeed() -> None:
    """Import DeepSpeed with its import-time output on stderr, so `octopipe plan ... --json` keeps stdout JSON.

    DeepSpeed's logger binds the stdout it finds at import (deepspeed/utils/logging.py, StreamHandler(sys.stdout))
    and logs an accelerator warning there on a machine without a GPU; imported here, its handler writes to stderr.
    """
    if "deepspeed" in sys.modules:
        return
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def read_config(path: str) -> dict:
    """The DeepSpeed config file as a dict; refused in one line naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise OctoPipeError(f"--deepspeed-config {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise OctoPipeError(f"--deepspeed-config {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise OctoPipeError(f"--deepspeed-config {path}: expected a JSON object")
    return data


def build_layers(target: str) -> list:
    """The layer list of `pkg.mod:function` (called on the meta device), or of the PipelineModule it returns."""
    import torch

    mod_name, _, fn_name = target.partition(":")
    if not mod_name or not fn_name:
        raise OctoPipeError(f"--module {target}: expected pkg.module:function")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise OctoPipeError(f"--module {target}: cannot import it ({exc})") from None
    with torch.device("meta"):  # a factory that builds modules allocates nothing
        built = fn()
    layers = getattr(built, "_layer_specs", built)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise OctoPipeError(f"--module {target}: expected it to return the list of LayerSpecs given to "
                            f"PipelineModule (or a PipelineModule), got {type(built).__name__}")
    return list(layers)


def deepspeed_parts(layers, num_stages: int, method: str) -> list[int]:
    """DeepSpeed's `parts` for the layer list, by its own PipelineModule._partition_layers rules."""
    import torch
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.pipe.module import PipelineModule

    holder = SimpleNamespace(_layer_specs=list(layers))  # the two methods read only the layer list
    method = method.lower()
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(layers), num_parts=num_stages)
    if method == "parameters":
        with torch.device("meta"):
            counts = PipelineModule._count_layer_params(holder)
        return ds_utils.partition_balanced(weights=counts, num_parts=num_stages)
    if method.startswith("type:"):
        weights = [0] * len(layers)
        for i in PipelineModule._find_layer_type(holder, method.split(":", 1)[1]):
            weights[i] = 1
        return ds_utils.partition_balanced(weights=weights, num_parts=num_stages)
    raise OctoPipeError(f"--partition-method {method}: expected parameters, uniform or type:REGEX "
                        "(DeepSpeed's PipelineModule methods)")


def view_job(config_path: str, target: str, cluster, *, world_size: int | None = None, gpu: str | None = None,
             partition_method: str = "parameters") -> JobView:
    """Read the config and layer list, build the model the start-up would tune, and DeepSpeed's current parts."""
    from ...costs import cost_gpu
    from .graph import model_from_specs

    config = read_config(config_path)
    block = parse_block(config) if CONFIG_KEY in config else None
    layers = build_layers(target)
    pipe = cluster.num_devices
    world = world_size or pipe
    if world % pipe:
        raise OctoPipeError(f"--world-size {world}: not a multiple of the {pipe} pipeline ranks of --cluster")
    m = gradient_accumulation_steps(config, world, pipe)
    tune = block.tune if block is not None else None
    cost = cost_gpu(cluster, gpu or (tune.gpu if tune else None))
    if block is not None and block.model is not None:  # the block's measured model, as the start-up uses it
        from ...costs import resolve_model

        model = resolve_model(block.model, gpu=cost)
    else:
        model = model_from_specs(layers, gpu=cost, seq_len=tune.seq_len if tune else 2048,
                                 micro_batch_size=int(config.get("train_micro_batch_size_per_gpu", 1)))
    parts = [int(p) for p in deepspeed_parts(layers, pipe, partition_method)]  # partition_balanced: numpy ints
    current = tuple(zip(parts[:-1], parts[1:]))
    return JobView(config=config, layers=layers, model=model, num_microbatches=m, current=current,
                   current_source=f"partition_method {partition_method!r} (parts {parts})")
