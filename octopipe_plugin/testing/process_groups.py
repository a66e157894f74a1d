"""One rule for the test harnesses that run many scenarios in one spawn: which process groups a finished one drops.

Each scenario (a Megatron parallel state, a DeepSpeed engine's pipeline grid) makes new gloo groups, 3 threads
each, and neither framework's teardown destroys them (Megatron's destroy_model_parallel only drops its
references): over a spawn they pile up (measured: 1196 threads in one rank of a head-shard spawn). The harnesses
snapshot the live groups before a scenario and destroy, after it, the ones made since, except the groups made to
be reused for the rest of the process: the executor's per-direction groups (executor.default_cache) and
DeepSpeed's module-level ones (deepspeed.utils.groups, when DeepSpeed is loaded).
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist


def live_groups() -> set:
    """The process groups alive now (the default one included)."""
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map) if dist.is_initialized() else set()


def _reused() -> set:
    """Groups made once per process and reused by later scenarios."""
    from octopipe_plugin.executor import default_cache

    cache = default_cache()
    kept = set(cache.groups.values()) | set(cache.shard_sets.values())  # pair groups, split heads' gather groups
    groups = sys.modules.get("deepspeed.utils.groups")  # never imported here: a Megatron spawn has no DeepSpeed
    for value in vars(groups).values() if groups is not None else ():
        for group in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(group, dist.ProcessGroup):
                kept.add(group)
    return kept


def destroy_groups_since(before: set) -> None:
    """Destroy the process groups made since the snapshot `before` (live_groups()), but those made to be reused.

    Destroying a group only unregisters it: its gloo threads end when the last reference to it goes, the
    scenario's models and optimizers (their modules' reference cycles: freed by a collection, run here)."""
    for group in live_groups() - before - _reused():
        dist.destroy_process_group(group)
    gc.collect()
