"""The executor's StageRunner over Megatron model chunks, keeping Megatron's training contract.

F runs Megatron's own `schedules.forward_step` (set_is_first_microbatch on a chunk's first
executed forward, set_current_microbatch, set_input_tensor through DDP, autocast, the 2-
and 3-tuple loss scaling, MoE / MTP / attention-variant auxiliary-loss scales on every
rank), with `is_last_stage` taken from the plan. B runs Megatron's `backward_step`
(grad_scale_func on the loss). With `deallocate_pipeline_outputs` (Megatron's default) a
sent output is pseudo-freed as Megatron's schedules do: the executor sends an alias of its
storage, which lives only until the send completes, and the kept output holds just its
autograd node (B takes Megatron's `custom_backward`; I and W see the output's shape through
a zero-stride view of one element). I and W split the backward for real: the linears compute
only their input GEMM at I and only their weight GEMM at W (`wgrad`), every parameter
gradient reaches `main_grad` through AccumulateGrad, so DDP's hooks fire. The F/B/I/W life
cycle itself (what each action keeps, the first stage's "W does it all") is the executor's
`stage_core.StageCore`; this module gives its Megatron hooks.

Gradient synchronisation follows Megatron's interleaved schedule: each chunk's
`no_sync_func` is active during the step; without `grad_sync_func` it is lifted just before
the chunk's last gradient-producing action (the executor passes `last_backward=True` to it,
from the lowered plan), so DDP's hooks start the reduction; with `grad_sync_func` that action
still runs under no_sync and the sync is lifted and `grad_sync_func[c]` called right after
it. `param_sync_func[c]` runs before the chunk's first forward.

Split layers (docs/formats.md, "Split layers"): the shard actions (H, J, K; E, G) run in the
`shards=` object (a VocabShards, or a stand-in). Under a split LM head the owner (the last
stage) runs without Megatron's output layer and loss: its F hands on `(hidden, targets, coef)`
(`split_head`), its backward starts from the shards' summed partial input gradients, and its
J reports Megatron's loss through the forward step's `loss_func` (`head_loss`). Under a split
embedding stage 0's forward steps are read ahead (`read_stage0_calls`, split_embedding.py), its
F replays the kept model call on the shards' summed partials (fed to its word_embeddings) and
its backward gives their gradient back. A chunk holding a shard weight starts its gradient
reduction after the step (its gradients arrive at K or G, which are no weight-gradient actions
of any stage).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from octopipe_plugin.actions import RULES, Kind
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.executor.data import MicroBatches
from octopipe_plugin.executor.interface import LossOutput, TensorMeta
from octopipe_plugin.executor.lowered import lowered_plan
from octopipe_plugin.executor.stage_core import Forwarded, StageCore

from . import split_head
from .hooks import pipeline_view
from .wgrad import Phase, enable_wgrad_split, input_pass, te_modules_of, weight_pass


class _BatchAt:
    """An iterator that yields batch `mb` of a chunk's stream when (and only if) the forward step reads it."""

    def __init__(self, batches: MicroBatches | None, mb: int):
        self.batches, self.mb = batches, mb

    def __iter__(self):
        return self

    def __next__(self):
        if self.batches is None:
            raise StopIteration
        return self.batches.get(self.mb)


