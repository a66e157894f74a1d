"""Which list entry of a PipelineModule is a plan's split LM head, and this rank's shard of it.

The rule (one place): the plan's split layer is its last OctoPipe layer; `layer_of_spec` (or one
layer per entry) maps it onto the list entries [starts[L-1], starts[L]). Under a split that must be
exactly one entry, the last of the list: either a `LayerSpec(nn.Linear, hidden, vocab, bias=False)`
(a subclass keeping Linear's forward; a bias is refused by name), or a head tied to the embedding,
a `TiedLayerSpec` whose key also names an earlier entry and whose `forward_fn` is the projection
with the tied weight (`tied_weight_attr`): checked by a probe, forward_fn(module, x) == x @ W^T in
float64 on a few rows of W, so a scaled or biased projection, or any other use of the weight, is
refused by name with what it computes instead.

Device `devices[j]` of the split holds rows `formats.splits.row_range` of the [vocab, hidden]
weight. Untied: initialised equal to those rows of the unsplit model's head, the LayerSpec built
whole under DeepSpeed's own seed rule (`seed_fn` or `set_random_seed` of base_seed + the entry's
global index, PipelineModule._build) and cut; without `seed_layers`, DeepSpeed's weights depend on
the build order of each partition, and so do the shards'. Tied: the rows of the tied weight as
DeepSpeed synchronises it (its tied broadcast), copied onto the shards and their gradients summed
with the whole weight's by `executor/tied_rows.py` (module.py, engine.py); the whole weight must be
held by one pipeline rank (the tie has one full side).

A split input embedding (layer 0) is exactly list entry 0, a `LayerSpec(nn.Embedding, vocab, hidden)`
(a subclass keeping Embedding's forward, without padding_idx, max_norm, scale_grad_by_freq or sparse:
the shards' lookup and gradient are the plain row gather and scatter); a TiedLayerSpec embedding is
refused (its tie to the head, as under Megatron). Its shards hold rows `row_range` of its weight,
built under the same seed rule (base_seed + 0); stage 0 is built without the entry and takes the
shards' summed lookups as its input (`EMBEDDING_SHARD_NAME`, module.py), stage 0's rank need not hold
a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OctoPipeError
from ...formats.splits import SplitLayer, row_range, side_of
from .partition import layer_starts

SHARD_NAME = "octopipe_head_shard"  # the attribute (child module) of the rank's shard in the PipelineModule
EMBEDDING_SHARD_NAME = "octopipe_embedding_shard"  # the same of a split embedding's shard


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadPlacement:
    """A split LM head (or, `side` "input", the split embedding) in a PipelineModule: its list entry, shape, split,
    and the rows this rank holds."""

    index: int  # the head's entry in the layer list (its checkpoint file is layer_{index:02d})
    vocab: int
    hidden: int
    split: SplitLayer
    owner_device: int  # the pipeline rank of the stage feeding the head (DeepSpeed's loss rank); the embedding's: 0's
    rows: tuple[int, int] | None  # this rank's rows [lo, hi), None when it holds no shard
    tied: TiedHead | None = None  # the weight it shares with the embedding (None: an untied Linear head)
    side: str = "output"  # "output": the LM head, "input": the embedding
    dtype: torch.dtype = torch.float32  # the weight's dtype as built (an embedding's lookups have it)


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedHead:
    """A split head tied to an earlier entry: the key, the tied weight, who holds it whole, where DeepSpeed saves it."""

    key: str
    attr: str  # the tied module's weight the head projects with (its tied_weight_attr), e.g. "weight"
    entries: tuple[int, ...]  # the key's other list entries (the embedding)
    full_device: int  # the pipeline rank holding those entries, hence the whole weight
    file_entry: int | None  # the first of them DeepSpeed writes a layer file for (forward_fn None), None: none
    dtype: torch.dtype  # the tied weight's dtype as built (the shards' too)


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
    others = [sp.layer for sp in plan.splits if side_of(sp, n) not in ("output", "input")]
    if others:
        raise OctoPipeError(f"plan splits layer {others[0]}: under DeepSpeed only the LM head (the last layer, "
                            f"{n - 1}) and the embedding (layer 0) can be split (drop that layer's split)")
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
    tied = None
    if _is_tied(specs[index]):
        tied, (vocab, hidden) = _tied_head(plan, specs, layer_of_spec, index)
    else:
        vocab, hidden = _linear_head(specs[index], index)
    rows = row_range(split, vocab, rank)
    if any(hi <= lo for lo, hi in (row_range(split, vocab, d) for d in split.devices)):
        raise OctoPipeError(f"plan's split of the LM head gives a device no rows of the {vocab}-row vocabulary "
                            "(raise its share or drop it from the split)")
    return HeadPlacement(index=index, vocab=vocab, hidden=hidden, split=split, owner_device=plan.stages[-1].device,
                         rows=rows, tied=tied)


def embedding_entry(plan, layer_of_spec) -> int | None:
    """The list index of the plan's split embedding (0; None: the embedding is not split), refusing a layer 0 that
    layer_of_spec maps onto other entries than entry 0 alone."""
    n = plan.stages[-1].end
    if not any(side_of(sp, n) == "input" for sp in plan.splits):
        return None
    starts = layer_starts(layer_of_spec, n) if layer_of_spec is not None else list(range(n + 1))
    entries = list(range(starts[0], starts[1]))
    if entries != [0]:
        raise OctoPipeError(f"plan splits layer 0 (the embedding), which layer_of_spec maps onto list entries "
                            f"{entries}; a split embedding must be exactly one entry, the first of the list")
    return 0


def embedding_placement(plan, specs, layer_of_spec, rank: int) -> HeadPlacement | None:
    """The plan's split embedding in the list `specs` and this rank's rows of it (None: the embedding is not split)."""
    index = embedding_entry(plan, layer_of_spec)
    if index is None:
        return None
    n = plan.stages[-1].end
    split = next(sp for sp in plan.splits if side_of(sp, n) == "input")
    vocab, hidden, dtype = _embedding_shape(specs[index])
    if any(hi <= lo for lo, hi in (row_range(split, vocab, d) for d in split.devices)):
        raise OctoPipeError(f"plan's split of the embedding gives a device no rows of the {vocab}-row vocabulary "
                            "(raise its share or drop it from the split)")
    return HeadPlacement(index=index, vocab=vocab, hidden=hidden, split=split, owner_device=plan.stages[0].device,
                         rows=row_range(split, vocab, rank), side="input", dtype=dtype)


def split_problem(plan, specs, layer_of_spec) -> str | None:
    """Why OctoPipeEngine cannot run `plan`'s split layers on the layer list `specs` (one sentence), or None."""
    try:
        head_placement(plan, specs, layer_of_spec, -1)
        embedding_placement(plan, specs, layer_of_spec, -1)
    except OctoPipeError as exc:
        return str(exc)
    return None


