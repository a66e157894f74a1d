"""Every DeepSpeed name OctoPipe replaces, in one registry (`installed()` lists them).

`deepspeed.initialize` picks its pipeline engine by two module-level names of the `deepspeed`
package (deepspeed/__init__.py:586: `DualPipeVEngine if isinstance(model, DualPipeVModule) else
PipelineEngine`) and passes the model, the config dict and the rest as keywords. Those two names
are the only ones replaced, so the choice is made however `initialize` was reached: the model
positional or keyword, `from deepspeed import initialize` done before or after
`import octopipe_plugin.deepspeed` (the function looks the names up at call time).

- `deepspeed.PipelineEngine`: without an enabled "octopipe" block, DeepSpeed's own engine (a
  checkpoint written by OctoPipe then loads its optimizer state by parameter name, every other
  checkpoint as DeepSpeed loads it). With one: OctoPipeEngine, after the supported-version check;
  a PipelineModule not built at the plan is rebuilt from its layer list at the plan (the same
  seeds and settings) or refused with the reason and the fix.
- `deepspeed.DualPipeVEngine`: DeepSpeed's own, unless the block is enabled: refused (a
  DualPipeVModule fixes DeepSpeed's DualPipeV schedule; the plan cannot replace it).

Every refusal is a BlockRefused: one line, the same on every rank.
"""

from __future__ import annotations

import functools
import os
import types

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from ..patching import Patches
from .checkpoint import RECORD, load_checkpoint as load_mapped, read_tag
from .config import BlockRefused, parse_block, refused
from .engine import OctoPipeEngine
from .module import OctoPipePipelineModule, rebuild_at_plan
from .shm import release_shm_buffers
from .versions import UnsupportedVersion, check_installed

PATCHES = Patches("deepspeed")
_NAMES = ("PipelineEngine", "DualPipeVEngine")


def install() -> None:
    """Replace deepspeed.PipelineEngine and deepspeed.DualPipeVEngine by the choosers (idempotent)."""
    import deepspeed

    missing = [n for n in _NAMES if not hasattr(deepspeed, n)]
    if missing:  # another DeepSpeed: nothing is patched
        raise UnsupportedVersion(f"octopipe: DeepSpeed {deepspeed.__version__} has no deepspeed.{missing[0]}; "
                                 "the adapter supports the versions named in adapters/deepspeed/versions.py")
    PATCHES.replace(deepspeed, "PipelineEngine", _pipeline_chooser,
                    "OctoPipeEngine when the config's octopipe block is enabled, DeepSpeed's engine otherwise")
    PATCHES.replace(deepspeed, "DualPipeVEngine", _dualpipev_guard,
                    "refuses an enabled octopipe block on a DualPipeVModule (DeepSpeed's own engine otherwise)")


def installed() -> list[str]:
    """The replaced DeepSpeed names, one line each: `name: why`."""
    return PATCHES.installed()


def uninstall() -> None:
    """Restore DeepSpeed's own names (tests)."""
    PATCHES.uninstall()


def _block(kwargs):
    """The enabled block of the engine's config (initialize has already loaded it to a dict), or None."""
    cfg = kwargs.get("config")
    try:
        return parse_block(cfg) if isinstance(cfg, dict) else None
    except Exception as exc:  # noqa: BLE001 - a malformed block is refused, never ignored
        raise refused(exc) from None


class _Like(type):
    """isinstance/issubclass answer as for DeepSpeed's class the chooser stands for."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._stock)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls._stock)


def _pipeline_chooser(stock):
    class PipelineEngine(metaclass=_Like):
        """DeepSpeed's PipelineEngine, or OctoPipeEngine when the config's octopipe block is enabled."""

        _stock = stock

        def __new__(cls, *args, **kwargs):
            model = kwargs.get("model")
            planned = isinstance(model, OctoPipePipelineModule) and model.octopipe_plan is not None
            if _block(kwargs) is None and not planned:
                return _mapping_octopipe_checkpoints(stock(*args, **kwargs))
            release_shm_buffers()  # an OctoPipe run, refused below or not: DeepSpeed's CPU shm buffers out of /dev/shm
            try:
                check_installed()
                if not planned:
                    kwargs = _rebuilt(kwargs)
            except BlockRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - one line on every rank, whatever went wrong
                raise refused(exc) from None
            return OctoPipeEngine(*args, **kwargs)

    return PipelineEngine


def _dualpipev_guard(stock):
    class DualPipeVEngine(metaclass=_Like):
        """DeepSpeed's DualPipeVEngine; an enabled octopipe block is refused."""

        _stock = stock

        def __new__(cls, *args, **kwargs):
            if _block(kwargs) is not None:
                raise BlockRefused(
                    "ds_config: field $.octopipe: the model is a DualPipeVModule, which fixes DeepSpeed's DualPipeV "
                    "schedule; build it as a PipelineModule (the same layer list) to run the OctoPipe plan, or set "
                    '"octopipe": {"enabled": false} to run DualPipeV')
            return stock(*args, **kwargs)

    return DualPipeVEngine


