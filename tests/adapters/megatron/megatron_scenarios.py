"""Spawned workers: train the tiny GPT for a few optimizer steps under one pipeline setup after another.

One process group serves many cases (each re-initialises Megatron's parallel state), so a
test pays for process start-up and imports once. Results (per-step global losses,
forward-only losses, every weight by global name, counters) are written by rank 0 to a
file the test reads.
"""

from __future__ import annotations

import logging
import traceback

import torch
import torch.distributed as dist

import megatron_harness as H

STEPS = 3


def _global_loss(out) -> torch.Tensor:
    """(sum of losses, sum of tokens) over every micro-batch of every replica: the step's per-token loss."""
    acc = torch.zeros(2, dtype=torch.float64)
    for d in out:
        v = d["lm loss"].double().view(-1)
        acc += v if v.numel() == 2 else torch.stack([v[0], torch.ones((), dtype=torch.float64)])
    dist.all_reduce(acc)
    return acc[0] / acc[1]


def _octopipe_chunks(spec: H.TinyGPT, plan, rank: int):
    """The plan's chunks for this pipeline rank, built through Megatron with a MappedLayout."""
    from octopipe_plugin.adapters.megatron import chunk_specs, mapped_layout
    from octopipe_plugin.adapters.megatron.embeddings import tie_local_copies

    graph = spec.graph()
    config = H.make_config(spec, plan.num_devices, layout=mapped_layout(plan, graph))
    chunks = [H.build_chunk(spec, config, c.pre_process, c.post_process, c.vp_stage if len(plan.stages_of(rank)) > 1
                            else None) for c in chunk_specs(plan, graph, rank)]
    tie_local_copies(chunks)
    return config, chunks


def _megatron_chunks(spec: H.TinyGPT, layout: str | None, pp: int):
    """Megatron's own round-robin chunks (get_model's pre/post rule)."""
    from megatron.core import parallel_state as ps

    config = H.make_config(spec, pp, layout=layout)
    vp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vp):
        vs = v if vp > 1 else None
        chunks.append(H.build_chunk(spec, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                                    ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vs))
    return config, chunks


def run_case(case: dict) -> dict:
    """Train one case for STEPS steps (plus a forward-only pass per step); its losses and final weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from octopipe_plugin.adapters.megatron.embeddings import embedding_ranks_fn
    from octopipe_plugin.adapters.megatron.schedule import make_forward_backward_func
    from octopipe_plugin.formats import plan_from_dict

    spec: H.TinyGPT = case["spec"]
    pp, m = case["pp"], case["microbatches"]
    plan = plan_from_dict(case["plan"]) if case.get("plan") else None
    if plan is not None:
        vp = len(plan.stages_of(0))
        H.init_parallel(pp, vp, embedding_ranks=embedding_ranks_fn(plan, spec.graph(), spec.tied))
        config, chunks = _octopipe_chunks(spec, plan, ps.get_pipeline_model_parallel_rank())
    else:
        layout = case.get("layout")
        vp = len(layout.split("|")) // pp if layout else 1
        H.init_parallel(pp, vp)
        config, chunks = _megatron_chunks(spec, layout, pp)
    chunks = H.wrap_ddp(chunks, config)
    opt = H.make_optimizer(chunks)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    if plan is not None:
        fb = make_forward_backward_func(plan)
    else:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
    fs = H.make_forward_step(spec)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    losses, evals = [], []
    for step in range(STEPS):
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        its = H.data_iterators(spec, len(chunks), step, m, dp_rank, dp_size)
        out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                 num_microbatches=m, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=False)
        losses.append(_global_loss(out))
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"
        if case.get("eval"):
            for c in chunks:
                c.eval()
            its = H.data_iterators(spec, len(chunks), 100 + step, m, dp_rank, dp_size)
            out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                     num_microbatches=m, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=True)
            evals.append(_global_loss(out))
            for c in chunks:
                c.train()
    weights = H.gathered_weights(chunks)
    counts = torch.zeros(3, dtype=torch.int64)
    for c in chunks:
        phase = getattr(c, "_octopipe_wgrad_phase", None)
        if phase is not None:
            counts += torch.tensor([phase.forward_calls, phase.input_gemms, phase.weight_gemms])
    dist.all_reduce(counts)
    return {"losses": torch.stack(losses), "evals": torch.stack(evals) if evals else None, "weights": weights,
            "linear_calls": counts[0].item(), "input_gemms": counts[1].item(), "weight_gemms": counts[2].item()}


def worker(rank: int, world: int, port: int, cases: list[dict], out_path: str) -> None:
    """Spawn target: run every case in turn; rank 0 saves {case name: result} (or the first error)."""
    H.init_process(rank, world, port)
    logging.disable(logging.INFO)  # Megatron logs every bucket and optimizer setting at INFO
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case)
        except Exception:  # record and stop: later cases would only hang on a broken group
            results[case["name"]] = {"error": f"rank {rank}: {traceback.format_exc()}"}
            torch.save(results, out_path if rank == 0 else f"{out_path}.rank{rank}")
            raise
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
