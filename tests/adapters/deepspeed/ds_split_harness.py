"""Harness of the split-LM-head DeepSpeed tests: the harness model with an untied nn.Linear head, split plans,
and a worker running scenarios through deepspeed.initialize (OctoPipeEngine on split plans, DeepSpeed's own
PipelineEngine on the unsplit model at the same stage boundaries).

Layers: embedding (0), NUM_BLOCKS residual blocks, `LayerSpec(nn.Linear, HID, VOCAB, bias=False)` (the head,
list entry 8), all seeded by DeepSpeed's seed_layers, so the split run's shards start from the rows of
the unsplit head. Each scenario saves per rank its losses, every weight it holds by global layer index,
and its head shard's rows; `head_weight` reassembles the head from the shards.

A scenario with `tied` runs ds_harness's model instead: the head a TiedLayerSpec of the embedding's key
(forward_fn x @ W^T); its weights carry the tied module as `tied_embed`, and `tied_weights` checks every
shard's rows equal to the tied weight's.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import torch
from torch import nn

import ds_harness as H

HEAD = H.NUM_BLOCKS + 1  # the head's list index (and OctoPipe layer)
NUM_LAYERS = HEAD + 1


def layer_specs():
    """Embedding, blocks, an untied Linear head."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(nn.Embedding, H.VOCAB, H.HID)] + [LayerSpec(H.Block, H.HID) for _ in range(H.NUM_BLOCKS)]
            + [LayerSpec(nn.Linear, H.HID, H.VOCAB, bias=False)])


def masked_sum_loss(logits, labels):
    """Summed cross-entropy over the tokens whose label is not 0 (ignore_index=0): a loss that is no mean."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, H.VOCAB), labels.reshape(-1), ignore_index=0,
                                       reduction="sum")


LOSSES = {"mean": H.loss_fn, "masked_sum": masked_sum_loss}


def cost_model():
    """A cost model of the layer list (a heavy head) for placing the shard actions."""
    from octopipe_plugin.formats import Layer, Model

    kinds = ["embedding"] + ["dense"] * H.NUM_BLOCKS + ["lm_head"]
    return Model(name="ds-split", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=3.0 if k == "lm_head" else 1.0, bwd_ms=3.0 if k == "lm_head" else 1.0,
              wgrad_ms=3.0 if k == "lm_head" else 1.0, state_bytes=1 << 10, activation_bytes=1 << 10,
              output_bytes=0) for i, k in enumerate(kinds)))


def split_plan_doc(stage_devices, bounds, num_devices: int, m: int, seed: int, devices, shares,
                   embedding=None) -> dict:
    """A random valid order with split backward on the given stages, the head split over `devices` (None: not
    split), `embedding` (devices, shares) the embedding's split, their shard actions placed by the split scheduler."""
    from octopipe_plugin.executor import check_runnable
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.formats import plan_to_dict
    from octopipe_plugin.formats.splits import SplitLayer
    from octopipe_plugin.testing.plans import make_plan, sample_schedule
    from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards

    sched = sample_schedule(stage_devices, num_devices, m, random.Random(seed), split_prob=0.5)
    plan = make_plan(stage_devices=stage_devices, bounds=bounds, num_devices=num_devices, num_microbatches=m,
                     schedule=sched)
    splits = () if devices is None else (SplitLayer(layer=HEAD, devices=tuple(devices), shares=tuple(shares)),)
    if embedding is not None:
        splits = (SplitLayer(layer=0, devices=tuple(embedding[0]), shares=tuple(embedding[1])),) + splits
    cluster = replace(zero_cost_cluster(num_devices), memory_bytes=1 << 40)
    plan = insert_shards(cost_model(), cluster, replace(plan, splits=splits), ShardPolicy())
    assert plan is not None, "could not place the shard actions"
    check_runnable(plan)
    return plan_to_dict(plan)


# ---- worker --------------------------------------------------------------------------------------------
def _weights(module) -> dict:
    out = {}
    for name, sub in module.named_children():
        if name.isdigit():
            out[name] = {k: v.detach().float().clone() for k, v in sub.state_dict().items()}
    for key, sub in module.tied_modules.items():
        out[f"tied_{key}"] = {k: v.detach().float().clone() for k, v in sub.state_dict().items()}
    return out