def _per_chunk(value, n: int) -> list:
    """Megatron passes one item for a single chunk and a list for several."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"got {len(value)} per-chunk entries for {n} model chunks")
        return value
    return [value] * n


class GradSync:
    """no_sync / grad_sync / param_sync of one step, per chunk, as Megatron's interleaved schedule runs them."""

    def __init__(self, config, model, last_chunk: int | None, forward_only: bool, hold: set[int] = frozenset()):
        n = len(model)
        self.model = model
        self.hold = set(hold)  # chunks whose reduction waits for `sync_held` (same-rank tied copies)
        # the chunk whose last gradient-producing action is the rank's last one (a shared no_sync holds until then)
        self.last_chunk = last_chunk
        no_sync = config.no_sync_func
        self.shared = no_sync is not None and not isinstance(no_sync, list) and n > 1
        self.no_sync = _per_chunk(no_sync, n) if not self.shared else [no_sync] + [None] * (n - 1)
        self.grad_sync = None if forward_only else config.grad_sync_func
        self.param_sync = None if forward_only else config.param_sync_func
        if self.grad_sync is not None:
            self.grad_sync = _per_chunk(self.grad_sync, n)
        if self.param_sync is not None:
            self.param_sync = _per_chunk(self.param_sync, n)
        self.stack = contextlib.ExitStack()
        self.open: dict[int, contextlib.ExitStack] = {}
        self.started: set[int] = set()

    def __enter__(self):
        for c, fn in enumerate(self.no_sync):
            if fn is not None:
                inner = contextlib.ExitStack()
                inner.enter_context(fn())
                self.open[c] = inner
        return self

    def __exit__(self, *exc):
        for c in sorted(self.open):
            self.open.pop(c).close()
        return False

    def before_forward(self, c: int) -> bool:
        """param_sync before the chunk's first forward; True on that first forward."""
        if c in self.started:
            return False
        self.started.add(c)
        if self.param_sync is not None:
            self.param_sync[c](self.model[c].parameters())
        return True

    def before_grad(self, c: int, last_backward: bool) -> None:
        """Without grad_sync_func: lift the chunk's no_sync just before its last gradient-producing action
        (the executor's `last_backward`; DDP's hooks then start the reduction as the gradients arrive)."""
        if self.grad_sync is None and c not in self.hold and last_backward:
            self._lift(c)

    def after_grad(self, c: int, last_backward: bool) -> None:
        """With grad_sync_func: right after the chunk's last gradient-producing action, lift its no_sync
        and start its reduction (the backward itself ran under no_sync, as in Megatron's schedules)."""
        if self.grad_sync is not None and c not in self.hold and last_backward:
            self._lift(c)
            self.grad_sync[c](self.model[c].parameters())

    def sync_held(self) -> None:
        """Start the reduction of the held chunks (after their tied copies' gradients were summed)."""
        for c in sorted(self.hold):
            self._lift(c)
            if self.grad_sync is not None:
                self.grad_sync[c](self.model[c].parameters())
            elif getattr(getattr(self.model[c], "ddp_config", None), "overlap_grad_reduce", False):
                self.model[c].start_grad_sync()  # finalize's finish_grad_sync expects it issued

    def _lift(self, c: int) -> None:
        if self.shared:
            # one no_sync for every chunk: it holds until the rank's last gradient-producing action
            if c == self.last_chunk and 0 in self.open:
                self.open.pop(0).close()
        elif c in self.open:
            self.open.pop(c).close()


