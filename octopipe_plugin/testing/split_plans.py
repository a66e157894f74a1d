"""A plan that splits a model's LM head over every device, for the stand-in benchmarks' tests.

A short tune may keep the plan without splits; these tests need a split plan whatever the tuner
would choose: a built-in schedule's stages with the head's rows in equal shares over every
device, its shard actions placed by the split scheduler (tuner/split_sched.py `insert_shards`).
"""

from __future__ import annotations

from dataclasses import replace

from ..formats.splits import SplitLayer


def head_split_plan(model, cluster, microbatches: int, schedule: str = "1f1b"):
    """`schedule`'s plan on `cluster` with `model`'s LM head split in equal shares over every device."""
    from ..schedules.registry import build_plan
    from ..tuner.split import splittable_head, stats_bytes
    from ..tuner.split_sched import ShardPolicy, insert_shards

    head = splittable_head(model)
    if head is None:
        raise ValueError(f"model {model.name!r}: its last layer is no lm_head to split")
    nd = cluster.num_devices
    split = SplitLayer(layer=head, devices=tuple(range(nd)), shares=tuple(1.0 / nd for _ in range(nd)),
                       stats_bytes=stats_bytes(model))
    plan = build_plan(model, schedule, nd, microbatches)
    out = insert_shards(model, cluster, replace(plan, splits=(split,)), ShardPolicy())
    if out is None:
        raise ValueError(f"could not place the shard actions of {model.name!r}'s head into the {schedule} plan")
    return out
