"""Where a DeepSpeed run's plan comes from: a given plan, or the config block's plan file or tuning.

Through the framework-neutral start-up service (`octopipe_plugin.plan_startup`): rank 0 reads
or tunes the plan, checks it against the run (plan_check: layers, micro-batches, pipeline and
world sizes) and saves it to `save_plan`; every rank gets the plan, or rank 0's one-line error,
so a missing plan file or a plan for another model ends every rank with the same message instead
of leaving the others waiting. The micro-batch count of a tuned plan is DeepSpeed's
gradient_accumulation_steps.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist

from ...errors import FormatError, OctoPipeError
from ...plan_startup import PlanSteps, plan_at_startup
from .config import CONFIG_KEY, OctoPipeBlock, parse_block, refused
from .moe_pairs import moe_entries
from .plan_check import RunShape, check_plan, gradient_accumulation_steps

log = logging.getLogger(__name__)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def resolve_plan(layers, *, plan=None, config: dict | None = None, layer_of_spec=None, costs=None,
                 pipe_size: int | None = None):
    """(plan, block, layer_of_spec) for the module: the given plan, or the config block's plan or tuning.

    `costs` supplies layer costs for tuning (see graph.model_from_specs); `pipe_size` is the
    topology's pipeline dimension when the module was given one (None: taken from the plan).
    Any refusal is a BlockRefused with the same line on every rank."""
    try:
        return _resolve(list(layers), plan, config, layer_of_spec, costs, pipe_size)
    except OctoPipeError as exc:
        raise refused(exc) from None


def _resolve(layers, plan, config, layer_of_spec, costs, pipe_size):
    if plan is not None:
        owners = tuple(layer_of_spec) if layer_of_spec is not None else None
        check_plan(plan, RunShape(len(layers), owners, pipe_size, _world(), None, moe_entries(layers)), "plan=")
        return plan, None, owners
    block = parse_block(config)
    if block is None:
        raise FormatError("ds_config", f"$.{CONFIG_KEY}", 'an enabled block like {"plan": "plan.json"}', None)
    owners = layer_of_spec if layer_of_spec is not None else block.layer_of_spec
    owners = tuple(owners) if owners is not None else None
    world = _world()

    def check(candidate, source: str) -> None:
        gas = gradient_accumulation_steps(config, world, pipe_size or candidate.num_devices)
        check_plan(candidate, RunShape(len(layers), owners, pipe_size, world, gas, moe_entries(layers)), source)

    steps = PlanSteps(
        plan_file=block.plan,
        tune=(lambda: tune_at_startup(layers, block, config, owners, costs)) if block.tune is not None else None,
        check=check, save_to=(block.save_plan,) if block.save_plan else (),
        missing='"plan" or "tune" in the config\'s "octopipe" block', plan_field=("ds_config", f"$.{CONFIG_KEY}.plan"))
    result, _ = plan_at_startup(steps)
    return result, block, owners


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