class MegatronStages(StageCore):
    """StageRunner for the stages one rank holds; `model[v]` is the chunk of the rank's v-th stage.

    The life cycle is the executor's `StageCore`; this class gives Megatron's call (forward_step), loss
    (inside forward_step), gradient scale (`config.grad_scale_func`), fused backward (backward_step), the
    split linears' I/W passes, and the gradient synchronisation around every weight-gradient action.
    """

    def __init__(self, *, plan, rank: int, model: Sequence[torch.nn.Module], forward_step_func: Callable,
                 data_iterator, config, num_microbatches: int, tensor_shape: tuple[int, ...],
                 forward_only: bool = False, collect_non_loss_data: bool = False, cp_size: int = 1,
                 phases: Sequence[Phase] | None = None, shards=None, tp: tuple[int, int] = (0, 1), memory=None):
        # memory: the plan's memory choices on these chunks (memory.apply_plan_memory's LayerMemory)
        super().__init__(num_stages=plan.num_stages, num_microbatches=num_microbatches,
                         grad_scale=config.grad_scale_func, shards=shards, memory=memory)
        self.plan = plan
        self.rank = rank
        # from the plan (a stand-in shards object need not say): the owner's backward starts from the partials
        self.head_split = check_split_plan(plan, rank, shards, config, collect_non_loss_data)
        from .mapping import embedding_split

        # stage 0 takes the shards' summed partials and gives their gradient back (split_embedding.py)
        self.embedding_split = embedding_split(plan) is not None
        self.stages = plan.stages_of(rank)
        if len(model) != len(self.stages):
            raise ValueError(f"pipeline rank {rank}: the plan places {len(self.stages)} stages "
                             f"({self.stages}) here but the model has {len(model)} chunks")
        self.chunk_of = {s: v for v, s in enumerate(self.stages)}
        self.model = list(model)
        self.forward_step_func = forward_step_func
        self.config = config
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.cp_size = cp_size
        self.tp = tp  # (tensor-parallel rank, size): under sequence parallelism the owner hands over its block
        self.phases = list(phases) if phases is not None else [Phase() for _ in self.model]
        self.te = [te_modules_of(m) for m in self.model]
        iters = _per_chunk(data_iterator, len(self.model))
        self.batches = [MicroBatches(it, 1, rank=rank, limit=num_microbatches) if it is not None else None
                        for it in iters]
        act = TensorMeta(shape=tuple(tensor_shape), dtype=config.pipeline_dtype or torch.float32)
        self.metas = tuple(act for _ in range(self.num_stages))
        self.loss_data: dict[int, object] = {}
        self.device = model_device(self.model)
        self.num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        last = lowered_plan(plan, rank).last_backward  # stage -> program index of its last weight-gradient action
        last_chunk = self.chunk_of[max(last, key=last.get)] if last else None
        from .embeddings import head_tie_chunks, local_copy_chunks

        # a split head tied to the embedding: the embedding's chunk too waits for the tie's sum (sum_head_tie)
        hold = set() if forward_only else (local_copy_chunks(self.model) | self._shard_chunks()
                                           | head_tie_chunks(self.model))
        self.sync = GradSync(config, self.model, last_chunk, forward_only, hold)
        owner = plan.num_stages - 1
        self.capture = None
        if self.head_split and owner in self.chunk_of:
            self.capture = split_head.head_capture(self.model[self.chunk_of[owner]])
        self.owner_loss: dict[int, split_head.OwnerLoss] = {}
        self._viewing: Forwarded | None = None
        self.stage0_calls: list | None = None  # stage 0's forward steps read ahead (`read_stage0_calls`)
        self.lookup = None  # stage 0's fed word_embeddings (split_embedding.fed_lookup), found by read_stage0_calls
        from . import pairs

        # --overlap-moe-expert-parallel-comm: every F and B (and each pair) through Megatron's combined step
        self.combined = None
        if pairs.overlapped(config, forward_only):
            problem = pairs.overlap_problem(plan, rank, memory) or pairs.device_problem()
            if problem is not None:
                raise OctoPipeError(problem)
            self.combined = pairs.CombinedSteps(self, _BatchAt)
        else:
            pairs.warn_unpaired(plan, config)

    def read_stage0_calls(self) -> list | None:
        """Under a split embedding, on stage 0's rank: the forward step of each of the step's micro-batches, read
        ahead (split_embedding.read_model_calls; their token ids go to the shards before the step); else None."""
        if not self.embedding_split or 0 not in self.chunk_of:
            return None
        from . import split_embedding

        c = self.chunk_of[0]
        with pipeline_view(self.plan, self.rank, running=0):  # get_batch's rank-level question: stage 0
            self.stage0_calls = split_embedding.read_model_calls(
                self.forward_step_func, lambda mb: _BatchAt(self.batches[c], mb), self.model[c],
                self.num_microbatches, self.device)
        self.lookup = split_embedding.fed_lookup(self.model[c])
        return self.stage0_calls

    def _shard_chunks(self) -> set[int]:
        """Chunks holding a shard weight (their gradients arrive at K/G, outside any stage's last B/W: their
        reduction starts after the step, with the same-rank tied copies')."""
        weights = [w for w in (getattr(self.shards, "head_weight", None), getattr(self.shards, "embedding_weight", None))
                   if w is not None]
        return {c for c, chunk in enumerate(self.model) if any(p is w for p in chunk.parameters() for w in weights)}

    def shard_weights(self) -> list[torch.nn.Parameter]:
        """This rank's shard weights (a head and/or embedding shard), each once."""
        out = []
        for name in ("head_weight", "embedding_weight"):
            w = getattr(self.shards, name, None)
            if w is not None and all(w is not o for o in out):
                out.append(w)
        return out

    # -- StageRunner -------------------------------------------------------------------------------

    def boundary_meta(self, stage: int) -> TensorMeta:
        """Every boundary carries Megatron's activation [seq/cp(/tp with SP), mbs, hidden]."""
        return self.metas[stage]

    def forward(self, stage: int, mb: int, inputs: torch.Tensor | None, *, batch=None,
                forward_only: bool = False) -> torch.Tensor:
        """Megatron's forward_step on the stage's chunk; the last stage returns the scaled loss.

        The chunk's own data iterator feeds it (`batch` from the executor is not used: Megatron
        hands one iterator per chunk to the schedule).
        """
        return super().forward(stage, mb, inputs, batch=batch, forward_only=forward_only or self.forward_only)

    # -- split layers: the shard actions run in `shards` (StageCore delegates them) ---------------------

    def pending(self) -> int:
        """(stage or shard, micro-batch) pairs whose state is still held (0 after a complete step)."""
        return super().pending() + len(self.owner_loss)

    def pair(self, first, first_input, second, second_input, *, batch=None, last_backward: bool = False):
        """An overlapped pair F+B: under --overlap-moe-expert-parallel-comm one combined step of Megatron's
        (pairs.py), else the halves one after the other; (F's output, B's input gradient)."""
        if self.combined is None or second.kind is not Kind.B:
            out = self.forward(first.stage, first.microbatch, first_input, batch=batch)
            back = self.backward if second.kind is Kind.B else self.backward_input
            return out, back(second.stage, second.microbatch, second_input, last_backward=last_backward)
        x = self._stage_input(first.stage, first.microbatch, first_input, True)
        fwd = self.state.take(second.stage, second.microbatch, Forwarded)
        with self._grad_action(second.stage, Kind.B, last_backward):
            (out, kept), dx = self.combined.pair(first.stage, first.microbatch, x, second.stage, fwd, second_input)
        self.state.put(first.stage, first.microbatch, kept)
        return out, dx

    def head_loss(self, mb: int, losses: torch.Tensor, coef: torch.Tensor) -> LossOutput:
        """The owner's J report: the shards' per-token losses through the forward step's loss_func and Megatron's
        own scaling (forward_step_calc_loss), so the loss dict Megatron logs and the token count are the unsplit
        run's."""
        kept = self.owner_loss.pop(mb)
        owner = self.num_stages - 1
        c = self.chunk_of[owner]
        store: list = []
        per_token = split_head.per_token_losses(losses, kept.labels_shape)
        out, num_tokens = split_head.calc_loss(self.model[c], per_token, kept.loss_func, self.config, c,
                                               self.num_microbatches, self.cp_size, store)
        self.num_tokens += num_tokens.to(self.num_tokens.device)
        self.loss_data[mb] = store[0] if store else None
        return LossOutput(loss=out.detach(), num_tokens=num_tokens, raw=self.loss_data[mb])

    # -- StageCore hooks ---------------------------------------------------------------------------

    def _stage_input(self, stage: int, mb: int, inputs, keep: bool):
        if stage == 0 and not self.embedding_split:
            return None
        # stage 0 under a split embedding: the summed partials (no graph), whose gradient goes to every G
        return inputs.detach().requires_grad_(keep and not self.forward_only)

    def _forward(self, stage: int, mb: int, x, batch, keep: bool):
        from megatron.core.pipeline_parallel import schedules

        if self.combined is not None and keep:
            return self.combined.forward(stage, mb, x)
        c = self.chunk_of[stage]
        first = self.sync.before_forward(c)
        store: list = []
        last = stage == self.num_stages - 1
        owner = last and self.head_split  # the split head's owner: its F hands on the head's input, no loss
        step_func, fed = self.forward_step_func, contextlib.nullcontext()
        if stage == 0 and self.embedding_split:  # the forward step read ahead: its model call, on the fed partials
            from . import split_embedding

            if self.stage0_calls is None:
                raise OctoPipeError("plan splits the embedding: stage 0's forward steps were not read ahead (call "
                                    "MegatronStages.read_stage0_calls before the step)")
            step_func, fed = split_embedding.replay(self.stage0_calls[mb]), split_embedding.feeding(self.lookup, x)
        step_func, loss_funcs = _keeping_loss_func(step_func) if owner else (step_func, None)
        with pipeline_view(self.plan, self.rank, running=stage), fed:  # get_batch's rank-level question: this chunk
            out, num_tokens = schedules.forward_step(
                step_func, _BatchAt(self.batches[c], mb), self.model[c], self.num_microbatches,
                None if stage == 0 else x, store, self.config, cp_group_size=self.cp_size,
                collect_non_loss_data=self.collect_non_loss_data, is_first_microbatch=first, current_microbatch=mb,
                vp_stage=c, is_last_stage=last and not owner)
        handed = out
        if owner:
            handed = self._head_input(c, mb, out, loss_funcs[0])
        elif last:
            self.num_tokens += num_tokens
            self.loss_data[mb] = store[0] if store else None
        fwd = None
        if keep:
            # the owner's output is not pseudo-freed: its own head shard keeps the same storage until its K
            if not last and self.config.deallocate_pipeline_outputs:
                sent = out.detach()  # the storage, alive while the executor sends (or hands) it on
                fwd = Forwarded(input=x, output=out, output_shape=out.shape)  # the shape I and W show autograd
                schedules.deallocate_output_tensor(out, True)
                return sent, fwd
            fwd = Forwarded(input=x, output=out)
        if owner:
            return handed, fwd
        if last and not torch.is_tensor(out):  # collect_non_loss_data: nothing flows on
            return torch.zeros([], device=self.device), fwd
        return out, fwd

    def _head_input(self, c: int, mb: int, hidden: torch.Tensor, loss_func) -> tuple:
        """The owner's hand-over (hidden, targets, coef): the labels its model kept, Megatron's loss rule's
        per-token coefficients (split_head); keeps the loss_func for the micro-batch's report at J."""
        labels = self.capture.take() if self.capture is not None else None
        if labels is None:  # a chunk without Megatron's output_processor (a stand-in): its output as it is
            return hidden, None, None
        shape = tuple(labels.shape)
        rule = split_head.loss_rule(self.model[c], loss_func, self.config, c, self.num_microbatches, self.cp_size,
                                    shape)
        self.owner_loss[mb] = split_head.OwnerLoss(loss_func=loss_func, labels_shape=shape)
        # targets in the hidden states' row order ([seq, mbs]: compute_language_model_loss transposes the labels)
        if self.config.sequence_parallel and self.tp[1] > 1:
            return split_head.sequence_block_input(hidden, labels.t(), rule, *self.tp)
        return self.head_input(hidden, labels.t(), rule)

    def _params(self, stage: int) -> list:
        return [p for p in self.model[self.chunk_of[stage]].parameters() if p.requires_grad]

    def _fused(self, stage: int, fwd: Forwarded, grad_output, want_dx: bool = True):
        """B (and W of the first stage): Megatron's backward_step (grad_scale_func on the loss, custom_backward
        for a pseudo-freed output, gradients into main_grad via DDP's hooks)."""
        from megatron.core.pipeline_parallel.schedules import backward_step

        if self.combined is not None:
            return self.combined.backward(stage, fwd, grad_output, want_dx)
        whole = self.head_split and stage == self.num_stages - 1  # the owner kept its output whole (see _forward)
        with _kept_whole(self.config) if whole else contextlib.nullcontext():
            dx = backward_step(fwd.input, fwd.output, grad_output, self.config)
        return dx if want_dx and (stage > 0 or self.embedding_split) else None

    def _split_input(self, stage: int, outs: list, gs: list, ins: list):
        """I: the linears run their input GEMM only; the captured gradients are kept for W."""
        c = self.chunk_of[stage]
        dins, work = input_pass(outs, gs, ins, self._params(stage), self.phases[c], self.te[c])
        # a pseudo-freed output (shown whole by _autograd_view during I) must look whole again at W, where the
        # graph is walked from it for parameters that join at no split linear (a bias added in the residual)
        fwd = self._viewing
        if fwd is not None and fwd.output_shape is not None:
            return dins, _WeightWork(work=work, freed=((fwd.output, tuple(fwd.output_shape)),))
        return dins, work

    def _split_weight(self, stage: int, work) -> None:
        """W: the weight gradients deferred by I, through AccumulateGrad (DDP's hooks fill main_grad)."""
        if not isinstance(work, _WeightWork):
            weight_pass(work)
            return
        with contextlib.ExitStack() as views:
            for out, shape in work.freed:
                views.enter_context(_full_shape(out, shape))
            weight_pass(work.work)

    @contextlib.contextmanager
    def _grad_action(self, stage: int, kind: Kind, last_backward: bool):
        """Around B and W: the chunk's no_sync lifted before (or grad_sync called after) its last one."""
        if not RULES[kind].weight_grad:
            yield
            return
        c = self.chunk_of[stage]
        self.sync.before_grad(c, last_backward)
        yield
        self.sync.after_grad(c, last_backward)

    @contextlib.contextmanager
    def _autograd_view(self, fwd: Forwarded):
        self._viewing = fwd  # I's _split_input records what W must show whole again
        try:
            with _full_shape(fwd.output, fwd.output_shape):
                yield
        finally:
            self._viewing = None


