"""Make `deepspeed.initialize` build OctoPipeEngine when the config's "octopipe" block is enabled.

deepspeed.initialize picks its pipeline engine by the module-level name `deepspeed.PipelineEngine`
(deepspeed/__init__.py: `DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine`),
so that name becomes a chooser: OctoPipeEngine for a module built at a plan, DeepSpeed's own
engine for anything else. `deepspeed.initialize` itself is wrapped so that a plain PipelineModule
passed with an enabled block is rebuilt at the plan first (same layer list, loss, seeds and
checkpointing settings). Without the block, or with "enabled": false, nothing changes.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import torch

log = logging.getLogger(__name__)
_MARK = "_octopipe_installed"


def install() -> None:
    """Patch deepspeed's engine choice and initialize (idempotent)."""
    import deepspeed

    if getattr(deepspeed, _MARK, False):
        return
    stock = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = _chooser(stock)
    stock.load_checkpoint = _mapped_load(stock.load_checkpoint)
    deepspeed.initialize = _wrap_initialize(deepspeed.initialize)
    setattr(deepspeed, _MARK, True)


def _chooser(stock):
    from .engine import OctoPipeEngine
    from .module import OctoPipePipelineModule

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, stock)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, stock)

    class PipelineEngine(metaclass=_Meta):
        """DeepSpeed's PipelineEngine, or OctoPipeEngine for a module built at an OctoPipe plan."""

        def __new__(cls, *args, **kwargs):
            model = kwargs.get("model")
            planned = isinstance(model, OctoPipePipelineModule) and model.octopipe_plan is not None
            return (OctoPipeEngine if planned else stock)(*args, **kwargs)

    return PipelineEngine


def _mapped_load(load):
    """PipelineEngine.load_checkpoint mapping optimizer state by name when OctoPipe wrote the checkpoint."""

    @functools.wraps(load)
    def wrapped(self, load_dir, tag=None, **kwargs):
        from .checkpoint import RECORD, load_checkpoint, read_tag

        t = read_tag(load_dir, tag)
        if t is None or not os.path.exists(os.path.join(load_dir, t, RECORD.format(0))):
            return load(self, load_dir, tag, **kwargs)  # not written by OctoPipe: DeepSpeed's own behaviour
        return load_checkpoint(self, functools.partial(load, self), load_dir, tag=tag, **kwargs)

    return wrapped


def _config_dict(config, config_params, args):
    cfg = config if config is not None else config_params
    if cfg is None and args is not None:
        cfg = getattr(args, "deepspeed_config", None)
    if isinstance(cfg, str):
        with open(cfg, encoding="utf-8") as fh:
            return json.load(fh)
    return cfg if isinstance(cfg, dict) else None


def _wrap_initialize(initialize):
    @functools.wraps(initialize)
    def wrapped(*args, **kwargs):
        from deepspeed.runtime.pipe.module import PipelineModule

        from .config import parse_block
        from .module import OctoPipePipelineModule

        model = kwargs.get("model")
        cfg = _config_dict(kwargs.get("config"), kwargs.get("config_params"), kwargs.get("args"))
        if (isinstance(model, PipelineModule) and cfg is not None and parse_block(cfg) is not None
                and not (isinstance(model, OctoPipePipelineModule) and model.octopipe_plan is not None)):
            planned = rebuild_at_plan(model, cfg)
            kwargs["model"] = planned
            params = kwargs.get("model_parameters")
            if params is not None:
                # the optimizer must hold the rebuilt module's parameters, not the discarded module's
                old = {id(p) for p in model.parameters()}
                params = list(params)
                if all(isinstance(p, torch.Tensor) and id(p) in old for p in params):
                    kwargs["model_parameters"] = [p for p in planned.parameters() if p.requires_grad]
                else:
                    kwargs["model_parameters"] = params
        return initialize(*args, **kwargs)

    return wrapped


def rebuild_at_plan(model, ds_config: dict):
    """A PipelineModule's layer list rebuilt as an OctoPipePipelineModule at the config's plan."""
    from .module import OctoPipePipelineModule

    from deepspeed.runtime.pipe.module import PipelineModule

    if type(model) is not PipelineModule:
        log.warning("octopipe: rebuilding %s from its layer list; build OctoPipePipelineModule(config=...) "
                    "directly to keep what its own __init__ adds", type(model).__name__)
    log.info("octopipe: rebuilding the PipelineModule at the plan of the config's octopipe block")
    return OctoPipePipelineModule(
        model._layer_specs, config=ds_config, topology=model._topo, loss_fn=model.loss_fn,
        seed_layers=model.seed_layers, seed_fn=model.seed_fn, base_seed=model.base_seed,
        activation_checkpoint_interval=model.activation_checkpoint_interval,
        activation_checkpoint_func=model.activation_checkpoint_func,
        checkpointable_layers=model.checkpointable_layers, dynamic_shape=model.dynamic_shape)
