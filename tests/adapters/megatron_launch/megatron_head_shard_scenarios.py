"""Spawned workers: Megatron GPT chunks with the LM head split into HeadShards, their initial rows and checkpoints.

The chunks are built the way SHARD_API.md says the Megatron adapter builds a split plan's ranks (until its
builder lands): every rank builds its chunks by `chunk_specs` as for the plan without splits, the owner's
Megatron-built `output_layer.weight` is handed out by `build_head_shard`, and each shard rank's HeadShard is
attached as `output_layer` (the owner's replaces Megatron's ColumnParallelLinear; a shard-only rank's goes
into its last chunk) before DDP. Training steps feed every layout the same gradients, element by element
of the global tensors (a split plan's forward/backward runs in the adapter's runtime, not here), through
Megatron's DDP buffers, finalize_model_grads and distributed Adam with gradient clipping (the norm counts
each head row once only if the shards are tensor-parallel-unique and nowhere duplicated).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import zlib
from dataclasses import replace

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "megatron"))
sys.path.insert(0, HERE)

import megatron_ckpt_scenarios as S  # noqa: E402
import megatron_harness as H  # noqa: E402

HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
ROWS = (HEAD, EMBEDDING)  # the global tensors a split plan holds in rows (split_embedding.EmbeddingShard: the latter)


def split_plan(spec, bounds, devices, head_devices, shares, seed: int = 0, embedding=None) -> dict:
    """A complete plan document: stages on `devices`, the LM head split over `head_devices` and, with `embedding`
    ((devices, shares)), the embedding too (shard actions placed by the tuner's inserter, the plan validated by the
    format's reader)."""
    import random

    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.formats import plan_from_dict, plan_to_dict
    from octopipe_plugin.formats.splits import SplitLayer
    from octopipe_plugin.testing.plans import make_plan, sample_schedule
    from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards

    graph = spec.graph()
    nd = max(devices) + 1
    plan = make_plan(stage_devices=devices, bounds=bounds, num_devices=nd, num_microbatches=S.M,
                     schedule=sample_schedule(devices, nd, S.M, random.Random(seed)), model="tiny-gpt")
    split = SplitLayer(layer=graph.num_layers - 1, devices=tuple(head_devices), shares=tuple(shares))
    emb = (SplitLayer(layer=0, devices=tuple(embedding[0]), shares=tuple(embedding[1])),) if embedding else ()
    cluster = replace(zero_cost_cluster(nd), memory_bytes=1 << 40)
    full = insert_shards(graph, cluster, replace(plan, splits=emb + (split,)), ShardPolicy())
    assert full is not None, "could not place the shard actions"
    doc = plan_to_dict(full)
    plan_from_dict(doc)  # validated: stages, schedule with every H/J/K, splits
    return doc


def build(spec, layout: dict, megatron_init: bool = False):
    """(chunks before DDP, config, head split or None) of one layout: a split plan or Megatron's own layout string;
    `megatron_init`: keep Megatron's own initial values (seeded as megatron.training seeds each pipeline rank)."""
    from megatron.core import parallel_state as ps

    from octopipe_plugin.adapters.megatron import chunk_specs, mapped_layout
    from octopipe_plugin.adapters.megatron.vocab_shards import build_head_shard
    from octopipe_plugin.formats import plan_from_dict

    pp = layout["pp"]
    make = _megatron_chunk if megatron_init else H.build_chunk
    if layout.get("plan"):
        plan = plan_from_dict(layout["plan"])
        graph = spec.graph()
        from octopipe_plugin.adapters.megatron.mapping import head_split
        from octopipe_plugin.adapters.megatron.placement import attach_embedding_shard

        split = head_split(plan) if plan.splits and layout.get("split", True) else None
        ranks = None
        if spec.tied:  # the ranks holding whole copies (a split tied head holds none: mapping.copy_ranks)
            from octopipe_plugin.adapters.megatron.mapping import embedding_ranks_fn

            ranks = embedding_ranks_fn(plan if split is not None else replace(plan, splits=()), graph, True)
        init_parallel(spec, pp, len(plan.stages_of(0)), embedding_ranks=ranks)
        config = H.make_config(spec, pp, layout=mapped_layout(plan, graph))
        rank = ps.get_pipeline_model_parallel_rank()
        _seed_rank(rank, megatron_init)
        many = len(plan.stages_of(rank)) > 1
        chunks = [make(spec, config, c.pre_process, c.post_process, c.vp_stage if many else None)
                  for c in chunk_specs(plan, graph, rank)]
        if spec.tied:
            from octopipe_plugin.adapters.megatron.embeddings import tie_local_copies
            from octopipe_plugin.adapters.megatron.placement import attach_head_shard

            tie_local_copies(chunks)
            if split is not None:  # the adapter's own tied path: rows from the embedding's rank
                attach_head_shard(plan, chunks, rank, config, spec.vocab)
        elif split is not None:
            _attach_shards(chunks, plan, split, rank, config, spec, build_head_shard)
            attach_embedding_shard(plan, chunks, rank, config, spec.vocab)  # the adapter's own (None: no split)
        return chunks, config, split
    text = layout["layout"]
    vp = len(text.split("|")) // pp
    init_parallel(spec, pp, vp)
    config = H.make_config(spec, pp, layout=text)
    _seed_rank(ps.get_pipeline_model_parallel_rank(), megatron_init)
    chunks = []
    for v in range(vp):
        vs = v if vp > 1 else None
        chunks.append(make(spec, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                           ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vs))
    if spec.tied:
        # the harness seeds the embedding after Megatron's construction all-reduce made the head's copy: Megatron's
        # own tying step once more (zero the copy, all-reduce over the embedding group) makes the copy the embedding
        for c in chunks:
            c.setup_embeddings_and_output_layer()
    return chunks, config, None


tp_size = H.tp_size  # the spec's --tensor-model-parallel-size
shim_device_arch = H.shim_device_arch  # validate_args' GPU-architecture question at TP > 1


def init_parallel(spec, pp: int, vp: int, embedding_ranks=None) -> None:
    """The harness's init_parallel with the spec's tensor-parallel size."""
    H.init_parallel(pp, vp, embedding_ranks=embedding_ranks, tp=tp_size(spec))


def _seed_rank(pp_rank: int, megatron_init: bool) -> None:
    """megatron.training's _set_random_seed: seed + 100 x pipeline rank, torch's and the model-parallel RNGs."""
    if megatron_init:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(1234 + 100 * pp_rank)
        model_parallel_cuda_manual_seed(1234 + 100 * pp_rank)


def _megatron_chunk(spec, config, pre_process, post_process, vp_stage):
    """One GPTModel chunk with Megatron's own initialisation (the harness's build_chunk without its reseeding)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec.vocab,
                    max_sequence_length=spec.seq, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
                    vp_stage=vp_stage)


def _attach_shards(chunks, plan, split, rank, config, spec, build_head_shard) -> None:
    """The owner's head handed out as HeadShards, each attached as its chunk's `output_layer`."""
    last = plan.num_stages - 1
    owner = plan.stages[last].device
    mine = plan.stages_of(rank)
    at = mine.index(last) if rank == owner else len(mine) - 1
    weight = chunks[at].output_layer.weight if rank == owner else None
    shard = build_head_shard(config, split=split, device=rank, owner=owner, vocab_size=spec.vocab,
                             hidden_size=spec.hidden, owner_weight=weight)
    if rank == owner:
        del chunks[at].output_layer  # Megatron's ColumnParallelLinear goes; the shard (if any) takes its name
    if shard is not None:
        chunks[at].output_layer = shard


def setup(spec, layout: dict):
    """(DDP chunks, distributed Adam, head split) of one layout, parameters seeded by global name."""
    from megatron.core.distributed import finalize_model_grads

    chunks, config, split = build(spec, layout)
    chunks = H.wrap_ddp(chunks, config)
    opt = H.make_optimizer(chunks)
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, opt, split


def _pieces(chunks) -> list:
    """[(name, global row offset of a head piece or None, parameter)] of this rank: head pieces (a HeadShard, or
    Megatron's output_layer: its TP slice) by their rows of the global head, other parameters by global name
    (and TP rank for a TP-split one: its TP slices are the same under every pipeline layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel

    from octopipe_plugin.adapters.megatron.vocab_shards import HeadShard

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = []
    for c in chunks:
        inner = c.module if isinstance(c, DistributedDataParallel) else c
        inner = inner if hasattr(inner, "decoder") else getattr(inner, "module", inner)  # Float16Module
        head = getattr(inner, "output_layer", None)
        emb = getattr(getattr(inner, "embedding", None), "word_embeddings", None)
        for name, p in H.global_names(inner).items():
            if isinstance(head, HeadShard) and p is head.weight:  # (the harness may name it with its rows)
                out.append((HEAD, head.rows[0], p))
            elif isinstance(emb, HeadShard) and p is emb.weight:  # a split embedding's EmbeddingShard
                out.append((EMBEDDING, emb.rows[0], p))
            elif name in ROWS:  # Megatron's output_layer / word embedding: its TP slice of the rows
                out.append((name, tp_rank * p.shape[0], p))
            else:
                split_tp = tp > 1 and getattr(p, "tensor_model_parallel", False)  # replicated over TP: one value
                out.append((f"{name}@tp{tp_rank}" if split_tp else name, None, p))
    return out


def _full_shape(spec, name: str, p) -> tuple:
    """The global tensor a piece belongs to: the whole head, or the parameter (TP slice) itself."""
    return (spec.vocab, spec.hidden) if name in ROWS else tuple(p.shape)


def gathered(spec, chunks, value) -> dict[str, torch.Tensor]:
    """{global name: the whole global tensor} of `value(param)` over the pipeline (head rows assembled, every
    row required exactly once)."""
    from megatron.core import parallel_state as ps

    # one data-parallel replica speaks (the others hold the same parameters)
    mine = [(name, lo, value(p).detach().double().clone()) for name, lo, p in _pieces(chunks)
            ] if ps.get_data_parallel_rank() == 0 else []
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return _assemble(spec, [item for part in parts for item in part])


def _assemble(spec, items) -> dict[str, torch.Tensor]:
    """{global name: tensor} of (name, head row offset or None, tensor) pieces, the head's rows put together."""
    out, seen = {}, {}
    for name, lo, t in items:
        if lo is None:
            out.setdefault(name, t)
            continue
        full = out.setdefault(name, torch.full((spec.vocab, spec.hidden), float("nan"), dtype=torch.float64))
        seen.setdefault(name, torch.zeros(spec.vocab, dtype=torch.int))[lo:lo + len(t)] += 1
        full[lo:lo + len(t)] = t
    for name, cnt in seen.items():
        assert bool((cnt == 1).all()), f"{name}: rows held {cnt.tolist()} times"
    return out


def adam_state(spec, opt, chunks) -> dict:
    """{'exp_avg': {name: tensor}, 'exp_avg_sq': ..., 'param': fp32 main params, 'steps': [...]} by global name:
    each data-parallel rank's distributed optimizer holds its range of each parameter's state; the ranges of
    all ranks put together (every element required)."""
    subs = getattr(opt, "chained_optimizers", [opt])
    keys = ("exp_avg", "exp_avg_sq", "param")
    mine = []
    for name, lo, p in _pieces(chunks):
        for sub in subs:
            if p in sub.model_param_group_index_map:
                state = sub._get_main_param_and_optimizer_states(p)
                where = sub._get_model_param_range_map(p)["param"]
                mine.append((name, lo, tuple(p.shape), where.start,
                             {k: state[k].detach().double().reshape(-1).clone() for k in keys}))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    flat: dict = {}
    for name, lo, shape, start, tensors in (item for part in parts for item in part):
        numel = torch.Size(shape).numel()
        for k, t in tensors.items():
            full = flat.setdefault((k, name, lo, shape), torch.full((numel,), float("nan"), dtype=torch.float64))
            full[start:start + len(t)] = t  # data-parallel replicas of a piece fill their own ranges
    out = {k: _assemble(spec, [(name, lo, t.view(shape)) for (kk, name, lo, shape), t in flat.items() if kk == k])
           for k in keys}
    for k, d in out.items():
        for name, t in d.items():
            assert not t.isnan().any(), f"optimizer {k} of {name}: some elements held by no rank"
    steps = sorted({float(g["step"]) for sub in subs for g in sub.optimizer.param_groups if "step" in g}
                   | {float(s["step"]) for sub in subs for s in sub.optimizer.state.values() if "step" in s})
    all_steps = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, steps)
    out["steps"] = sorted({s for part in all_steps for s in part})
    return out


def global_grad(spec, name: str, shape: tuple, step: int) -> torch.Tensor:
    """The gradient every layout feeds for global tensor `name` at `step` (float64, split-independent)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    return torch.randn(shape, generator=g, dtype=torch.float64)


def step_with(spec, chunks, opt, steps) -> None:
    """Optimizer steps on the fed gradients: main_grad of every (shard) parameter, Megatron's finalize, Adam."""
    from megatron.core.distributed import finalize_model_grads

    from octopipe_plugin.adapters.megatron.embeddings import sum_head_tie

    for step in steps:
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        for name, lo, p in _pieces(chunks):
            g = global_grad(spec, name, _full_shape(spec, name, p), step)
            p.main_grad.copy_(g if lo is None else g[lo:lo + p.shape[0]])
        sum_head_tie(chunks)  # a split tied head: its rows' gradients summed with the embedding's (the schedule's)
        finalize_model_grads(chunks)
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"


def run_case(spec, case: dict, root: str) -> dict:
    """Two steps under `first`; and one step under `first`, save, load under `second`, one step."""
    chunks, opt, _ = setup(spec, case["first"])
    step_with(spec, chunks, opt, range(2))
    straight = gathered(spec, chunks, lambda p: p)
    chunks, opt, _ = setup(spec, case["first"])
    step_with(spec, chunks, opt, range(1))
    saved_w, saved_adam = gathered(spec, chunks, lambda p: p), adam_state(spec, opt, chunks)
    path = os.path.join(root, case["name"].replace(" ", "_").replace(">", ""))
    S.save(chunks, opt, path)
    first_chunks = chunks
    embedding = embedding_rows(spec, case["embedding_rows"], path) if case.get("embedding_rows") else None
    chunks, opt, _ = setup(spec, case["second"])
    shards = [_embedding_shards(c) for c in (first_chunks, chunks)]
    S.load(chunks, opt, path)
    loaded_w, loaded_adam = gathered(spec, chunks, lambda p: p), adam_state(spec, opt, chunks)
    step_with(spec, chunks, opt, range(1, 2))
    return {"saved_w": saved_w, "loaded_w": loaded_w, "saved_adam": saved_adam, "loaded_adam": loaded_adam,
            "straight": straight, "resumed": gathered(spec, chunks, lambda p: p), "embedding": embedding,
            "embedding_shards": shards}


def _embedding_shards(chunks) -> int:
    """EmbeddingShards over the pipeline (a split embedding's ranks each hold one)."""
    from octopipe_plugin.adapters.megatron.split_embedding import EmbeddingShard

    n = torch.tensor(sum(isinstance(m, EmbeddingShard) for c in chunks for m in c.modules()))
    dist.all_reduce(n)
    return int(n)


def embedding_rows(spec, rows: list, path: str) -> torch.Tensor:
    """The word embedding as HeadShards under its own key (rank r: rows `rows[r]`) load from the checkpoint at
    `path`; their rows put together."""
    from megatron.core import dist_checkpointing

    from octopipe_plugin.adapters.megatron.vocab_shards import HeadShard

    config = H.make_config(spec, dist.get_world_size())
    shard = HeadShard(config, vocab_size=spec.vocab, hidden_size=spec.hidden, rows=rows[dist.get_rank()],
                      key="embedding.word_embeddings.weight", extra_state=False)
    shard.weight.data.fill_(float("nan"))
    loaded = dist_checkpointing.load({"rows": shard.sharded_state_dict("rows.")}, path)
    shard.load_state_dict({k[len("rows."):]: v for k, v in loaded["rows"].items()})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (shard.rows[0], shard.weight.detach().double().clone()))
    full = torch.full((spec.vocab, spec.hidden), float("nan"), dtype=torch.float64)
    for lo, t in parts:
        full[lo:lo + len(t)] = t
    return full


def init_case(spec, case: dict) -> dict:
    """Megatron's own initial values of a plan built whole (the unsplit run) and with its head split."""
    whole, _, _ = build(spec, {**case["split"], "split": False}, megatron_init=True)
    want = gathered(spec, whole, lambda p: p)
    parts, _, _ = build(spec, case["split"], megatron_init=True)
    return {"whole": want, "split": gathered(spec, parts, lambda p: p)}


def worker(rank: int, world: int, port: int, spec, cases: list[dict], root: str, out_path: str) -> None:
    """Spawn target: every case in turn ('init' cases: initial values, others: checkpoints); rank 0 saves results."""
    H.init_process(rank, world, port)
    logging.disable(logging.INFO)
    if tp_size(spec) > 1:
        shim_device_arch()
    results = {}
    for case in cases:
        try:
            at = case.get("spec", spec)  # a case may bring its own model (the tied one beside untied cases)
            results[case["name"]] = init_case(at, case) if case.get("init") else run_case(at, case, root)
        except Exception:
            results[case["name"]] = {"error": f"rank {rank}: {traceback.format_exc()}"}
            torch.save(results, out_path if rank == 0 else f"{out_path}.rank{rank}")
            raise
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def save_rows_worker(rank: int, world: int, port: int, spec, rows: list, root: str, out_path: str) -> None:
    """Spawn target: rank r saves a HeadShard of rows `rows[r]` (values: the row numbers) through dist_checkpointing;
    each rank writes what the save said ('ok' or the exception's line) before leaving."""
    from megatron.core import dist_checkpointing

    from octopipe_plugin.adapters.megatron.vocab_shards import HeadShard

    H.init_process(rank, world, port)
    logging.disable(logging.WARNING)
    init_parallel(spec, world, 1)
    config = H.make_config(spec, world)
    lo, hi = rows[rank]
    shard = HeadShard(config, vocab_size=spec.vocab, hidden_size=spec.hidden, rows=(lo, hi),
                      weight=torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(-1, spec.hidden).clone())
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    try:
        dist_checkpointing.save(shard.sharded_state_dict("output_layer."), root)
        said = "ok"
    except Exception as exc:  # noqa: BLE001 - the test reads what the save said
        said = f"{type(exc).__name__}: {exc}"
    torch.save(said, f"{out_path}.rank{rank}")
    if said == "ok":
        dist.barrier()
        dist.destroy_process_group()
