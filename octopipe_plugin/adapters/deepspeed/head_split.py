"""Which list entry of a PipelineModule is a plan's split LM head, and this rank's shard of it.

The rule (one place): the plan's split layer is its last OctoPipe layer; `layer_of_spec` (or one
layer per entry) maps it onto the list entries [starts[L-1], starts[L]). Under a split that must be
exactly one entry, the last of the list: a `LayerSpec(nn.Linear, hidden, vocab, bias=False)` (a
subclass keeping Linear's forward). A head tied to the embedding (a TiedLayerSpec, whose forward_fn
may compute anything from the shared weight) is refused by name, as is a Linear with a bias.

Device `devices[j]` of the split holds rows `formats.splits.row_range` of the [vocab, hidden]
weight, initialised equal to those rows of the unsplit model's head: the LayerSpec is built whole
under DeepSpeed's own seed rule (`seed_fn` or `set_random_seed` of base_seed + the entry's global
index, PipelineModule._build) and cut. Without `seed_layers`, DeepSpeed's weights depend on the
build order of each partition, and so do the shards'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OctoPipeError
from ...formats.splits import SplitLayer, row_range, side_of
from .partition import layer_starts

SHARD_NAME = "octopipe_head_shard"  # the attribute (child module) of the rank's shard in the PipelineModule


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadPlacement:
    """A split LM head in a PipelineModule: its list entry, shape, split, and the rows this rank holds."""

    index: int  # the head's entry in the layer list (its checkpoint file is layer_{index:02d})
    vocab: int
    hidden: int
    split: SplitLayer
    owner_device: int  # the pipeline rank of the stage feeding the head (DeepSpeed's loss rank)
    rows: tuple[int, int] | None  # this rank's rows [lo, hi), None when it holds no shard


class HeadShard(nn.Module):
    """Rows [lo, hi) of the head's weight: `weight` [hi - lo, hidden] (the shard math runs in the executor)."""

    def __init__(self, weight: torch.Tensor, rows: tuple[int, int]):
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(weight.detach().clone())


def head_entry(plan, layer_of_spec) -> int | None:
    """The list index of the plan's split LM head (None: the head is not split), refusing what cannot split."""
    n = plan.stages[-1].end
    heads = [sp for sp in plan.splits if side_of(sp, n) == "output"]
    others = [sp.layer for sp in plan.splits if side_of(sp, n) != "output"]
    if others:
        raise OctoPipeError(f"plan splits layer {others[0]}: under DeepSpeed only the LM head (the last layer, "
                            f"{n - 1}) can be split so far (drop that layer's split)")
    if not heads:
        return None
    starts = layer_starts(layer_of_spec, n) if layer_of_spec is not None else list(range(n + 1))
    entries = list(range(starts[n - 1], starts[n]))
    if len(entries) != 1:
        raise OctoPipeError(f"plan splits layer {n - 1} (the LM head), which layer_of_spec maps onto list entries "
                            f"{entries}; a split head must be exactly one entry, the last of the list")
    owner = plan.stages[-1].device
    if owner not in heads[0].devices:
        raise OctoPipeError(f"plan splits the LM head over devices {list(heads[0].devices)} without the device "
                            f"{owner} of its owner stage {plan.num_stages - 1}: under DeepSpeed the owner holds a "
                            "shard (its J reports the loss on DeepSpeed's loss rank); add it to the split's devices")
    return entries[0]


def head_placement(plan, specs, layer_of_spec, rank: int) -> HeadPlacement | None:
    """The plan's split head in the list `specs` and this rank's rows of it (None: the head is not split)."""
    index = head_entry(plan, layer_of_spec)
    if index is None:
        return None
    n = plan.stages[-1].end
    split = next(sp for sp in plan.splits if side_of(sp, n) == "output")
    vocab, hidden = _linear_head(specs[index], index)
    rows = row_range(split, vocab, rank)
    if any(hi <= lo for lo, hi in (row_range(split, vocab, d) for d in split.devices)):
        raise OctoPipeError(f"plan's split of the LM head gives a device no rows of the {vocab}-row vocabulary "
                            "(raise its share or drop it from the split)")
    return HeadPlacement(index=index, vocab=vocab, hidden=hidden, split=split, owner_device=plan.stages[-1].device,
                         rows=rows)


def split_problem(plan, specs, layer_of_spec) -> str | None:
    """Why OctoPipeEngine cannot run `plan`'s split layers on the layer list `specs` (one sentence), or None."""
    try:
        head_placement(plan, specs, layer_of_spec, -1)
    except OctoPipeError as exc:
        return str(exc)
    return None


def splittable_head(spec) -> bool:
    """Whether a list entry, as the last of the list, can be a split LM head (the rule of `_linear_head`)."""
    try:
        _linear_head(spec, -1)
    except OctoPipeError:
        return False
    return True


def _linear_head(spec, index: int) -> tuple[int, int]:
    """(vocab, hidden) of a split head's LayerSpec, or the refusal naming what it is instead."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    what = f"list entry {index} (the split LM head)"
    if isinstance(spec, TiedLayerSpec):
        raise OctoPipeError(f"{what} is TiedLayerSpec {spec.key!r}, tied to the embedding: a split head tied to its "
                            "embedding is not supported under DeepSpeed (untie it: LayerSpec(nn.Linear, hidden, "
                            "vocab, bias=False), or drop the split)")
    typ = getattr(spec, "typename", None)
    if not (isinstance(spec, LayerSpec) and isinstance(typ, type) and issubclass(typ, nn.Linear)
            and typ.forward is nn.Linear.forward):
        name = typ.__name__ if isinstance(typ, type) else type(spec).__name__
        raise OctoPipeError(f"{what} is {name}: a split head is a LayerSpec(nn.Linear, hidden, vocab, bias=False) "
                            "(its rows are what the shards hold); drop the split for another head")
    args, kwargs = tuple(spec.module_args), dict(spec.module_kwargs)

    def arg(i, key, default=None):
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else default)

    if arg(2, "bias", True):
        raise OctoPipeError(f"{what} is an nn.Linear with a bias: a split head has none (bias=False), or drop the "
                            "split")
    return int(arg(1, "out_features")), int(arg(0, "in_features"))


def build_shard(module, placement: HeadPlacement) -> HeadShard:
    """This rank's HeadShard: the head built whole under DeepSpeed's seed rule, cut to the rank's rows."""
    from deepspeed.runtime import utils as ds_utils

    if module.seed_layers:
        seed = module.base_seed + placement.index
        (module.seed_fn or ds_utils.set_random_seed)(seed)
    full = module._layer_specs[placement.index].build()
    lo, hi = placement.rows
    shard = HeadShard(full.weight[lo:hi], (lo, hi))
    for p in shard.parameters():
        p.ds_pipe_replicated = False  # as PipelineModule._build marks every pipeline parameter
    return shard
