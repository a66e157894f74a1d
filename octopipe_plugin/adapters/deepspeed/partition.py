"""A plan's stage boundaries as DeepSpeed's `parts` (stage s owns LayerSpecs parts[s]:parts[s+1]).

DeepSpeed's PipelineEngine runs stage s on pipeline rank s, one stage per rank; only plans of
that shape map onto it. A DeepSpeed layer list may differ from the OctoPipe model's layers
(extra lambdas, a layer split in two, the loss kept outside as `loss_fn`): `layer_of_spec`
names the OctoPipe layer each list entry belongs to.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from ...errors import FormatError, OctoPipeError
from .config import CONFIG_KEY, parse_block



def plan_parts(plan, layer_of_spec: Sequence[int] | None = None) -> list[int]:
    """DeepSpeed `parts` for a one-stage-per-rank plan, in LayerSpec-list indices."""
    _check_one_stage_per_rank(plan)
    num_layers = plan.stages[-1].end
    starts = layer_starts(layer_of_spec, num_layers) if layer_of_spec is not None else list(range(num_layers + 1))
    return [starts[st.start] for st in plan.stages] + [starts[num_layers]]


def layer_starts(layer_of_spec: Sequence[int], num_layers: int) -> list[int]:
    """starts[i] = index of the first list entry of OctoPipe layer i; starts[num_layers] = list length."""
    owners = list(layer_of_spec)
    for j, owner in enumerate(owners):
        if not isinstance(owner, int) or isinstance(owner, bool) or not 0 <= owner < num_layers:
            raise OctoPipeError(f"layer_of_spec[{j}]: expected an OctoPipe layer index in 0..{num_layers - 1}, "
                                f"got {owner!r}")
        if j and owner < owners[j - 1]:
            raise OctoPipeError(f"layer_of_spec[{j}]: expected a layer index >= {owners[j - 1]} (list entries run "
                                f"in model order), got {owner}")
    return [bisect_left(owners, i) for i in range(num_layers + 1)]


def _check_one_stage_per_rank(plan) -> None:
    if plan.num_stages != plan.num_devices:
        raise OctoPipeError(
            f"plan has {plan.num_stages} stages on {plan.num_devices} devices; DeepSpeed's PipelineEngine runs "
            "exactly one stage per pipeline rank; run this plan with OctoPipe's own executor "
            "(octopipe_plugin.executor), or tune/build a plan with one stage per device (e.g. '1f1b', 'zb-h1')")
    for s, st in enumerate(plan.stages):
        if st.device != s:
            raise OctoPipeError(
                f"plan places stage {s} on device {st.device}; DeepSpeed's PipelineEngine runs stage s on pipeline "
                "rank s; run this plan with OctoPipe's own executor (octopipe_plugin.executor)")


def octopipe_config(ds_config: dict) -> dict:
    """The plan file and layer map of a config's `"octopipe"` block: {"plan": path, "layer_of_spec": list | None}."""
    block = parse_block(ds_config)
    if block is None:
        raise FormatError("ds_config", f"$.{CONFIG_KEY}", 'an object like {"plan": "plan.json"}',
                          ds_config.get(CONFIG_KEY))
    if block.plan is None:
        raise FormatError("ds_config", f"$.{CONFIG_KEY}.plan", "the path of an octopipe-plan/1 file (a string); "
                          "DeepSpeed's own engine runs a given plan's partition, tuning needs OctoPipeEngine")
    owners = list(block.layer_of_spec) if block.layer_of_spec is not None else None
    return {"plan": block.plan, "layer_of_spec": owners}


def load_parts(ds_config: dict, num_specs: int | None = None) -> list[int]:
    """Read the plan named by the config's octopipe block and return its DeepSpeed `parts`."""
    from ...formats import read_plan

    cfg = octopipe_config(ds_config)
    parts = plan_parts(read_plan(cfg["plan"]), cfg["layer_of_spec"])
    if num_specs is not None and parts[-1] != num_specs:
        field = "layer_of_spec" if cfg["layer_of_spec"] is not None else "plan"
        raise FormatError("ds_config", f"$.{CONFIG_KEY}.{field}",
                          f"a mapping onto the PipelineModule's {num_specs} layers", f"{parts[-1]} layers")
    return parts