@contextlib.contextmanager
def _kept_whole(config):
    """backward_step for an output that was not pseudo-freed: autograd's own backward (custom_backward takes only
    a one-element output)."""
    saved, config.deallocate_pipeline_outputs = config.deallocate_pipeline_outputs, False
    try:
        yield
    finally:
        config.deallocate_pipeline_outputs = saved


def _keeping_loss_func(forward_step_func):
    """The forward step, and a list that receives each loss_func it returns (the split head's owner keeps it)."""
    kept: list = []

    def step(*args):
        out, loss_func = forward_step_func(*args)
        kept.clear()
        kept.append(loss_func)
        return out, loss_func

    return step, kept


def check_split_plan(plan, rank: int, shards, config, collect_non_loss_data: bool) -> bool:
    """Refuse (one line naming the plan field) split plans this runner cannot run; whether the LM head is split."""
    from octopipe_plugin.executor.interface import SHARD_METHODS

    from .mapping import head_split, split_problem

    if not plan.splits:
        return False
    if shards is None and any(a.kind in SHARD_METHODS for a in plan.schedule[rank]):
        raise OctoPipeError(f"plan splits (layers {[sp.layer for sp in plan.splits]}): pipeline rank {rank} runs shard "
                            f"actions and needs its shards (MegatronStages(shards=...), make_forward_backward_func("
                            f"shards=...)); none given")
    problem = split_problem(plan, mtp_layers=getattr(config, "mtp_num_layers", None) or 0,
                            tp_size=getattr(config, "tensor_model_parallel_size", 1) or 1)
    if problem is not None:
        raise OctoPipeError(problem)
    head = head_split(plan) is not None
    if head and collect_non_loss_data:
        raise OctoPipeError("plan splits: collect_non_loss_data needs the whole logits on one rank; evaluate with an "
                            "unsplit plan")
    return head


