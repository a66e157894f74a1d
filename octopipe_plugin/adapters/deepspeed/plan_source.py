"""Where a DeepSpeed run's plan comes from: a given plan, or tuning on rank 0 at start-up.

Every rank ends with the same plan: rank 0 reads or tunes it, broadcasts its document and
writes it to `save_plan`; the others parse what they receive. The micro-batch count of a
tuned plan is DeepSpeed's gradient_accumulation_steps.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist

from ...errors import FormatError, OctoPipeError
from ...formats import plan_from_dict, plan_to_dict, read_plan, write_plan
from .config import CONFIG_KEY, OctoPipeBlock, check_microbatches, parse_block

log = logging.getLogger(__name__)


def gradient_accumulation_steps(ds_config: dict, world_size: int, pipe_size: int) -> int:
    """gradient_accumulation_steps as DeepSpeed derives it from the batch-size fields of a config."""
    gas = ds_config.get("gradient_accumulation_steps")
    if gas is not None:
        return int(gas)
    dp = max(1, world_size // pipe_size)
    total, mbs = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    if total is None or mbs is None:
        return 1
    return int(total) // (int(mbs) * dp)


def resolve_plan(layers, *, plan=None, config: dict | None = None, layer_of_spec=None, costs=None):
    """(plan, block, layer_of_spec) for the module: the given plan, or the config block's plan or tuning.

    `costs` supplies layer costs for tuning (see graph.model_from_specs)."""
    if plan is not None:
        return plan, None, tuple(layer_of_spec) if layer_of_spec is not None else None
    block = parse_block(config)
    if block is None:
        raise FormatError("ds_config", f"$.{CONFIG_KEY}", 'an enabled block like {"plan": "plan.json"}', None)
    owners = layer_of_spec if layer_of_spec is not None else block.layer_of_spec
    doc = [None]
    if dist.get_rank() == 0:
        doc[0] = plan_to_dict(_rank0_plan(layers, block, config, owners, costs))
    dist.broadcast_object_list(doc, src=0)
    result = plan_from_dict(doc[0], "plan broadcast by rank 0")
    gas = gradient_accumulation_steps(config, dist.get_world_size(), result.num_devices)
    check_microbatches(result.num_microbatches, gas)
    return result, block, tuple(owners) if owners is not None else None


def _rank0_plan(layers, block: OctoPipeBlock, config: dict, owners, costs=None):
    """Read or tune the plan (rank 0 only) and save it where the block asks."""
    if block.plan is not None:
        result = read_plan(block.plan)
    else:
        result = tune_at_startup(layers, block, config, owners, costs)
    if block.save_plan:
        write_plan(result, block.save_plan)
        log.info("octopipe: plan written to %s", block.save_plan)
    return result


def tune_at_startup(layers, block: OctoPipeBlock, config: dict, owners, costs=None):
    """Tune a plan for the module's layers on the block's cluster (called on rank 0)."""
    from ...costs import resolve_cluster, resolve_model
    from ...tuner import tune

    from ...headroom import parse_headroom, with_headroom

    spec = block.tune
    where = f"ds_config: $.{CONFIG_KEY}.tune.memory_headroom"
    cluster = with_headroom(resolve_cluster(spec.cluster), parse_headroom(spec.memory_headroom, where), where)
    world = dist.get_world_size()
    pipe = cluster.num_devices
    if world % pipe:
        raise FormatError("ds_config", f"$.{CONFIG_KEY}.tune.cluster",
                          f"a cluster whose device count divides the {world} ranks (one pipeline of it per "
                          "data-parallel replica)", f"{pipe} devices")
    m = gradient_accumulation_steps(config, world, pipe)
    if block.model is not None:
        model = resolve_model(block.model, gpu=spec.gpu)
    elif spec.profile:
        model = profile_specs(layers, spec, micro_batch_size=int(config.get("train_micro_batch_size_per_gpu", 1)))
    else:
        from .graph import model_from_specs

        model = model_from_specs(layers, gpu=spec.gpu, seq_len=spec.seq_len, costs=costs,
                                 micro_batch_size=int(config.get("train_micro_batch_size_per_gpu", 1)))
    expected = len(layers) if owners is None else max(owners) + 1
    if model.num_layers != expected:
        raise OctoPipeError(f"ds_config: $.{CONFIG_KEY}.model has {model.num_layers} layers, the PipelineModule "
                            f"has {expected} (give layer_of_spec to map list entries onto the model's layers)")
    log.info("octopipe: tuning %d layers on %s for %d micro-batches (%.0f s budget)", model.num_layers,
             spec.cluster, m, spec.time_budget_s)
    result = tune(model, cluster, m, time_budget_s=spec.time_budget_s, seed=spec.seed).plan
    return replace(result, model=result.model or model.name)


def profile_specs(layers, spec, *, micro_batch_size: int = 1):
    """The layer list measured on this device (`tune.profile`): a Model whose layers say source "measured"."""
    import torch

    from ...profile import ProfileSettings
    from .profile import profile_layer_list

    if spec.profile_input is not None:
        shape = spec.profile_input

        def example(device):
            return torch.randn(*shape, device=device, generator=torch.Generator().manual_seed(0)).to(device)
    else:
        vocab = _first_vocab(layers)

        def example(device):
            gen = torch.Generator().manual_seed(0)
            return torch.randint(0, vocab, (micro_batch_size, spec.seq_len), generator=gen).to(device)

    result = profile_layer_list(layers, example, name="deepspeed-pipeline",
                                settings=ProfileSettings(repeats=spec.profile_repeats))
    log.info("octopipe: profiled %d layers (%d measured, %d from the cache) on %s", result.stats.layers,
             result.stats.measured, result.stats.cache_hits, result.model.meta["profile"]["device"])
    return result.model


def _first_vocab(layers) -> int:
    """Vocabulary size of a first-entry embedding, whose token ids are the default profiling input."""
    from torch import nn

    first = layers[0] if layers else None
    typ = getattr(first, "typename", None) or type(first)
    if isinstance(typ, type) and issubclass(typ, nn.Embedding):
        if isinstance(first, nn.Embedding):
            return first.num_embeddings
        args, kwargs = tuple(first.module_args), dict(first.module_kwargs)
        return int(kwargs.get("num_embeddings", args[0] if args else 1))
    raise FormatError("ds_config", f"$.{CONFIG_KEY}.tune.profile_input",
                      "the shape of the first layer's input (its first entry is no embedding, so token ids "
                      "cannot serve)", None)
