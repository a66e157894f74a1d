"""Optimizer state that follows its parameters across plans and partitions.

DeepSpeed stores a pipeline rank's optimizer state by position (`mp_rank_XX_model_states.pt`),
so a state saved under one partition fails to load under another, or, when the counts happen
to match, loads silently onto other parameters. Next to DeepSpeed's files OctoPipe writes, per
pipeline rank, the global name of every parameter in optimizer order
(`layer_07.fc.weight`, `tied_embed.weight`) with that rank's optimizer state. Loading under
the same layout lets DeepSpeed load as usual; under another plan or partition each parameter's
state is looked up by name (plain torch optimizers); anything else is refused before a tensor
is touched.

A split LM head (head_split.py) is saved as DeepSpeed saves the unsplit head: its layer file
`layer_XX-model_states.pt` holds the whole [vocab, hidden] weight, its shards' rows gathered on
the owner's rank, so a checkpoint of a split plan loads under DeepSpeed's own engine and any other
plan, and the reverse (each shard reads its rows of the file). Its optimizer state is recorded per
shard under the head's name with the rows (`layer_08.weight[0:5]`) and mapped by rows: the pieces
put together, then cut to the loading parameter's rows.

A split head tied to the embedding has no file of its own: DeepSpeed writes the tied weight in
the layer file of the key's first entry without forward_fn (the embedding, `layer_00`) from the
rank holding it, and the head's entry (a forward_fn, no state_dict) in none, under a split plan
as under DeepSpeed's engine. Its shards load their rows from that file; their optimizer state is
recorded under the tied weight's name with the rows (`tied_embed.weight[0:5]`), so it maps by
rows onto and from the whole weight's state (`tied_embed.weight`).

A split embedding is saved the same way as an untied head: its layer file `layer_00-model_states.pt` whole,
gathered on stage 0's rank (which need not hold rows), its optimizer state per shard as `layer_00.weight[lo:hi]`.

A model with DeepSpeed MoE layers is checkpointed by DeepSpeed per pipeline rank, not per layer
(`moe_layout_problem`): it resumes under the plan that wrote it, and another placement is refused in
one line before anything loads.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import torch
import torch.distributed as tdist

from ...errors import OctoPipeError
from ...formats.splits import row_range

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
    for head, shard in ((getattr(module, "octopipe_head", None), getattr(module, "head_shard", lambda: None)()),
                        (getattr(module, "octopipe_embedding", None),
                         getattr(module, "embedding_shard", lambda: None)())):
        if head is not None and shard is not None:
            lo, hi = shard.rows
            base = (f"tied_{head.tied.key}.{head.tied.attr}" if head.tied is not None
                    else f"layer_{head.index:02d}.weight")
            names[id(shard.weight)] = f"{base}[{lo}:{hi}]"
    return names


# ---- a split head's layer file ----------------------------------------------------------------------------
def save_head(module, save_dir: str, checkpoint_engine, head=None, shard=None) -> None:
    """Write a split head's layer file as DeepSpeed's own (the whole weight), gathered on the owner's rank of
    data-parallel replica 0 (every rank of that pipeline calls this; the others return). `head`, `shard`: another
    split layer's placement and this rank's shard of it (the embedding's: gathered on stage 0's rank)."""
    if head is None:
        head, shard = module.octopipe_head, module.head_shard()
    owner = head.owner_device if head is not None else None
    if head is None or head.tied is not None or module._grid.data_parallel_id != 0 \
            or (module.stage_id not in head.split.devices and module.stage_id != owner):
        return  # a tied head: the tied weight's holder wrote its file as DeepSpeed does
    if module.stage_id != owner:
        tdist.send(shard.weight.detach().contiguous(), dst=module._grid.stage_to_global(owner))
        return
    dtype, device = module.shard_dtype_device(head)
    full = torch.empty((head.vocab, head.hidden), dtype=dtype, device=device)
    for d in head.split.devices:  # in the split's device order, the order the shards send in
        lo, hi = row_range(head.split, head.vocab, d)
        if d == owner:
            full[lo:hi] = shard.weight.detach()
        else:
            buf = torch.empty((hi - lo, head.hidden), dtype=full.dtype, device=full.device)
            tdist.recv(buf, src=module._grid.stage_to_global(d))
            full[lo:hi] = buf
    checkpoint_engine.save(state_dict={"weight": full}, path=_head_path(module, save_dir, head))


def load_head(module, load_dir: str, checkpoint_engine, head=None, shard=None) -> None:
    """This rank's rows of a split head from the head's layer file (written by any plan or DeepSpeed itself);
    `head`, `shard`: another split layer's (the embedding's)."""
    if head is None:
        head, shard = module.octopipe_head, module.head_shard()
    if head is None or shard is None:
        return
    entry, field = head.index, "weight"
    if head.tied is not None:
        entry, field = head.tied.file_entry, head.tied.attr
        if entry is None:
            raise OctoPipeError(f"{load_dir}: the split LM head is tied to key {head.tied.key!r}, whose entries all "
                                "have a forward_fn, so DeepSpeed writes no layer file of the tied weight to load its "
                                "rows from; give the embedding's TiedLayerSpec no forward_fn, or load with an "
                                "unsplit plan")
    files = sorted(glob.glob(os.path.join(load_dir, f"layer_{entry:02d}-*model_states.pt")))
    if not files:
        raise OctoPipeError(f"{load_dir}: no layer_{entry:02d}-model_states.pt for the split {_what(head)} (list "
                            f"entry {entry}); the checkpoint was written for another layer list")
    w = checkpoint_engine.load(files[0], map_location="cpu").get(field)
    if w is None or tuple(w.shape) != (head.vocab, head.hidden):
        got = None if w is None else tuple(w.shape)
        raise OctoPipeError(f"{files[0]}: field {field}: expected the {_what(head)}'s [{head.vocab}, {head.hidden}] "
                            f"weight, got {got} (a checkpoint of another model)")
    lo, hi = shard.rows
    with torch.no_grad():
        shard.weight.copy_(w[lo:hi])


def _what(head) -> str:
    return "LM head" if head.side == "output" else "embedding"


def _head_path(module, save_dir: str, head) -> str:
    # DeepSpeed's own name of the entry's file (ckpt_layer_path adds the active stage's start back)
    return module.ckpt_layer_path(save_dir, head.index - module._local_start)


_ROWS = re.compile(r"^(?P<base>.+)\[(?P<lo>\d+):(?P<hi>\d+)\]$")


def _saved_state(saved: dict, name: str):
    """The saved optimizer state of parameter `name`, put together from row pieces where it was split (None:
    nothing saved for it)."""
    if name in saved:
        return saved[name]
    m = _ROWS.match(name)
    base, want = (m["base"], (int(m["lo"]), int(m["hi"]))) if m else (name, None)
    pieces = []
    for key, st in saved.items():
        k = _ROWS.match(key)
        if key == base:
            pieces.append((None, st))
        elif k and k["base"] == base:
            pieces.append(((int(k["lo"]), int(k["hi"])), st))
    if not pieces:
        return None
    pieces.sort(key=lambda p: -1 if p[0] is None else p[0][0])
    out = {}
    for field, first in pieces[0][1].items():
        if not (torch.is_tensor(first) and first.dim() >= 1):
            out[field] = first  # a step count: the same in every piece
            continue
        if pieces[0][0] is None:
            whole = first
        else:
            at = 0
            for rows, _ in pieces:
                if rows[0] != at:
                    raise OctoPipeError(f"saved optimizer state of {base}: rows [{at}, {rows[0]}) are in no piece")
                at = rows[1]
            whole = torch.cat([st[field] for _, st in pieces])
        out[field] = whole if want is None else whole[want[0]:want[1]].clone()
    return out


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
    found = {n: _saved_state(saved, n) for g in optimizer_names(engine) for n in g}
    missing = [n for n, st in found.items() if st is None]
    if missing:
        raise OctoPipeError(f"{where}: no saved optimizer state for parameters {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''}; refusing to load state onto other parameters")
    state = {}
    for g_names, group in zip(optimizer_names(engine), current["param_groups"]):
        for name, idx in zip(g_names, group["params"]):
            if found[name]:
                state[idx] = found[name]
    groups = [{**g, **{k: v for k, v in (hyper or {}).items() if k in g}} for g in current["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})
    log.info("octopipe: optimizer state of %d parameters mapped by name from %s", len(state), where)


def moe_layout_problem(engine, load_dir: str, tag) -> str | None:
    """Why a MoE model's checkpoint cannot load under this engine's plan (one line), or None.

    With MoE layers DeepSpeed 0.19.8 writes a pipeline checkpoint per pipeline rank, not per layer: each rank's
    layers in its mp_rank_XX_model_states.pt (deepspeed/runtime/engine.py:5297, `_save_moe_checkpoint`, read back
    whole by runtime/pipe/engine.py:1345 and a strict load_state_dict, runtime/engine.py:4292) and its experts in
    layer_{n}_expert_{e} files numbered by the rank's own MoE layers (runtime/engine.py:5083-5096). The files so
    hold another rank's layers under another partition: refused here, on every rank alike, before anything loads,
    where the checkpoint's octopipe_plan.json places the stages otherwise."""
    from .moe_pairs import moe_entries

    if not moe_entries(getattr(engine.module, "_layer_specs", ())):  # the whole list's: every rank answers alike
        return None
    where = os.path.join(load_dir, str(read_tag(load_dir, tag)))
    path = os.path.join(where, "octopipe_plan.json")
    if not os.path.isfile(path):
        return None  # written by DeepSpeed's engine: its own strict load says what does not match
    import json

    with open(path, encoding="utf-8") as fh:
        saved = json.load(fh)
    mine = [(st.start, st.end, st.device) for st in engine.plan.stages]
    theirs = [(st["layers"][0], st["layers"][1], st["device"]) for st in saved.get("stages", [])]
    if mine == theirs:
        return None
    return (f"{where}: a checkpoint of a model with DeepSpeed MoE layers loads only under the stage placement that "
            f"wrote it (DeepSpeed writes such a pipeline checkpoint per pipeline rank: mp_rank_XX_model_states.pt and "
            f"expert files numbered by each rank's own MoE layers); it was written with stages {theirs}, this plan "
            f"has {mine}; resume under the plan in its octopipe_plan.json")


def load_checkpoint(engine, load, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """DeepSpeed's load_checkpoint (`load`), with the optimizer state mapped or refused as above."""
    problem = moe_layout_problem(engine, load_dir, tag)
    if problem is not None:
        raise OctoPipeError(problem)
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
