"""`OctoPipeEngine`: DeepSpeed's PipelineEngine running an OctoPipe plan through the executor.

What is kept from PipelineEngine: topology, data iterator and batch function, `train_batch()`
and `eval_batch()` return values (mean loss over micro-batches and data-parallel replicas,
broadcast from the rank holding the last stage), tied-weight and data-parallel gradient
reduction (incl. ZeRO-1 and bf16), the optimizer step with its LR scheduler, overflow skip and
`global_steps`, activation checkpointing, checkpoints. What changes: the order of the actions
(the plan's, with several stages per rank and split backward), the p2p (the executor's), and
gradient clipping, which counts every pipeline stage's gradients (PipelineEngine's fp32 path
counts pipeline rank 0's only: deepspeed/runtime/utils.py clip_grad_norm_). With data
parallelism, each stage's all-reduce starts at its last backward of the step (overlap.py) where
DeepSpeed's reduction is a plain bucketed all-reduce. The executor runs on the engine's device.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import replace

import torch
import torch.distributed as tdist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine

from ...errors import OctoPipeError
from ...executor import ExecutorOptions, PipelineExecutor
from ...executor.engine import forward_plan
from ...executor.tied_rows import sum_rows
from ...executor.vocab_shard import VocabShards
from ...formats import plan_to_dict
from ...actions import Action, Kind
from .checkpoint import load_checkpoint, save_records
from .config import check_microbatches, refused
from .memory import apply_plan_memory
from .module import OctoPipePipelineModule
from .overlap import StageReduction, overlap_applies
from .shm import release_shm_buffers
from .stages import DeepSpeedStages

log = logging.getLogger(__name__)
PLAN_FILE = "octopipe_plan.json"


class OctoPipeEngine(PipelineEngine):
    """PipelineEngine whose train_batch/eval_batch run the module's OctoPipe plan."""

    def __init__(self, *args, **kwargs):
        self._octopipe_ready = False  # PipelineEngine.__init__ warms p2p up by topological stage ids
        self._step_tokens = None  # a split embedding's token ids of the step on its shard ranks ([m, mbs, seq])
        super().__init__(*args, **kwargs)
        release_shm_buffers()  # DeepSpeed's CPU shm all-reduce buffers out of /dev/shm, every rank having mapped them
        if not isinstance(self.module, OctoPipePipelineModule) or self.module.octopipe_plan is None:
            raise OctoPipeError("OctoPipeEngine needs an OctoPipePipelineModule built with plan= or config=")
        self.plan = self.module.octopipe_plan
        check_microbatches(self.plan.num_microbatches, self.micro_batches)
        self._use_torch_checkpoint()
        block = self.module.octopipe_block
        # weight gradients reach p.grad through autograd's AccumulateGrad, so DeepSpeed's gradient hooks
        # (bf16 immediate_grad_update, ZeRO) fire once per parameter and action
        self._runner = DeepSpeedStages(self, grad_sink="autograd", shards=self._head_shards(),
                                       memory=self._plan_memory(), paired=self._plan_pairs())
        self._pipe_group = self.grid.get_pipe_parallel_group()
        options = ExecutorOptions(timeout_s=block.timeout_s if block is not None else 300.0)
        wants = block.overlap_dp_reduction if block is not None else True
        self._overlap = StageReduction(self) if wants and overlap_applies(self) else None
        # the engine's device: receive buffers and sent gradients live where the module does (NCCL needs it)
        self._executor = PipelineExecutor(self.plan, self._runner, group=self._pipe_group, device=self.device,
                                          options=options,
                                          on_last_backward=self._overlap.start if self._overlap else None)
        self._forward_executors: dict[int, PipelineExecutor] = {}
        self._octopipe_ready = True
        if self.training_data:
            self._build_data_iter(self.training_data)  # first/last stage now mean the plan's
        log.info("octopipe: rank %d runs stages %s of %d", self.global_rank, self.module.local_stages,
                 self.plan.num_stages)

    def _plan_memory(self):
        """The plan's per-layer recompute/offload on this rank's stages; a refusal on any rank ends every rank with
        its line (a rank checks only the layers it builds)."""
        if not self.plan.memory:
            return None
        memory, problem = None, None
        try:
            memory = apply_plan_memory(self.module, self.plan)
        except OctoPipeError as exc:
            problem = str(exc)
        problems = [None] * tdist.get_world_size()
        tdist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first is not None:
            raise refused(OctoPipeError(first))
        return memory

    def _plan_pairs(self) -> bool:
        """Whether the plan has overlapped pairs, run phase by phase (moe_pairs.py); a rank that cannot run them ends
        every rank with its line (a rank checks only the stages it builds)."""
        if not self.plan.pairs:
            return False
        from .moe_pairs import pairs_problem

        problems = [None] * tdist.get_world_size()
        tdist.all_gather_object(problems, pairs_problem(self.module, self.plan))
        first = next((p for p in problems if p), None)
        if first is not None:
            raise refused(OctoPipeError(first))
        return True

    def _head_shards(self):
        """The object running this rank's shard actions of a split plan (None without splits)."""
        if not self.plan.splits:
            return None
        given = self.module.octopipe_shards
        if given is not None:  # stand-ins (the benchmarks): the object, or a callable building it for this engine
            shards = given if hasattr(given, "head_forward") else given(self)
            if getattr(shards, "report", None) is None:  # J reports through this engine's runner, as below
                shards.report = lambda mb, per_token, coef: self._runner.report(mb, per_token, coef)
            return shards
        head, shard = self.module.octopipe_head, self.module.head_shard()
        emb, emb_shard = self.module.octopipe_embedding, self.module.embedding_shard()
        # the head input's meta is learned per step (the shard ranks see no data), the embedding's lookups' from the
        # step's token ids (_exchange_tokens); J reports through the runner
        return VocabShards(plan=self.plan, rank=self.module.stage_id, vocab_size=(head or emb).vocab,
                           head_weight=shard.weight if shard is not None else None,
                           head_rows=head.rows if head is not None else None,
                           embedding_weight=emb_shard.weight if emb_shard is not None else None,
                           embedding_rows=emb.rows if emb is not None else None,
                           tokens=lambda mb: self._step_tokens[mb],
                           report=lambda mb, per_token, coef: self._runner.report(mb, per_token, coef))

    def _exchange_tokens(self, num_microbatches: int) -> None:
        """A split embedding: the step's token ids read on stage 0's rank (every micro-batch's batch[0], ahead of
        the step) and sent to the embedding's shards (executor/token_exchange.py: a refusal there ends every
        pipeline rank with its line); the lookups' meta [mbs, seq, hidden] from their shape."""
        from ...executor.interface import TensorMeta
        from ...executor.token_exchange import exchange_tokens

        emb = self.module.octopipe_embedding
        self._step_tokens = None
        if emb is None:
            return
        owner = self.plan.stages[0].device
        read = []

        def stage0_tokens():
            read.append(self._runner.step_tokens(num_microbatches, emb.vocab))
            return read[0]

        got = exchange_tokens(emb.split, owner=owner, rank=self.module.stage_id, group=self._pipe_group,
                              read=stage0_tokens if self.module.stage_id == owner else None, shape=None,
                              num_microbatches=num_microbatches, device=self.device)
        tokens = read[0] if read else got
        if tokens is None:  # a rank off the embedding's shards and off stage 0 sends and receives no lookup
            return
        self._step_tokens = got
        dtype, _ = self.module.shard_dtype_device(emb)
        self._runner.shards.embedding_meta = TensorMeta(shape=(*tokens.shape[1:], emb.hidden), dtype=dtype)

    # ---- which rank plays which role -----------------------------------------------------------------
    def is_first_stage(self):
        """True if this rank holds the plan's first stage (it loads inputs)."""
        if not self._octopipe_ready:
            return super().is_first_stage()
        return 0 in self.module.local_stages

    def is_last_stage(self):
        """True if this rank holds the plan's last stage (it loads labels and computes the loss)."""
        if not self._octopipe_ready:
            return super().is_last_stage()
        return self.plan.num_stages - 1 in self.module.local_stages

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.plan.loss_device)

    def _use_torch_checkpoint(self) -> None:
        """DeepSpeed's checkpoint functions refuse autograd.grad, which split backward needs: use torch's."""
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

        if self.module.activation_checkpoint_func in (ds_ckpt.checkpoint, ds_ckpt.non_reentrant_checkpoint):
            self.module.activation_checkpoint_func = _torch_checkpoint
            if self.module.activation_checkpoint_interval > 0:
                log.info("octopipe: activation checkpointing with torch.utils.checkpoint (use_reentrant=False); "
                         "DeepSpeed's raises 'not compatible with .grad()' under split backward")

    # ---- the step ------------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Run one step of the plan, reduce, clip, step; returns the mean loss (as PipelineEngine does)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self.total_additional_losses = None
        self._compute_loss = True
        self.timers(TRAIN_BATCH_TIMER).start()
        self._run_plan(self.micro_batches, compute_loss=True)
        self._exec_reduce_tied_grads()
        if self._overlap is None:
            self._exec_reduce_grads()
        else:  # each stage's reduction started at its last backward; the tied and shared ones go now
            self._overlap.finish()
            self._force_grad_boundary = True
            self.buffered_allreduce_fallback(grads=self._overlap.rest(), elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
            self._force_grad_boundary = False
        self._exec_optimizer_step()
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        self.timers(TRAIN_BATCH_TIMER).stop()
        if self.steps_per_print() is not None and self.global_steps % self.steps_per_print() == 0:
            elapsed = self.timers(TRAIN_BATCH_TIMER).elapsed(reset=True) / 1000.0
            if self.global_rank == 0:
                iter_time = elapsed / self.steps_per_print()
                log.info("steps: %d loss: %.4f iter time (s): %.3f samples/sec: %.3f", self.global_steps,
                         float(self.agg_train_loss), iter_time, self.train_batch_size() / iter_time)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        """Forward only through the plan's stages; the mean loss as PipelineEngine.eval_batch returns it.

        With `return_logits`, `(loss, outputs)` as PipelineEngine returns them: the last micro-batch's
        outputs of the last stage on the rank holding it, None elsewhere."""
        self.module.eval()
        self._compute_loss = compute_loss
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        tdist.barrier()
        try:
            with torch.no_grad():
                self._run_plan(m, compute_loss=compute_loss, forward_only=True, keep_outputs=return_logits)
            eval_output = None
            if self.is_last_stage():
                eval_output = self._reduce_outputs(self.fwd_outputs, reduce=reduce_output, micro_batches=m)
            if compute_loss and (bcast_loss or self.monitor.enabled):
                eval_output = self._bcast_pipe_scalar(eval_output)
        finally:
            self.set_dataiterator(train_iterator)
            self.module.train()
        if return_logits:
            logits = self._runner.outputs.get(m - 1)
            self._runner.outputs = {}
            return eval_output, logits
        return eval_output

    def _forward_executor(self, m: int) -> PipelineExecutor:
        """The executor of an evaluation of m micro-batches: the plan's own (its forwards) when m is the plan's.

        Another count runs every F of the plan's stages in (micro-batch, stage) order, a topological
        order of the forward dependencies, so each device's share cannot deadlock whatever the placement
        (checked by the executor's validation like any plan).
        """
        if m == self.plan.num_microbatches:
            return self._executor
        if self.plan.splits:
            raise OctoPipeError(f"eval_batch(num_micro_batches={m}) under a plan with split layers: an evaluation "
                                f"runs the plan's own {self.plan.num_microbatches} micro-batches (its shard actions "
                                "are placed for them); evaluate with num_micro_batches=None")
        if m not in self._forward_executors:
            rows = [[] for _ in range(self.plan.num_devices)]
            for mb in range(m):
                for s, st in enumerate(self.plan.stages):
                    rows[st.device].append(Action(s, Kind.F, mb))
            plan = forward_plan(replace(self.plan, num_microbatches=m, schedule=tuple(tuple(r) for r in rows)))
            self._forward_executors[m] = PipelineExecutor(plan, self._runner, group=self._pipe_group,
                                                          device=self.device, options=self._executor.options)
        return self._forward_executors[m]

    def _run_plan(self, num_microbatches: int, *, compute_loss: bool, forward_only: bool = False,
                  keep_outputs: bool = False):
        """One executor step; leaves the last-stage rank's summed, unscaled loss in `total_loss`."""
        self._runner.begin_step(num_microbatches, compute_loss=compute_loss, keep_outputs=keep_outputs)
        self._exchange_tokens(num_microbatches)
        executor = self._forward_executor(num_microbatches) if forward_only else self._executor
        result = executor.run_step(forward_only=forward_only)
        if self._runner.pending():
            raise OctoPipeError(f"rank {self.global_rank}: {self._runner.pending()} (stage, micro-batch) states "
                                "left after the step")
        if self.is_last_stage():
            total = None
            for mb in sorted(self._runner.losses):
                loss = self._runner.losses[mb]
                total = torch.zeros_like(loss) if total is None else total
                total += loss
            self.total_loss = total
            self.fwd_outputs = [self._runner.losses[mb] for mb in sorted(self._runner.losses)]
        return result

    def _exec_reduce_tied_grads(self):
        """A split head tied to the embedding: its shards' gradients and the whole weight's summed (tied_rows), then
        DeepSpeed's tied all-reduce (over the whole weight's holders only; the head's entry is in no tie group).
        Before data-parallel reduction and ZeRO, as DeepSpeed's own tied reduction runs."""
        tie = self.module.head_tie()
        if tie is not None:
            full, shard = self.module.head_tie_tensors()
            sum_rows(tie, self._tied_grad(full), self._tied_grad(shard))
        super()._exec_reduce_tied_grads()

    def _tied_grad(self, p):
        """The gradient DeepSpeed's tied reduction reduces (bf16: the fp32 master's), zeros where none came."""
        if p is None:
            return None
        if self.using_bf16_optimizer:  # a flat fp32 fragment of the parameter's numel: viewed in its shape
            return p._hp_grad.view(p.shape)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    # ---- gradient clipping over every pipeline stage -------------------------------------------------
    def clip_fp32_gradients(self):
        """Clip on the norm of all gradients of the model (every stage, tied weights once)."""
        own = [p for p in self.module.parameters()
               if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in own:
            total += p.grad.detach().float().pow(2).sum()
        tdist.all_reduce(total, group=self.grid.get_model_parallel_group())
        norm = float(total.sqrt())
        self._global_grad_norm = norm
        coef = self.gradient_clipping() / (norm + 1e-6)
        if math.isfinite(norm) and coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
        return norm

    # ---- batch size ----------------------------------------------------------------------------------
    def set_train_batch_size(self, train_batch_size):
        """Refuse a batch size whose micro-batch count is not the plan's (the plan fixes M)."""
        per = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per == 0:
            check_microbatches(self.plan.num_microbatches, train_batch_size // per, "set_train_batch_size")
        super().set_train_batch_size(train_batch_size)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint plus the plan it was trained under (octopipe_plan.json)."""
        if tag is None:
            tag = f"global_step{self.global_steps}"
        ok = super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
        save_records(self, save_dir, tag)
        if self.global_rank == 0:
            with open(os.path.join(save_dir, str(tag), PLAN_FILE), "w", encoding="utf-8") as fh:
                json.dump(plan_to_dict(self.plan), fh, indent=1)
        tdist.barrier()
        return ok

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load; module weights under any partition, optimizer state mapped by name or refused."""
        stock = functools.partial(DeepSpeedEngine.load_checkpoint, self)
        return load_checkpoint(self, stock, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               custom_load_fn=custom_load_fn)


def _torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
