"""Megatron's `forward_backward_func`, running an OctoPipe plan through the executor.

`make_forward_backward_func(plan, model_graph)` returns a function with exactly the
interface `megatron/training/training.py` calls (`forward_step_func, data_iterator, model,
num_microbatches, seq_length, micro_batch_size, decoder_seq_length, forward_only,
collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn, force_all_reduce,
p2p_communicator, pg_collection`); `get_forward_backward_func_for(plan, model_graph)` is
the drop-in for `get_forward_backward_func(pp_size=, vp_size=, schedule_pg_collection=)`.

Per step: the rank's stages run in the plan's order (`MegatronStages`), with
`parallel_state.is_pipeline_first/last_stage` answering for the plan, so a forward step
written for Megatron (pretrain_gpt.py's get_batch) gives the loss chunk its labels wherever
the plan puts it. Afterwards, as Megatron's schedules do: the token count is made known
on every pipeline rank (broadcast from the rank that computed the loss, which under a
V-shape is not the last pp rank), tied embedding copies that share a rank are summed, and
`config.finalize_model_grads_func` runs. Returns one loss dict per micro-batch on the last
pipeline rank, where Megatron's train_step and evaluate reduce and log them (sent there
from the rank that computed the loss when the plan puts it elsewhere), and [] elsewhere.
`forward_only` runs every F of the plan, in the plan's order, keeping nothing for a backward.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import OctoPipeError
from ...executor import ExecutorOptions, PipelineExecutor
from ...executor.interface import TensorMeta
from .embeddings import sum_head_tie, sum_local_grads
from .mapping import embedding_split
from .memory import apply_plan_memory
from .placement import plan_float16_wrappers, plan_pipeline_view
from .loss_transfer import recv_loss_dicts, send_loss_dicts
from .stages import MegatronStages, split_phases

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleOptions:
    """How the OctoPipe schedule runs inside Megatron."""

    timeout_s: float = 600.0  # every wait of the executor is bounded by this
    split_linears: bool = True  # Megatron linears compute only their half at I / W (no recomputation)
    tags: bool = True


class _Executors:
    """One executor per pipeline group, on the training plan: its program, communicators (made by every rank
    of the world together, for every pipeline, by the executor's CommCache) and buffers are made once and
    reused by training steps and by evaluation steps of any micro-batch count (the executor's forward-only
    program of that count, `run_step(forward_only=True, num_microbatches=m)`)."""

    def __init__(self, plan, options: ScheduleOptions):
        self.plan = plan
        self.options = options
        self.cache: dict[int, PipelineExecutor] = {}

    def get(self, runner, rank: int, group) -> PipelineExecutor:
        """The executor of this group, bound to this step's runner (boundaries on the model's device)."""
        ex = self.cache.get(id(group))
        if ex is None:
            opts = ExecutorOptions(timeout_s=self.options.timeout_s, tags=self.options.tags)
            ex = PipelineExecutor(self.plan, runner, rank=rank, group=group, device=runner.device, options=opts)
            self.cache[id(group)] = ex
        ex.runner = runner
        return ex


def make_forward_backward_func(plan, model_graph=None, options: ScheduleOptions | None = None, shards=None):
    """A Megatron forward_backward_func that runs `plan` (checked and lowered once, executors cached).

    `shards(rank=, model=, config=, report=, hidden_meta=)`: the rank's shards of the plan's split layers (a
    VocabShards, or a stand-in), made each step; `report` is the owner's loss report (MegatronStages.head_loss)
    on the LM head's owner rank, None elsewhere; `hidden_meta` the head input's TensorMeta; under a split embedding
    also `tokens=` (mb -> the micro-batch's token ids [seq, mbs], read ahead on stage 0's rank and sent to the
    shards before the step: split_embedding.py). Default for plans with `splits`: `head_shards(plan)`, the
    HeadShard / EmbeddingShard each shard rank's chunks hold (placement.attach_head_shard / attach_embedding_shard)."""
    options = options or ScheduleOptions()
    executors = _Executors(plan, options)
    if shards is None and plan.splits:
        shards = head_shards(plan)

    def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                              micro_batch_size, decoder_seq_length=None, forward_only=False,
                              collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                              force_all_reduce=False, p2p_communicator=None, pg_collection=None):
        """Run one step of `plan` on this rank's chunks; loss dicts per micro-batch on the loss rank."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        model = model if isinstance(model, list) else [model]
        if not forward_only and num_microbatches != plan.num_microbatches:
            raise OctoPipeError(f"the OctoPipe plan was made for {plan.num_microbatches} micro-batches, this step has "
                                f"{num_microbatches} (global batch / (micro-batch size x data-parallel size)); "
                                "re-plan for this batch size (batch-size ramp-up changes it)")
        if adjust_tensor_shapes_fn is not None:
            raise OctoPipeError("adjust_tensor_shapes_fn is not supported by the OctoPipe schedule (fixed boundary "
                                "shapes per plan)")
        config = get_model_config(model[0])
        if getattr(config, "variable_seq_lengths", False):
            raise OctoPipeError("variable_seq_lengths is not supported by the OctoPipe schedule: boundary shapes are "
                                "fixed within a step")
        pp_group = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
        cp_size = (pg_collection.cp.size() if pg_collection is not None and getattr(pg_collection, "cp", None)
                   else parallel_state.get_context_parallel_world_size())
        tp_group = (pg_collection.tp if pg_collection is not None and getattr(pg_collection, "tp", None)
                    else parallel_state.get_tensor_model_parallel_group())
        tp_size = dist.get_world_size(tp_group)
        rank = dist.get_rank(pp_group)
        seq = decoder_seq_length or seq_length
        seq = seq // cp_size // (tp_size if config.sequence_parallel else 1)
        phases = split_phases(model) if options.split_linears else None
        memory = apply_plan_memory(plan, rank, model, config)  # the plan's per-layer recompute/offload, set up once
        plan_float16_wrappers(model, plan, rank)
        saved_sync = config.grad_sync_func, config.param_sync_func
        made: list = []  # the runner, for the owner's report (the shards are made before it)
        step_shards = None
        emb_split = embedding_split(plan)
        step_tokens: list = []  # a split embedding's token ids of this step ([m, seq, mbs]), exchanged below
        if shards is not None and plan.splits:
            owner = plan.stages[-1].device == rank
            # the token ids only where the plan splits the embedding: a head-only factory need not take them
            more = {"tokens": lambda mb: step_tokens[0][mb]} if emb_split is not None else {}
            step_shards = shards(rank=rank, model=model, config=config,
                                 report=(lambda mb, losses, coef: made[0].head_loss(mb, losses, coef)) if owner
                                 else None,
                                 hidden_meta=TensorMeta(shape=(seq, micro_batch_size, config.hidden_size),
                                                        dtype=config.pipeline_dtype or torch.float32), **more)
        runner = MegatronStages(plan=plan, rank=rank, model=model, forward_step_func=forward_step_func,
                                data_iterator=data_iterator, config=config, num_microbatches=num_microbatches,
                                tensor_shape=(seq, micro_batch_size, config.hidden_size), forward_only=forward_only,
                                collect_non_loss_data=collect_non_loss_data, cp_size=cp_size, phases=phases,
                                shards=step_shards, tp=(dist.get_rank(tp_group), tp_size), memory=memory)
        made.append(runner)
        if emb_split is not None:  # stage 0's forward steps read ahead; their token ids to the embedding's shards
            from ...executor.token_exchange import exchange_tokens
            from .split_embedding import stacked_tokens

            step_tokens.append(exchange_tokens(emb_split, owner=plan.stages[0].device, rank=rank, group=pp_group,
                                               read=lambda: stacked_tokens(runner.read_stage0_calls()),
                                               shape=(seq, micro_batch_size), num_microbatches=num_microbatches,
                                               device=runner.device))
        ex = executors.get(runner, rank, pp_group)
        try:
            if forward_only:
                config.grad_sync_func, config.param_sync_func = None, None
            with plan_pipeline_view(plan, rank), runner.sync:
                if forward_only:
                    with torch.no_grad():  # evaluation may run another micro-batch count than training
                        ex.run_step(forward_only=True, num_microbatches=num_microbatches)
                else:
                    ex.run_step()
        finally:
            config.grad_sync_func, config.param_sync_func = saved_sync
        if runner.pending():
            raise OctoPipeError(f"pipeline rank {rank}: {runner.pending()} (stage, micro-batch) pairs still hold "
                                "state after the step (the plan misses backward actions)")
        if not forward_only:
            shard_grads_to_main_grad(runner.shard_weights())
            sum_local_grads(model)  # same-rank tied copies: summed before their reduction starts
            sum_head_tie(model)  # a split head tied to the embedding: its rows' gradients summed with the shards'
            runner.sync.sync_held()
            _finalize(plan, rank, model, config, runner, pp_group, pg_collection, force_all_reduce)
        return _losses_for_megatron(plan, rank, runner, pp_group, num_microbatches, runner.device)

    forward_backward_func.plan = plan
    return forward_backward_func


def head_shards(plan):
    """The default shards factory: a VocabShards over the HeadShard and EmbeddingShard of this rank's chunks (None
    off the shard set; stage 0's rank of a split embedding gets one without rows: it receives the partials), the
    head's statistics and partials reduced over Megatron's tensor-parallel group at TP > 1 (build_head_shard's TP
    rank; a split embedding runs at TP=1 only)."""
    from ...executor.vocab_shard import VocabShards

    from .vocab_shards import shard_tensor_parallel

    def make(*, rank, model, config, report, hidden_meta, tokens=None):
        from .split_embedding import EmbeddingShard, FedLookup

        head, emb = find_head_shard(model), find_head_shard(model, EmbeddingShard)
        # stage 0's rank of a split embedding without rows of it (a FedLookup) still receives the partials
        some = head or emb or find_head_shard(model, FedLookup)
        if some is None:
            return None  # a rank off the shard set runs no shard action
        return VocabShards(plan=plan, rank=rank, vocab_size=some.vocab_size, head_weight=head.weight if head else None,
                           head_rows=head.rows if head else None, embedding_weight=emb.weight if emb else None,
                           embedding_rows=emb.rows if emb else None, hidden_meta=hidden_meta, tokens=tokens,
                           report=report, grad_sink="autograd",
                           tp=shard_tensor_parallel(head, config) if head is not None else None)

    return make


def find_head_shard(model, kind=None):
    """The HeadShard among the rank's chunks (placement.attach_head_shard put it there), or None; `kind`: the
    shard class to look for instead (split_embedding.EmbeddingShard, a HeadShard under the embedding's key)."""
    from .split_embedding import EmbeddingShard
    from .vocab_shards import HeadShard

    for chunk in model:
        for m in chunk.modules():
            if (isinstance(m, kind) if kind is not None
                    else isinstance(m, HeadShard) and not isinstance(m, EmbeddingShard)):
                return m
    return None


def shard_grads_to_main_grad(weights) -> None:
    """Move the shard weights' gradients (K/G add them into `.grad`) into DDP's `main_grad`, as DDP's own
    post-accumulate hook does for every other parameter; their chunks' reduction starts after the step."""
    for w in weights:
        if w.grad is not None and getattr(w, "main_grad", None) is not None:
            w.main_grad.add_(w.grad.data)
            w.grad = None


def _losses_for_megatron(plan, rank: int, runner, pp_group, num_microbatches: int, device) -> list:
    """The loss dicts per micro-batch on the last pipeline rank (where train_step / evaluate reduce and log
    them), [] elsewhere; under a plan that computes the loss on another rank (V-shape) they are sent there
    as tensors (only their structure is pickled: nothing on a GPU travels through pickling)."""
    loss_rank, last = plan.loss_device, dist.get_world_size(pp_group) - 1
    mine = [runner.loss_data[mb] for mb in range(num_microbatches)] if rank == loss_rank else None
    if loss_rank == last:
        return mine if rank == last else []
    if rank == loss_rank:
        send_loss_dicts(mine, last, pp_group)
        return []
    if rank == last:
        return recv_loss_dicts(loss_rank, pp_group, device)
    return []


def _finalize(plan, rank, model, config, runner, pp_group, pg_collection, force_all_reduce) -> None:
    """Token count on every rank (from the loss rank), then Megatron's finalize_model_grads_func."""
    num_tokens = runner.num_tokens.clone()
    loss_rank = plan.loss_device
    dist.broadcast(num_tokens, group_src=loss_rank, group=pp_group)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(model, num_tokens if config.calculate_per_token_loss else None,
                                         pg_collection=pg_collection, force_all_reduce=force_all_reduce)


# One schedule per plan content for the life of the process: Megatron asks its factory again in
# every train() and evaluate() call, and the executors (communicators, programs) must be made once.
_SCHEDULES: dict[str, object] = {}


def get_octopipe_forward_backward_func(plan, pp_size=None, vp_size=None, schedule_pg_collection=None, **unused):
    """What the launch integration returns from Megatron's `get_forward_backward_func(...)` under a plan."""
    from ...formats import plan_to_dict

    key = json.dumps(plan_to_dict(plan), sort_keys=True)
    fn = _SCHEDULES.get(key)
    if fn is None:
        fn = _SCHEDULES[key] = make_forward_backward_func(plan)
    return fn


def get_forward_backward_func_for(plan, model_graph=None, options: ScheduleOptions | None = None):
    """Drop-in for megatron's `get_forward_backward_func(pp_size=, vp_size=, schedule_pg_collection=)`."""
    fn = make_forward_backward_func(plan, model_graph, options)

    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        """The OctoPipe schedule of the plan (the pipeline sizes come from the plan)."""
        return fn

    return get_forward_backward_func
