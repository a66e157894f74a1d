"""Megatron's LM-head weight divided over a split plan's shard ranks: `HeadShard` and its initial rows.

Under a plan that splits the LM head (formats/splits.py), each shard rank of the head holds rows
[lo, hi) of Megatron's `output_layer.weight` (global padded vocabulary x hidden). The vocabulary is
cut first as Megatron cuts it over tensor parallelism (VocabUtility: V/tp rows per TP rank), then
each TP slice by the plan's shares (`row_range`), so TP rank t of shard device d holds global rows
t*V/tp + row_range(split, V/tp, d) (`head_rows`).

Initial values. Megatron draws output_layer.weight inside ColumnParallelLinear: with
`use_cpu_initialization` from the default torch generator (the whole [V, h] master weight, then
the TP slice: tensor_parallel/layers.py `_initialize_affine_weight_cpu`), on GPU through the
model-parallel CUDA RNG tracker (`_initialize_affine_weight_gpu`); both streams are seeded per
pipeline rank (megatron.training `_set_random_seed`: seed + 100 x pp rank) and advanced by every
module built before it on that rank. So the values depend on the owner rank's whole construction
and cannot be redrawn elsewhere; the owner builds its chunk as the unsplit run does (the head
included, nothing else's draws move) and `build_head_shard` hands each shard rank its rows of that
weight, point to point inside the pipeline group. Shard ranks allocate without drawing, so their
own modules keep the values of the unsplit run too.

Checkpoints. `HeadShard.sharded_state_dict` saves the rows as their slice of the ONE global tensor
under Megatron's own key (`output_layer.weight`; rows of the word embedding under
`embedding.word_embeddings.weight` by `key=`, `extra_state=False`, and `copy=True` for a tied copy),
with irregular global offsets (axis_fragmentations=None: the uneven sharding dist-ckpt supports
and leaves to torch DCP to check, strategies/torch.py). Megatron's distributed optimizer builds
its model-space state from the same ShardedTensor, so Adam's moments travel the same way, and a
checkpoint written under one split loads under Megatron's own layout or another split, and back.

Tensor parallelism. The TP ranks of one shard device hold its rows of each TP slice (`head_rows`),
so the shard's statistics are reduced over Megatron's TP group before they travel and its partial
input gradient is all-reduced there, as ColumnParallelLinear's backward all-reduces its input
gradient (`shard_tensor_parallel`, the executor's `TensorParallel`). Under `--sequence-parallel`
the owner's hidden states are its block of the sequence ([s/tp, b, h], what the output layer
all-gathers): the shards gather every block, and hand each TP rank its block of the partial
(the reduce-scatter of ColumnParallelLinear's sequence-parallel backward).
"""

from __future__ import annotations

import torch

from octopipe_plugin.formats.splits import SplitLayer, row_range

__all__ = ["HeadShard", "build_head_shard", "build_tied_head_shard", "head_rows", "shard_tensor_parallel",
           "EMBEDDING_KEY"]

EMBEDDING_KEY = "embedding.word_embeddings.weight"  # Megatron's checkpoint key of the word embedding


def head_rows(split: SplitLayer, vocab_size: int, device: int, tp_rank: int = 0,
               tp_size: int = 1) -> tuple[int, int] | None:
    """Global rows [lo, hi) of the padded vocabulary that pipeline rank `device` holds at TP rank `tp_rank`
    (None when the device holds no shard)."""
    if vocab_size % tp_size:
        raise ValueError(f"padded vocabulary {vocab_size} is not divisible by tensor-parallel size {tp_size} "
                         "(Megatron pads it to a multiple of --make-vocab-size-divisible-by x TP)")
    per_tp = vocab_size // tp_size
    rows = row_range(split, per_tp, device)
    if rows is None:
        return None
    return tp_rank * per_tp + rows[0], tp_rank * per_tp + rows[1]


