"""Optimizer state that follows its parameters across plans and partitions.

DeepSpeed stores a pipeline rank's optimizer state by position (`mp_rank_XX_model_states.pt`),
so a state saved under one partition fails to load under another, or, when the counts happen
to match, loads silently onto other parameters. Next to DeepSpeed's files OctoPipe writes, per
pipeline rank, the global name of every parameter in optimizer order
(`layer_07.fc.weight`, `tied_embed.weight`) with that rank's optimizer state. Loading under
the same layout lets DeepSpeed load as usual; under another plan or partition each parameter's
state is looked up by name (plain torch optimizers); anything else is refused before a tensor
is touched.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from ...errors import OctoPipeError

log = logging.getLogger(__name__)
RECORD = "octopipe_optim_pp{:02d}.pt"


def parameter_names(module) -> dict[int, str]:
    """id(parameter) -> its partition-independent name in a PipelineModule."""
    names = {}
    for child, sub in module.named_children():
        if child.isdigit():
            for pn, p in sub.named_parameters():
                names[id(p)] = f"layer_{int(child):02d}.{pn}"
    for key, sub in module.tied_modules.items():
        for pn, p in sub.named_parameters():
            names[id(p)] = f"tied_{key}.{pn}"
    return names


def optimizer_names(engine) -> list[list[str]]:
    """Names of the optimizer's parameters, per parameter group, in its order."""
    names = parameter_names(engine.module)
    groups = _torch_optimizer(engine).param_groups if _torch_optimizer(engine) is not None else []
    return [[names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in g["params"]] for g in groups]


def _torch_optimizer(engine):
    """The plain torch optimizer whose state is per parameter, or None (ZeRO, bf16 and fp16 wrappers)."""
    opt = engine.optimizer
    if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "fp32_groups_flat_partition") \
            and not hasattr(opt, "bit16_groups") and not hasattr(opt, "fp16_groups"):
        return opt
    return None


def save_records(engine, save_dir: str, tag: str) -> None:
    """Write this pipeline rank's parameter names and optimizer state (data-parallel rank 0 only)."""
    if engine.grid.data_parallel_id != 0:
        return
    opt = _torch_optimizer(engine)
    record = {"names": optimizer_names(engine), "mappable": opt is not None,
              "state": opt.state_dict() if opt is not None else None}
    torch.save(record, os.path.join(save_dir, str(tag), RECORD.format(engine.grid.get_stage_id())))


def read_tag(load_dir: str, tag):
    """The checkpoint tag (the 'latest' file when tag is None)."""
    if tag is not None:
        return str(tag)
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def plan_load(engine, load_dir: str, tag) -> str:
    """How to load this rank's optimizer state: 'native' (same layout), 'mapped' (by name); else refuse."""
    tag = read_tag(load_dir, tag)
    files = sorted(glob.glob(os.path.join(load_dir, str(tag), RECORD.replace("{:02d}", "*"))))
    where = os.path.join(load_dir, str(tag))
    if not files:
        raise OctoPipeError(
            f"{where}: the optimizer state does not record which parameters it belongs to (written by DeepSpeed's "
            "own engine, whose partition the checkpoint does not record either), so it cannot be mapped onto this "
            "plan's parameters; load it with load_optimizer_states=False (module weights load under any "
            "partition), or resume under the partition that wrote it with DeepSpeed's engine")
    mine = optimizer_names(engine)
    own = os.path.join(where, RECORD.format(engine.grid.get_stage_id()))
    if os.path.exists(own) and torch.load(own, weights_only=False)["names"] == mine:
        return "native"
    if _torch_optimizer(engine) is None:
        raise OctoPipeError(
            f"{where}: saved under another plan or partition, and this run's optimizer "
            f"({type(engine.optimizer).__name__}) keeps flat partitions (ZeRO, bf16 or fp16 master weights), "
            "whose state cannot be mapped parameter by parameter; resume under the plan that wrote it, or load "
            "with load_optimizer_states=False")
    return "mapped"


def load_mapped(engine, load_dir: str, tag) -> None:
    """Load each local parameter's optimizer state from whichever rank saved it, by name."""
    tag = read_tag(load_dir, tag)
    where = os.path.join(load_dir, str(tag))
    saved = {}
    hyper = None
    for path in sorted(glob.glob(os.path.join(where, RECORD.replace("{:02d}", "*")))):
        rec = torch.load(path, weights_only=False)
        if not rec["mappable"]:
            raise OctoPipeError(f"{path}: written with an optimizer that keeps flat partitions; its state cannot be "
                                "mapped parameter by parameter (load with load_optimizer_states=False)")
        st = rec["state"]
        for g_names, group in zip(rec["names"], st["param_groups"]):
            hyper = hyper or {k: v for k, v in group.items() if k != "params"}
            for name, idx in zip(g_names, group["params"]):
                saved[name] = st["state"].get(idx, {})
    opt = _torch_optimizer(engine)
    current = opt.state_dict()
    missing = [n for g in optimizer_names(engine) for n in g if n not in saved]
    if missing:
        raise OctoPipeError(f"{where}: no saved optimizer state for parameters {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''}; refusing to load state onto other parameters")
    state = {}
    for g_names, group in zip(optimizer_names(engine), current["param_groups"]):
        for name, idx in zip(g_names, group["params"]):
            if saved[name]:
                state[idx] = saved[name]
    groups = [{**g, **{k: v for k, v in (hyper or {}).items() if k in g}} for g in current["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})
    log.info("octopipe: optimizer state of %d parameters mapped by name from %s", len(state), where)


def load_checkpoint(engine, load, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """DeepSpeed's load_checkpoint (`load`), with the optimizer state mapped or refused as above."""
    how = "native"
    wanted = load_optimizer_states and not load_module_only
    if wanted:
        how = plan_load(engine, load_dir, tag)  # refuses before any weight is loaded
    # DeepSpeed 0.19.8 writes the bf16 optimizer's state (no ZeRO) to bf16_zero_pp_rank_*_optim_states.pt
    # but reads it back from mp_rank_XX_model_states.pt, which holds none (runtime/engine.py:4676 asks
    # zero_optimization() only): the state is read from the files it was written to instead
    bf16_files = wanted and how == "native" and engine.bfloat16_enabled() and not engine.zero_optimization()
    out = load(load_dir, tag=tag, load_module_strict=load_module_strict,
               load_optimizer_states=wanted and how == "native" and not bf16_files,
               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
               custom_load_fn=custom_load_fn)
    if bf16_files and out[0] is not None and not engine._load_zero_checkpoint(load_dir, read_tag(load_dir, tag)):
        raise OctoPipeError(f"{os.path.join(load_dir, str(read_tag(load_dir, tag)))}: no bf16 optimizer state files "
                            "(bf16_zero_pp_rank_*_optim_states.pt); load with load_optimizer_states=False")
    if wanted and how == "mapped":
        load_mapped(engine, load_dir, tag)
    return out
