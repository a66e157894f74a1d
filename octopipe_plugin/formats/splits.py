"""Split layers of a plan: a vocabulary layer (LM head, embedding) divided by rows over several devices.

One record per split layer (`Plan.splits`, the plan document's optional `splits`): which layer,
over which devices, with which share of its rows each, and the bytes of the softmax statistics
the head's shards exchange. Which layers may be split and at which end of the model they sit is
decided here (`SPLITTABLE`, `side_of`); the shard kinds they run are in `actions.RULES`.
docs/formats.md, "Split layers", defines the semantics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..actions import Kind
from ..errors import FormatError, PlanError
from .fields import check_value, objects

# Layer kinds whose work divides by rows of their weight (the vocabulary), and the end of the model they sit at.
SPLITTABLE = {"lm_head": "output", "embedding": "input"}
SHARE_TOLERANCE = 1e-6  # shares must sum to 1 within this
# The shard kinds an evaluation (forward-only) step runs: the head's H and J (the loss; no partial goes back,
# no K) and the embedding's E (no G).
FORWARD_SHARD_KINDS = (Kind.H, Kind.J, Kind.E)
# Per token, the softmax statistics one head shard sends each other (fp32 max, sum of exponentials, target
# logit), and the loss terms the head's input carries besides the hidden states (int64 target, fp32 coefficient).
STATS_BYTES_PER_TOKEN = 12
LOSS_TERMS_BYTES_PER_TOKEN = 12


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitLayer:
    """Layer `layer` split over `devices`, device `devices[j]` holding `shares[j]` of its rows."""

    layer: int
    devices: tuple[int, ...]
    shares: tuple[float, ...]
    stats_bytes: int = 0  # per micro-batch, what one head shard sends each other shard (max, sum-exp, target logit)

    def share_of(self, device: int) -> float:
        """The device's share of the rows (0 when it holds no shard)."""
        return self.shares[self.devices.index(device)] if device in self.devices else 0.0


def row_range(split: SplitLayer, num_rows: int, device: int) -> tuple[int, int] | None:
    """Rows [lo, hi) of a `num_rows`-row weight that `device` holds: the shards in `devices` order, each cut at
    round(num_rows x the running sum of the shares) (None when the device holds no shard)."""
    if device not in split.devices:
        return None
    j = split.devices.index(device)
    cut = [0] + [round(num_rows * sum(split.shares[:k + 1])) for k in range(len(split.shares) - 1)] + [num_rows]
    return cut[j], cut[j + 1]


def loss_terms_bytes(split: SplitLayer) -> int:
    """Bytes of the loss terms the head-input message carries besides the hidden states (docs/formats.md, "Split
    layers", Messages): LOSS_TERMS_BYTES_PER_TOKEN per token, the tokens being those of the statistics
    (`stats_bytes` / STATS_BYTES_PER_TOKEN); 0 for the embedding."""
    return split.stats_bytes // STATS_BYTES_PER_TOKEN * LOSS_TERMS_BYTES_PER_TOKEN


def side_of(split: SplitLayer, num_layers: int) -> str | None:
    """'input' for layer 0, 'output' for the last layer, None elsewhere (not splittable by position)."""
    if split.layer == num_layers - 1 and num_layers > 1:
        return "output"
    if split.layer == 0 and num_layers > 1:
        return "input"
    return None


def owner_stage(split: SplitLayer, stages) -> int:
    """The stage that owns the split layer: stage 0 for the embedding, the last stage for the head."""
    return 0 if split.layer == 0 else len(stages) - 1


def split_problem(splits, stages, num_devices: int) -> str | None:
    """Why `splits` do not fit the plan's stages and devices (one sentence), or None."""
    if not splits:
        return None
    num_layers = stages[-1].end if stages else 0
    seen = set()
    for i, sp in enumerate(splits):
        where = f"splits[{i}] (layer {sp.layer})"
        side = side_of(sp, num_layers)
        if side is None:
            return f"{where}: a split layer must be layer 0 (embedding) or the last layer {num_layers - 1} (LM head)"
        if side in seen:
            return f"{where}: layer {sp.layer} is split twice"
        seen.add(side)
        own = stages[owner_stage(sp, stages)]
        if not own.start <= sp.layer < own.end:
            return f"{where}: its owner stage {owner_stage(sp, stages)} holds layers [{own.start}, {own.end}), not {sp.layer}"
        if not sp.devices or len(set(sp.devices)) != len(sp.devices):
            return f"{where}: expected distinct devices, got {list(sp.devices)}"
        bad = [d for d in sp.devices if not 0 <= d < num_devices]
        if bad:
            return f"{where}: device {bad[0]} is not in 0..{num_devices - 1}"
        if len(sp.shares) != len(sp.devices):
            return f"{where}: expected one share per device ({len(sp.devices)}), got {len(sp.shares)}"
        if any(not (s > 0 and math.isfinite(s)) for s in sp.shares):
            return f"{where}: expected shares > 0, got {list(sp.shares)}"
        if abs(sum(sp.shares) - 1.0) > SHARE_TOLERANCE:
            return f"{where}: expected shares summing to 1, got {sum(sp.shares):.6f}"
        if sp.stats_bytes < 0:
            return f"{where}: expected stats_bytes >= 0, got {sp.stats_bytes}"
    return None


def check_model_splits(model, splits) -> None:
    """Raise PlanError unless every split layer is of a splittable kind at its end of the model."""
    for sp in splits:
        if not 0 <= sp.layer < model.num_layers:
            raise PlanError(f"split layer {sp.layer}: the model {model.name!r} has layers 0..{model.num_layers - 1}")
        kind = model.layers[sp.layer].kind
        side = side_of(sp, model.num_layers)
        if SPLITTABLE.get(kind) != side:
            want = " or ".join(f"{k!r} as the {'first' if s == 'input' else 'last'} layer" for k, s in SPLITTABLE.items())
            raise PlanError(f"split layer {sp.layer} is a {kind!r} layer; a split layer is {want} "
                            f"(fix: split the model's embedding or lm_head, or drop `splits`)")


def splits_from_list(raw, src: str, path: str = "$.splits") -> tuple[SplitLayer, ...]:
    """Read the plan document's `splits` list, refusing bad fields with file, path and expectation."""
    out = []
    for p, item in objects({"splits": raw}, "splits", src):
        p = path + p[len("$.splits"):]
        layer = check_value(item.get("layer"), src, f"{p}.layer", int, minimum=0)
        devs = item.get("devices")
        if not isinstance(devs, list) or not devs:
            raise FormatError(src, f"{p}.devices", "a non-empty list of device numbers", devs)
        devices = tuple(check_value(d, src, f"{p}.devices[{j}]", int, minimum=0) for j, d in enumerate(devs))
        shares = item.get("shares")
        if not isinstance(shares, list) or len(shares) != len(devices):
            raise FormatError(src, f"{p}.shares", f"a list of {len(devices)} shares (one per device)", shares)
        vals = tuple(float(check_value(s, src, f"{p}.shares[{j}]", float, minimum=0.0)) for j, s in enumerate(shares))
        stats = check_value(item.get("stats_bytes", 0), src, f"{p}.stats_bytes", int, minimum=0)
        out.append(SplitLayer(layer=layer, devices=devices, shares=vals, stats_bytes=stats))
    return tuple(out)


def splits_to_list(splits) -> list[dict]:
    """The plan document's `splits` list."""
    return [{"layer": sp.layer, "devices": list(sp.devices), "shares": [round(s, 9) for s in sp.shares],
             "stats_bytes": sp.stats_bytes} for sp in splits]