# ---- a module not built at the plan ---------------------------------------------------------------------
def _rebuilt(kwargs: dict) -> dict:
    """initialize's keywords with the model rebuilt at the block's plan (and the optimizer's parameters)."""
    model = kwargs.get("model")
    if not isinstance(model, PipelineModule):
        raise BlockRefused(f"ds_config: field $.octopipe: the model is a {type(model).__name__}, not a "
                           "PipelineModule; the plan needs the layer list of a PipelineModule")
    _refuse_overrides(type(model))
    old = {id(p) for p in model.parameters()}
    held = _client_objects(kwargs, old)
    if held:
        raise BlockRefused(
            f"deepspeed.initialize: the {held} holds the PipelineModule's own parameters, which the rebuild at the "
            "OctoPipe plan replaces; give the optimizer (and scheduler) in the config or as callables, or build "
            "octopipe_plugin.deepspeed.OctoPipePipelineModule(layers, config=ds_config, ...) before creating them")
    planned = rebuild_at_plan(model, kwargs["config"])
    out = dict(kwargs, model=planned, mpu=planned.mpu())  # initialize passed the discarded module's grid
    params = kwargs.get("model_parameters")
    if params is not None:
        out["model_parameters"] = _remapped(list(params), old, planned)
    return out


def _refuse_overrides(cls) -> None:
    """A PipelineModule subclass is rebuilt from its layer list only when it overrides nothing but __init__."""
    overridden = []
    for klass in cls.__mro__:
        if klass in (PipelineModule, OctoPipePipelineModule) or not issubclass(klass, PipelineModule):
            break
        overridden += [n for n, v in vars(klass).items()
                       if n != "__init__" and callable(v) and hasattr(PipelineModule, n)]
    if overridden:
        raise BlockRefused(
            f"ds_config: field $.octopipe: {cls.__name__} overrides PipelineModule.{overridden[0]}, which a rebuild "
            f"at the plan from its layer list would drop; subclass octopipe_plugin.deepspeed.OctoPipePipelineModule "
            'instead (it takes config=ds_config), or set "octopipe": {"enabled": false}')


def _client_objects(kwargs: dict, old: set[int]) -> str | None:
    opt, sched = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
    if isinstance(opt, torch.optim.Optimizer) and any(id(p) in old for g in opt.param_groups for p in g["params"]):
        return "optimizer object"
    if sched is not None and not callable(sched):  # a callable is called on the rebuilt module's optimizer
        return "lr_scheduler object"
    return None


def _remapped(params: list, old: set[int], planned) -> list:
    """The optimizer's parameters: the rebuilt module's when the list named the old module's."""
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    if tensors and len(tensors) == len(params) and all(id(p) in old for p in tensors):
        return [p for p in planned.parameters() if p.requires_grad]
    named = [p for g in params for p in (g.get("params", ()) if isinstance(g, dict) else (g,))]
    if any(id(p) in old for p in named):
        raise BlockRefused("deepspeed.initialize: model_parameters mixes the PipelineModule's parameters with other "
                           "entries (parameter groups?), which cannot follow the rebuild at the OctoPipe plan; build "
                           "octopipe_plugin.deepspeed.OctoPipePipelineModule(layers, config=ds_config, ...) first")
    return params


# ---- DeepSpeed's own engine reading a checkpoint OctoPipe wrote -------------------------------------------
def _mapping_octopipe_checkpoints(engine):
    """Give this engine (not the class) a load_checkpoint that maps optimizer state by name for OctoPipe's files."""
    load = type(engine).load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        t = read_tag(load_dir, tag)
        if t is None or not os.path.exists(os.path.join(load_dir, t, RECORD.format(0))):
            return load(self, load_dir, tag, **kwargs)  # not written by OctoPipe: DeepSpeed's own behaviour
        return load_mapped(self, functools.partial(load, self), load_dir, tag=tag, **kwargs)

    engine.load_checkpoint = types.MethodType(load_checkpoint, engine)
    return engine