def run_scenario(sc: dict, rank: int, out_dir: str) -> None:
    """Build the module (OctoPipe's at the config's plan, or DeepSpeed's own at `parts`), train, save the report."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import octopipe_plugin.deepspeed  # noqa: F401  (installs the engine choice)
    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule

    cfg = sc["config"]
    kwargs = dict(loss_fn=LOSSES[sc.get("loss", "mean")], seed_layers=True, base_seed=H.BASE_SEED)
    specs = H.layer_specs() if sc.get("tied") else layer_specs()  # tied: the head a TiedLayerSpec of the embedding
    if sc.get("parts") is not None:  # DeepSpeed's own PipelineEngine on the unsplit model, at these boundaries
        module = OctoPipePipelineModule(specs, parts=sc["parts"], **kwargs)
    elif sc.get("plain"):  # a plain PipelineModule with the block: rebuilt at the plan by the engine choice
        module = PipelineModule(specs, num_stages=sc["pp"], partition_method="uniform", **kwargs)
    else:
        module = OctoPipePipelineModule(specs, config=cfg, **kwargs)
    engine, _, _, _ = deepspeed.initialize(model=module, config=cfg,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    if sc.get("grad_scale") is not None:  # a deliberate scale error: the comparisons must see it
        for q in engine.module.parameters():
            q.register_hook(lambda g, k=sc["grad_scale"]: g * k)
    if sc.get("load") is not None:
        engine.load_checkpoint(sc["load"]["dir"], tag=sc["load"]["tag"],
                               load_optimizer_states=sc["load"].get("optimizer", True))
    dp_rank = engine.grid.data_parallel_id
    m = engine.micro_batches
    report = {"engine": type(engine).__name__, "losses": [], "eval": [], "grads": []}
    if sc.get("grads"):  # every gradient the optimizer is given, by partition-free name, before each step
        from octopipe_plugin.adapters.deepspeed.checkpoint import parameter_names

        names, optimizer_step = parameter_names(engine.module), engine.optimizer.step

        def recording_step(*args, **kwargs):
            report["grads"].append({names[id(p)]: p.grad.detach().float().clone()
                                    for g in engine.optimizer.param_groups for p in g["params"]
                                    if p.grad is not None})
            return optimizer_step(*args, **kwargs)

        engine.optimizer.step = recording_step
    first = sc.get("first_step", 0)
    for step in range(first, first + sc.get("steps", H.STEPS)):
        if sc.get("eval"):  # the forward-only plan of the split plan (F, H, J's loss) on the step's data
            report["eval"].append(float(engine.eval_batch(H.CountingIter(H.batches(step, dp_rank, m)))))
        report["losses"].append(float(engine.train_batch(data_iter=H.CountingIter(H.batches(step, dp_rank, m)))))
    if sc.get("save") is not None:
        engine.save_checkpoint(sc["save"]["dir"], tag=sc["save"]["tag"])
    report["weights"] = _weights(engine.module)
    shard = engine.module.head_shard() if hasattr(engine.module, "head_shard") else None
    report["shard"] = None if shard is None else (shard.rows, shard.weight.detach().float().clone())
    emb = engine.module.embedding_shard() if hasattr(engine.module, "embedding_shard") else None
    report["emb_shard"] = None if emb is None else (emb.rows, emb.weight.detach().float().clone())
    report["dp"] = dp_rank
    torch.save(report, os.path.join(out_dir, f"{sc['name']}-rank{rank}.pt"))


def run_all(scenarios: list, world: int, out_dir: str) -> None:
    """Spawn `world` ranks running every split scenario (ds_harness's workers, this harness's run_scenario)."""
    H.run_all(scenarios, world, out_dir, run=run_scenario)


def head_weight(reports, index: int = HEAD, field: str = "shard") -> torch.Tensor:
    """The head's [VOCAB, HID] weight: the unsplit run's layer file entry, or the shards' rows put together
    (rows held twice, by data-parallel copies, must be equal); `index` 0, `field` "emb_shard": the embedding's."""
    full = None
    for rep in reports:
        if str(index) in rep["weights"]:
            return rep["weights"][str(index)]["weight"]
        if rep.get(field) is not None:
            (lo, hi), w = rep[field]
            full = torch.full((H.VOCAB, H.HID), float("nan")) if full is None else full
            if not torch.isnan(full[lo:hi]).all():
                assert torch.equal(full[lo:hi], w), f"copies of head rows [{lo}, {hi}) differ"
            full[lo:hi] = w
    assert full is not None and not torch.isnan(full).any(), "some head rows are held by no rank"
    return full


def all_grads(reports, step: int) -> dict:
    """Name -> gradient before optimizer step `step`, the head's rows put together (copies identical); rows of a
    weight also held whole (a tied head's shards) must equal its rows."""
    merged, rows = {}, {}
    for rep in reports:
        for name, g in rep["grads"][step].items():
            base, _, span = name.partition("[")
            if span:  # a shard: layer_08.weight[lo:hi]
                lo, hi = (int(x) for x in span.rstrip("]").split(":"))
                rows.setdefault(base, {})[(lo, hi)] = g
            elif name in merged:
                assert torch.equal(merged[name], g), f"copies of the gradient of {name} differ"
            else:
                merged[name] = g
    for base, parts in rows.items():
        if base in merged:  # shards of the tied weight: the tie gives them its gradient's rows, bit for bit
            for (lo, hi), g in parts.items():
                assert torch.equal(merged[base][lo:hi], g), f"step {step}: {base}[{lo}:{hi}] is not tied"
        else:
            merged[base] = torch.cat([parts[k] for k in sorted(parts)])
    return merged


def all_weights(reports) -> dict:
    """Layer index -> weights (every copy identical), the head included whichever way it is held."""
    merged = H.merged_weights(reports)
    merged[str(HEAD)] = {"weight": head_weight(reports)}
    merged["0"] = {"weight": head_weight(reports, 0, "emb_shard")}
    return merged


def assert_same_weights(ours: dict, theirs: dict, atol: float = 1e-5) -> None:
    """Every weight of `theirs` ({layer: {name: tensor}}) equal in `ours` at `atol` (absolute and relative)."""
    for idx in theirs:
        for k in theirs[idx]:
            torch.testing.assert_close(ours[idx][k], theirs[idx][k], atol=atol, rtol=atol, msg=f"layer {idx}: {k}")


def tied_weights(reports) -> dict:
    """Weights of a tied-model run (copies identical), every head shard checked equal to its rows of the tied weight."""
    merged = H.merged_weights(reports)
    tied = merged["tied_embed"]["weight"]
    for rep in reports:
        if rep["shard"] is not None:
            (lo, hi), w = rep["shard"]
            assert torch.equal(tied[lo:hi], w), f"head shard rows [{lo}, {hi}) differ from the tied weight's"
    return merged