def splittable_embedding(spec) -> bool:
    """Whether a list entry, as the first of the list, can be a split embedding (the rule of `_embedding_shape`)."""
    try:
        _embedding_shape(spec)
    except OctoPipeError:
        return False
    return True


def embedding_splits(specs, layer_of_spec) -> bool:
    """Whether OctoPipeEngine can split this layer list's embedding in any plan (layer 0 is entry 0 alone, a
    `_embedding_shape` embedding): what the split search may try for it."""
    owners = list(layer_of_spec) if layer_of_spec is not None else list(range(len(specs)))
    alone = bool(owners) and owners[0] == 0 and (len(owners) == 1 or owners[1] != 0)
    return alone and splittable_embedding(specs[0])


_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse")  # each changes lookup or gradient


def _embedding_shape(spec) -> tuple[int, int, torch.dtype]:
    """(vocab, hidden, dtype) of a split embedding's LayerSpec, or the refusal naming what it is instead."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    what = "list entry 0 (the split embedding)"
    if isinstance(spec, TiedLayerSpec):
        raise OctoPipeError(f"{what} is TiedLayerSpec {spec.key!r}: a split embedding tied to the LM head is not "
                            "supported; make it LayerSpec(nn.Embedding, vocab, hidden) with an untied head, or drop "
                            "the embedding's split")
    typ = getattr(spec, "typename", None)
    if not (isinstance(spec, LayerSpec) and isinstance(typ, type) and issubclass(typ, nn.Embedding)
            and typ.forward is nn.Embedding.forward):
        name = typ.__name__ if isinstance(typ, type) else type(spec).__name__
        raise OctoPipeError(f"{what} is {name}: a split embedding is a LayerSpec(nn.Embedding, vocab, hidden) (its "
                            "rows are what the shards hold); drop the embedding's split for another first layer")
    try:
        with torch.device("meta"):  # no memory, no init compute: only the options, shape and dtype are read
            module = spec.build()
    except Exception as exc:  # noqa: BLE001 - the refusal names it
        raise OctoPipeError(f"{what}: building {typ.__name__} on the meta device failed ({type(exc).__name__}: "
                            f"{exc}); drop the embedding's split") from None
    used = [o for o in _EMBEDDING_OPTIONS if getattr(module, o, None) is not None and getattr(module, o) is not False]
    if used:
        raise OctoPipeError(f"{what} is an nn.Embedding with {used[0]}={getattr(module, used[0])!r}: the shards "
                            f"look rows up and add their gradients as a plain nn.Embedding; drop {used[0]} or the "
                            "embedding's split")
    return int(module.num_embeddings), int(module.embedding_dim), module.weight.dtype


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
        raise OctoPipeError(f"{what} is TiedLayerSpec {spec.key!r}: a tied head is split by _tied_head")
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


def _is_tied(spec) -> bool:
    from deepspeed.pipe import TiedLayerSpec

    return isinstance(spec, TiedLayerSpec)


_PROBE_ROWS = 64  # rows of the tied weight the probe uses: its cost stays small at any vocabulary
_PROBE_TOL = 1e-5  # relative to the largest logit: a forward_fn casting to float32 passes, a scale of 1.0001 fails
_FIX = ("a split head tied to its embedding computes x @ weight^T exactly (forward_fn=lambda m, x: "
        "F.linear(x, m.weight)); fold anything else into the layer before it, untie the head (LayerSpec(nn.Linear, "
        "hidden, vocab, bias=False)), or drop the split")


def _tied_head(plan, specs, layer_of_spec, index: int) -> tuple[TiedHead, tuple[int, int]]:
    """The tie of a TiedLayerSpec head and its (vocab, hidden), or the refusal naming what it is instead."""
    spec = specs[index]
    what = f"list entry {index} (the split LM head, TiedLayerSpec {spec.key!r})"
    entries = tuple(i for i in range(index) if _is_tied(specs[i]) and specs[i].key == spec.key)
    if not entries:
        raise OctoPipeError(f"{what}: its key names no earlier entry, so nothing is tied to it; give the embedding "
                            "the same key, or make the head LayerSpec(nn.Linear, hidden, vocab, bias=False)")
    if len(spec.tied_weight_attr) != 1:
        raise OctoPipeError(f"{what}: tied_weight_attr {list(spec.tied_weight_attr)}: a split tied head ties one "
                            "weight (its rows are what the shards hold); tie only the projection's weight, or drop "
                            "the split")
    if spec.forward_fn is None:
        raise OctoPipeError(f"{what} has no forward_fn: it runs the tied module's own forward (the embedding "
                            f"lookup), not a projection; {_FIX}")
    attr = spec.tied_weight_attr[0]
    vocab, hidden, dtype = _probe_projection(spec, attr, what)
    starts = layer_starts(layer_of_spec, plan.stages[-1].end) if layer_of_spec is not None else None
    holders = sorted({_entry_device(plan, starts, i) for i in entries})
    if len(holders) != 1:
        raise OctoPipeError(f"{what}: the tied weight is held whole by pipeline ranks {holders} (entries "
                            f"{list(entries)}); a split head tied to it needs one holder (place those entries on one "
                            "device, or drop the split)")
    file_entry = next((i for i in entries if specs[i].forward_fn is None), None)
    return TiedHead(key=spec.key, attr=attr, entries=entries, full_device=holders[0], file_entry=file_entry,
                    dtype=dtype), (vocab, hidden)


def _entry_device(plan, starts, entry: int) -> int:
    """The device of the plan's stage holding list entry `entry` (starts: the entries' layer starts, None: one each)."""
    for st in plan.stages:
        lo, hi = (starts[st.start], starts[st.end]) if starts is not None else (st.start, st.end)
        if lo <= entry < hi:
            return st.device
    raise OctoPipeError(f"list entry {entry} is in no stage of the plan")


def _probe_projection(spec, attr: str, what: str) -> tuple[int, int, torch.dtype]:
    """(vocab, hidden, dtype) of the tied weight, once forward_fn(module, x) is checked to be x @ weight^T."""
    try:
        with torch.device("meta"):  # no memory, no init compute: only the weight's shape and dtype are read
            module = spec.build()
        *path, name = attr.split(".")
        parent = module
        for part in path:
            parent = getattr(parent, part)
        weight = getattr(parent, name)
    except Exception as exc:  # noqa: BLE001 - the refusal names it
        raise OctoPipeError(f"{what}: reading its tied weight {attr!r} from {spec.typename.__name__} built on the "
                            f"meta device failed ({type(exc).__name__}: {exc}); {_FIX}") from None
    if not (torch.is_tensor(weight) and weight.dim() == 2):
        raise OctoPipeError(f"{what}: its tied weight {attr!r} is "
                            f"{tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__}, not a "
                            f"[vocab, hidden] matrix; {_FIX}")
    vocab, hidden = (int(n) for n in weight.shape)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(min(vocab, _PROBE_ROWS), hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 3, hidden, generator=gen, dtype=torch.float64)
    setattr(parent, name, nn.Parameter(w, requires_grad=False))
    try:
        with torch.no_grad():
            out = spec.forward_fn(module, x)
    except Exception as exc:  # noqa: BLE001 - the refusal names it
        raise OctoPipeError(f"{what}: its forward_fn on (module, x) raised {type(exc).__name__}: {exc}; it is no "
                            f"plain projection with {attr!r}; {_FIX}") from None
    want = x @ w.t()
    if not (torch.is_tensor(out) and tuple(out.shape) == tuple(want.shape)):
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise OctoPipeError(f"{what}: its forward_fn returns {got} where x @ {attr}^T is {tuple(want.shape)}; {_FIX}")
    out = out.detach().to(torch.float64)
    scale = float(want.abs().max())
    err = float((out - want).abs().max())
    if err > _PROBE_TOL * scale:
        ratio = float((out * want).sum() / (want * want).sum())
        if float((out - ratio * want).abs().max()) <= _PROBE_TOL * scale:
            instead = f"x @ {attr}^T times {ratio:.6g} (a scaled projection)"
        else:
            instead = f"something other than x @ {attr}^T (off by {err:.3g} of {scale:.3g})"
        raise OctoPipeError(f"{what}: its forward_fn computes {instead}; {_FIX}")
    return vocab, hidden, weight.dtype


def build_shard(module, placement: HeadPlacement) -> HeadShard | None:
    """This rank's HeadShard: the head (or embedding) built whole under DeepSpeed's seed rule, cut to the rank's rows
    (None where it holds none: a rank that builds the entry only for its random draws); of a tied head, its rows of
    the tied weight (filled by the module from the weight's holder after DeepSpeed's tied sync)."""
    from deepspeed.runtime import utils as ds_utils

    if placement.tied is not None:
        lo, hi = placement.rows
        shard = HeadShard(torch.zeros((hi - lo, placement.hidden), dtype=placement.tied.dtype), (lo, hi))
        for p in shard.parameters():
            p.ds_pipe_replicated = True  # copies of the tied weight's rows: the whole weight counts them in norms
        return shard
    if module.seed_layers:
        seed = module.base_seed + placement.index
        (module.seed_fn or ds_utils.set_random_seed)(seed)
    full = module._layer_specs[placement.index].build()
    if placement.rows is None:
        return None
    lo, hi = placement.rows
    shard = HeadShard(full.weight[lo:hi], (lo, hi))
    for p in shard.parameters():
        p.ds_pipe_replicated = False  # as PipelineModule._build marks every pipeline parameter
    return shard