@dataclass(frozen=True, kw_only=True, slots=True)
class _WeightWork:
    """I's work for W, and the pseudo-freed outputs (with their shapes) W's graph walk starts from."""

    work: object
    freed: tuple


def model_device(model: Sequence[torch.nn.Module]) -> torch.device:
    """The device of the rank's model chunks (where every tensor the schedule makes belongs)."""
    for chunk in model:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _full_shape(out: torch.Tensor, shape):
    """Inside, a pseudo-freed output (`shape` given: one element, Megatron's deallocate_output_tensor) shows its
    original shape through a zero-stride view of that element, so autograd's shape checks pass; nothing is allocated
    and the graph never reads the output's values."""
    freed = shape is not None
    if freed:
        stub = out.data
        out.data = stub.reshape(()).expand(shape)
    try:
        yield
    finally:
        if freed:
            out.data = stub


# chunk -> its Phase: our own state beside the chunk (no attribute set on Megatron's module); weak, so a
# chunk that goes away takes its entry with it
_PHASES: "weakref.WeakKeyDictionary[torch.nn.Module, Phase]" = weakref.WeakKeyDictionary()


def split_phases(model: Sequence[torch.nn.Module]) -> list[Phase]:
    """Each chunk's Phase, making its Megatron linears split-capable the first time (idempotent)."""
    phases = []
    for chunk in model:
        phase = _PHASES.get(chunk)
        if phase is None:
            phase = _PHASES[chunk] = Phase()
            enable_wgrad_split(chunk, phase)
        phases.append(phase)
    return phases