class HeadShard(torch.nn.Module):
    """Rows [lo, hi) of the global [vocab_size, hidden] LM-head weight, as one shard rank of a split plan holds them.

    Attach it where Megatron's head lives (`chunk.output_layer = shard`: parameter name, optimizer groups
    and checkpoint key stay Megatron's), before DDP wrapping so its weight joins the gradient buffers.
    `forward(hidden)` gives this shard's logits [..., hi - lo] (ColumnParallelLinear's (output, bias) pair).
    """

    def __init__(self, config, *, vocab_size: int, hidden_size: int, rows: tuple[int, int],
                 tp_rank: int = 0, tp_size: int = 1, key: str | None = None, copy: bool = False,
                 extra_state: bool = True, extra_with_prefix: bool = False, weight: torch.Tensor | None = None):
        super().__init__()
        lo, hi = rows
        per_tp = vocab_size // tp_size if tp_size > 0 else 0
        if not (tp_rank * per_tp <= lo < hi <= (tp_rank + 1) * per_tp):
            raise ValueError(f"HeadShard rows {rows}: expected non-empty rows inside TP rank {tp_rank}'s slice "
                             f"[{tp_rank * per_tp}, {(tp_rank + 1) * per_tp}) of the padded vocabulary {vocab_size} "
                             "(fix: a share too small for the vocabulary gives an empty shard; raise it)")
        self.config = config
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows = (lo, hi)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.key = key  # checkpoint key; None: the prefix Megatron's sharded_state_dict passes + "weight"
        self.copy = copy  # a non-main replica in checkpoints (e.g. a tied head's copy of embedding rows)
        # ColumnParallelLinear saves an `_extra_state` object beside its weight, VocabParallelEmbedding none:
        # False for rows of the word embedding, so either layout finds exactly the entries it asks for
        self.extra_state = extra_state
        # a tied head's shards: the weight is the embedding's (`key`, a copy), but Megatron's tied layout keeps the
        # head's `output_layer._extra_state` as its own main replica: the entry goes under the module's prefix
        self.extra_with_prefix = extra_with_prefix
        if weight is None:
            # ColumnParallelLinear's placement rule; torch.empty draws nothing (the rank's RNG stream stays put)
            where = (torch.device("cpu") if getattr(config, "use_cpu_initialization", True)
                     else torch.device("cuda", torch.cuda.current_device()))
            weight = torch.empty(hi - lo, hidden_size, dtype=config.params_dtype, device=where)
        if tuple(weight.shape) != (hi - lo, hidden_size):
            raise ValueError(f"HeadShard rows {rows}: expected a weight of shape {(hi - lo, hidden_size)}, "
                             f"got {tuple(weight.shape)}")
        self.weight = torch.nn.Parameter(weight)
        # what Megatron's DDP, optimizer and grad-norm read off ColumnParallelLinear's weight: a tensor-parallel
        # (unique per TP rank, counted once in the norm) partition along rows, reduced over plain data parallelism
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1
        self.weight.allreduce = True
        # what LanguageModule.setup_embeddings_and_output_layer marks on the output layer's (and the word
        # embedding's) weight: --decoupled-lr, Muon's and MuP's optimizer groups read it, so a shard's rows train
        # in the unsplit run's parameter group
        self.weight.is_embedding_or_output_parameter = True
        if getattr(config, "use_mup", False):
            self.weight.is_embedding_parameter = True
        # ColumnParallelLinear's hook: state dicts without `_extra_state` still load
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        """This shard's logits of `input_` [..., hidden] -> [..., hi - lo], and no bias."""
        return torch.nn.functional.linear(input_, self.weight if weight is None else weight), None

    def get_extra_state(self):
        """None, as ColumnParallelLinear's (kept so checkpoints carry the same `_extra_state` entry)."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored, as ColumnParallelLinear ignores it."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        """The weight as its rows of the one global [vocab_size, hidden] tensor (irregular offsets), and the
        `_extra_state` object ColumnParallelLinear saves (main replica on the shard holding the slice's first row)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint

        if sharded_offsets:
            # the head sits at model level: LanguageModule.sharded_state_dict asserts no offsets either
            raise ValueError(f"HeadShard at {prefix!r}: unexpected sharded_offsets {sharded_offsets}")
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_rank = metadata["dp_cp_group"].rank()
        lo, _ = self.rows
        key = self.key or f"{prefix}weight"
        # replica_id as make_tp_sharded_tensor_for_checkpoint: (copy, 0 - TP ranks hold distinct rows, DP replica)
        weight = ShardedTensor(key, self.weight, self.weight.dtype, tuple(self.weight.shape),
                               (self.vocab_size, self.hidden_size), (lo, 0), axis_fragmentations=None,
                               replica_id=(int(self.copy), 0, dp_rank),
                               allow_shape_mismatch=True)  # LanguageModule's rule for the head: padded vocabulary
        if not self.extra_state:
            return {f"{prefix}weight": weight}
        first = lo == self.tp_rank * (self.vocab_size // self.tp_size)
        if self.extra_with_prefix:
            extra_key, copy = f"{prefix}_extra_state", not first
        else:
            extra_key = key[:-len("weight")] + "_extra_state" if key.endswith("weight") else key + "._extra_state"
            copy = self.copy or not first
        extra = make_sharded_object_for_checkpoint(None, extra_key, (), replica_id=(int(copy), self.tp_rank, dp_rank))
        return {f"{prefix}weight": weight, f"{prefix}_extra_state": extra}

    def extra_repr(self) -> str:
        lo, hi = self.rows
        return f"rows=[{lo}, {hi}) of {self.vocab_size}, hidden={self.hidden_size}, TP={self.tp_size}"


def shard_tensor_parallel(shard: "HeadShard", config, tp_group=None):
    """The executor's TensorParallel reductions of `shard` over Megatron's TP group (sequence parallel as
    `config.sequence_parallel`), or None at TP 1."""
    if shard.tp_size == 1:
        return None
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from octopipe_plugin.executor.vocab_shard import TensorParallel

    group = ps.get_tensor_model_parallel_group() if tp_group is None else tp_group
    if dist.get_world_size(group) != shard.tp_size or dist.get_rank(group) != shard.tp_rank:
        raise ValueError(f"HeadShard of TP rank {shard.tp_rank} of {shard.tp_size}: the tensor-parallel group has "
                         f"rank {dist.get_rank(group)} of {dist.get_world_size(group)} (build the shard under the "
                         f"run's parallel state)")
    return TensorParallel.over(group, sequence_parallel=bool(getattr(config, "sequence_parallel", False)))


def build_head_shard(config, *, split: SplitLayer, device: int, owner: int, vocab_size: int, hidden_size: int,
                     owner_weight: torch.Tensor | None, pp_group=None, tp_rank: int | None = None,
                     tp_size: int | None = None, key: str | None = None, copy: bool = False,
                     extra_state: bool = True) -> HeadShard | None:
    """This pipeline rank's HeadShard (None off the shard set), its rows copied from the owner's Megatron-built head.

    Collective over the owner and the split's devices of one pipeline group (the others return at once):
    `owner_weight` is, on the owner (pipeline rank `owner`), the output_layer.weight its chunk built as the
    unsplit run builds it (this TP rank's slice), and None elsewhere. Call it before Float16Module / DDP
    wrapping; the owner then drops its own `output_layer`. `key`, `copy`, `extra_state`: HeadShard's.
    """
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group() if pp_group is None else pp_group
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = ps.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    ranks = dist.get_process_group_ranks(pp_group)
    per_tp = vocab_size // tp_size
    if device == owner:
        want = (per_tp, hidden_size)
        if owner_weight is None or tuple(owner_weight.shape) != want or owner_weight.dtype != config.params_dtype:
            got = None if owner_weight is None else (tuple(owner_weight.shape), owner_weight.dtype)
            raise ValueError(f"build_head_shard on the owner (pipeline rank {owner}): expected its output_layer.weight "
                             f"of shape {want} and dtype {config.params_dtype} (built, not yet wrapped), got {got}")
        mine = None
        with torch.no_grad():
            for d in split.devices:
                lo, hi = row_range(split, per_tp, d)
                if d == owner:
                    mine = owner_weight[lo:hi].detach().clone()
                else:
                    dist.send(owner_weight[lo:hi].detach().contiguous(), dst=ranks[d], group=pp_group)
        if mine is None:
            return None
    elif device in split.devices:
        mine = None
    else:
        return None
    rows = head_rows(split, vocab_size, device, tp_rank, tp_size)
    shard = HeadShard(config, vocab_size=vocab_size, hidden_size=hidden_size, rows=rows, tp_rank=tp_rank,
                      tp_size=tp_size, key=key, copy=copy, extra_state=extra_state, weight=mine)
    if mine is None:
        with torch.no_grad():
            dist.recv(shard.weight.data, src=ranks[owner], group=pp_group)
    return shard


def build_tied_head_shard(config, *, split: SplitLayer, device: int, embedding_device: int, vocab_size: int,
                          hidden_size: int, embedding_weight: torch.Tensor | None, pp_group=None,
                          tp_rank: int | None = None, tp_size: int | None = None):
    """(this pipeline rank's HeadShard or None, the tie) of a split LM head tied to the word embedding.

    The unsplit tied model uses the embedding's weight as its head, so each shard's rows are copied from
    the weight of the embedding's rank (`embedding_weight` there, this TP rank's slice; None elsewhere),
    by `executor.tied_rows.copy_rows`: collective over the embedding's rank and the split's devices (the
    others return at once). The shard saves as a copy of its rows of the embedding (`EMBEDDING_KEY`,
    replica), beside `output_layer._extra_state` as Megatron's tied layout keeps it, and is `shared` as the
    tied head's copy is in Megatron (counted once in the gradient norm: the embedding's rows are).
    The tie (`TiedRows`, global ranks, rows in this TP rank's slice) sums the gradients after each step."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from octopipe_plugin.executor.tied_rows import TiedRows, copy_rows

    pp_group = ps.get_pipeline_model_parallel_group() if pp_group is None else pp_group
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = ps.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    ranks = dist.get_process_group_ranks(pp_group)
    per_tp = vocab_size // tp_size
    tie = TiedRows(full_rank=ranks[embedding_device],
                   rows={ranks[d]: row_range(split, per_tp, d) for d in split.devices}, group=pp_group)
    if device == embedding_device:
        want = (per_tp, hidden_size)
        if (embedding_weight is None or tuple(embedding_weight.shape) != want
                or embedding_weight.dtype != config.params_dtype):
            got = None if embedding_weight is None else (tuple(embedding_weight.shape), embedding_weight.dtype)
            raise ValueError(f"build_tied_head_shard on the embedding's rank (pipeline rank {device}): expected its "
                             f"word_embeddings.weight of shape {want} and dtype {config.params_dtype}, got {got}")
    shard = None
    if device in split.devices:
        shard = HeadShard(config, vocab_size=vocab_size, hidden_size=hidden_size,
                          rows=head_rows(split, vocab_size, device, tp_rank, tp_size), tp_rank=tp_rank,
                          tp_size=tp_size, key=EMBEDDING_KEY, copy=True, extra_with_prefix=True)
        shard.weight.shared = True  # Megatron's mark of a tied copy (param_is_not_shared: not in the grad norm)
    if device == embedding_device or shard is not None:
        copy_rows(tie, embedding_weight.detach() if embedding_weight is not None else None,
                  shard.weight.data if shard is not None else None)
    return shard, tie
