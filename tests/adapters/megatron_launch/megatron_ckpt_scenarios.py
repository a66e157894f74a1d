"""Spawned workers: train the tiny GPT, save a distributed checkpoint under one split, load it under another.

Reuses the Megatron adapter tests' tiny-GPT harness (tests/adapters/megatron: CPU shims, seeding
by global layer name, DDP + distributed Adam). The checkpoint is what megatron.training writes
with --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable: `model{i}` per chunk and the
optimizer's sharded state (checkpointing.py generate_state_dict), through
megatron.core.dist_checkpointing.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron"))

import megatron_harness as H  # noqa: E402

M = 4


def _setup(spec, split: dict):
    """(chunks, optimizer, forward_backward_func) of one split: a plan (any map) or Megatron's own layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from octopipe_plugin.adapters.megatron import chunk_specs, mapped_layout
    from octopipe_plugin.adapters.megatron.schedule import make_forward_backward_func
    from octopipe_plugin.formats import plan_from_dict

    pp = split["pp"]
    if split.get("plan"):
        plan = plan_from_dict(split["plan"])
        H.init_parallel(pp, len(plan.stages_of(0)))
        graph = spec.graph()
        config = H.make_config(spec, pp, layout=mapped_layout(plan, graph))
        rank = ps.get_pipeline_model_parallel_rank()
        many = len(plan.stages_of(rank)) > 1
        chunks = [H.build_chunk(spec, config, c.pre_process, c.post_process, c.vp_stage if many else None)
                  for c in chunk_specs(plan, graph, rank)]
        fb = make_forward_backward_func(plan)
    else:
        layout = split["layout"]
        vp = len(layout.split("|")) // pp
        H.init_parallel(pp, vp)
        config = H.make_config(spec, pp, layout=layout)
        chunks = []
        for v in range(vp):
            vs = v if vp > 1 else None
            chunks.append(H.build_chunk(spec, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                                        ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vs))
        fb = get_forward_backward_func()
    chunks = H.wrap_ddp(chunks, config)
    opt = H.make_optimizer(chunks)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return chunks, opt, fb


def _train(spec, chunks, opt, fb, steps) -> list[float]:
    from megatron.core import parallel_state as ps

    fs = H.make_forward_step(spec)
    losses = []
    for step in steps:
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        its = H.data_iterators(spec, len(chunks), step, M, ps.get_data_parallel_rank(),
                               ps.get_data_parallel_world_size())
        out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                 num_microbatches=M, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=False)
        acc = torch.zeros(2, dtype=torch.float64)
        for d in out:
            acc += d["lm loss"].double().view(-1)
        dist.all_reduce(acc)
        losses.append(float(acc[0] / acc[1]))
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"
    return losses


def _state_dict(chunks, opt, loading: bool) -> dict:
    """What megatron.training saves: model{i} per chunk (model with one chunk) and the optimizer."""
    from megatron.core import parallel_state as ps

    # megatron.training saves the unwrapped chunks (unwrap_model): keys without DDP's "module." prefix
    sd = {("model" if len(chunks) == 1 else f"model{i}"): c.module.sharded_state_dict()
          for i, c in enumerate(chunks)}
    # megatron.training's metadata under --dist-ckpt-optim-fully-reshardable (checkpointing.py): the
    # optimizer state keyed by parameter, so it reshards across pipeline splits, not only across DP
    sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=loading, metadata={
        "distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    return sd


def save(chunks, opt, path: str) -> None:
    """A torch_dist checkpoint of the model chunks and the distributed optimizer."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_state_dict(chunks, opt, loading=False), path)


def load(chunks, opt, path: str) -> None:
    """Load a torch_dist checkpoint (of any split) into these chunks and optimizer."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_state_dict(chunks, opt, loading=True), path)
    for i, c in enumerate(chunks):
        c.module.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
    opt.load_state_dict(loaded["optimizer"])


def adam_state(opt) -> dict:
    """Step counts and total squared norms of Adam's moments over the whole pipeline (split-independent)."""
    acc = torch.zeros(2, dtype=torch.float64)
    steps = set()
    for sub in getattr(opt, "chained_optimizers", [opt]):
        for state in sub.optimizer.state.values():
            acc += torch.stack([state["exp_avg"].double().square().sum(), state["exp_avg_sq"].double().square().sum()])
            steps.add(float(state["step"]))
    dist.all_reduce(acc)
    return {"moments": acc.tolist(), "steps": sorted(steps)}


def run_case(spec, case: dict, root: str) -> dict:
    """Continuous training under `first`, and 1 step under `first` + save + load under `second` + 2 steps."""
    chunks, opt, fb = _setup(spec, case["first"])
    straight = _train(spec, chunks, opt, fb, range(3))
    straight_w = H.gathered_weights(chunks)
    chunks, opt, fb = _setup(spec, case["first"])
    before = _train(spec, chunks, opt, fb, range(1))
    saved_w = H.gathered_weights(chunks)
    saved_adam = adam_state(opt)
    path = os.path.join(root, case["name"])
    save(chunks, opt, path)
    chunks, opt, fb = _setup(spec, case["second"])
    load(chunks, opt, path)
    loaded_w = H.gathered_weights(chunks)
    loaded_adam = adam_state(opt)
    after = _train(spec, chunks, opt, fb, range(1, 3))
    return {"straight": straight, "resumed": before + after, "straight_w": straight_w,
            "final_w": H.gathered_weights(chunks), "saved_w": saved_w, "loaded_w": loaded_w,
            "saved_adam": saved_adam, "loaded_adam": loaded_adam}


def worker(rank: int, world: int, port: int, spec, cases: list[dict], root: str, out_path: str) -> None:
    """Spawn target: every case in turn; rank 0 saves {case name: result} (or the first error)."""
    H.init_process(rank, world, port)  # the CPU shims, torch Adam's resume path included (cpu_shims.py)
    logging.disable(logging.INFO)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(spec, case, root)
        except Exception:
            results[case["name"]] = {"error": f"rank {rank}: {traceback.format_exc()}"}
            torch.save(results, out_path if rank == 0 else f"{out_path}.rank{rank}")
            raise
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
