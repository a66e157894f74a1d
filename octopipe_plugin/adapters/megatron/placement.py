"""Plan -> Megatron model chunks for any stage->rank map (looped, V-shape, irregular).

Megatron builds chunk `vp_stage` of pipeline rank r from a round-robin table (stage
i = r + vp_stage * P) and derives layer offsets, `pre_process` / `post_process`, MTP
placement and the tied-embedding group from that assumption. Here the plan decides:
chunk v of rank r is the v-th stage (in model order) that the plan places on r, its
decoder layers keep their global numbers (so checkpoint keys match any other split),
`pre_process` holds where the plan puts the embedding and `post_process` where it puts
the LM head and loss.

Public entry points (used by the launch integration; `chunk_specs` / `ChunkSpec` are mapping.py's):
- `mapped_layout(plan, model)` -> a `MappedLayout` for `TransformerConfig.pipeline_model_parallel_layout`;
- `plan_model_provider(plan, model, provider)` -> a Megatron `model_provider` that builds the plan's chunks;
- `attach_head_shard(plan, chunks, rank, config, vocab_size)`: under a split LM head, the rank's
  `HeadShard` (vocab_shards.py) as `output_layer` of its chunk, before DDP wrapping (called by
  `plan_model_provider` once the rank's last chunk is built; a tied head's rows come from the
  embedding's rank and stay tied to it, embeddings.py); `attach_embedding_shard`: the same for a split
  embedding (split_embedding.py), stage 0's word_embeddings made its fed lookup;
- `plan_pipeline_view(plan, rank)` -> context in which `parallel_state.is_pipeline_first/last_stage`
  answer for the plan (get_batch's labels, MTP, get_model's pre/post flags), and a HybridModel built
  inside takes the plan's segment of its '|' pattern (hooks.pipeline_view); HybridModels take no
  `MappedLayout` (`plan_model_provider(..., hybrid=True)`).
"""

from __future__ import annotations

from ...errors import OctoPipeError
from .embeddings import tie_local_copies
from .hooks import pipeline_view, replace_forward
from .mapping import (chunk_specs, embedding_split, head_split, split_problem, stage_symbols,
                      tied_embedding_split_problem)


def _layout_base():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout


def mapped_layout(plan, model):
    """Megatron's layout object for `plan`: its parser and validator, the plan's stage->rank map."""
    return make_mapped_layout_class()(stage_symbols(plan, model), [st.device for st in plan.stages])


def make_mapped_layout_class():
    """The MappedLayout class (built lazily: megatron is imported only when an adapter function runs)."""
    base = _layout_base()

    class MappedLayout(base):
        """PipelineParallelLayerLayout whose table and offsets follow an arbitrary stage->rank map.

        Megatron's own constructor parses and type-checks the stages (as a one-rank layout, which
        keeps them in model order in `flatten_layout`); the per-rank table `layout[rank][vp]` and
        `get_layer_offset` are then rebuilt from `stage_devices`, so TransformerBlock, the
        TransformerLayer offset and the MTP block all see the plan's placement.
        """

        def __init__(self, stages, stage_devices):
            # Megatron's own string parser turns the symbols into LayerTypes
            super().__init__(base.parse_str_to_list("|".join("".join(s) for s in stages)), 1)
            self.input_data = "|".join("".join(s) for s in stages)
            pp = max(stage_devices) + 1
            per_rank = [[s for s, d in enumerate(stage_devices) if d == r] for r in range(pp)]
            counts = {len(x) for x in per_rank}
            if len(counts) != 1:
                raise OctoPipeError(f"plan gives pipeline ranks {sorted(counts)} stages; Megatron builds the same "
                                    "number of model chunks (virtual stages) on every rank")
            flat = [self.layout[0][i] for i in range(len(stage_devices))]  # one-rank table = stage order
            self.stage_devices = tuple(stage_devices)
            self.stage_of = {(r, v): s for r, ss in enumerate(per_rank) for v, s in enumerate(ss)}
            self.pipeline_model_parallel_size = pp
            self.virtual_pipeline_model_parallel_size = len(per_rank[0])
            self.layout = [[flat[s] for s in per_rank[r]] for r in range(pp)]
            self.flatten_layout = [t for row in flat for t in row]
            self._flat_stages = flat

        def __repr__(self) -> str:
            return f"MappedLayout({self.input_data!r}, devices={list(self.stage_devices)})"

        def __hash__(self):
            return hash((repr(self.input_data), self.stage_devices))

        def _pp_rank(self, pp_rank):
            if pp_rank is not None:
                return pp_rank
            from megatron.core import parallel_state

            return parallel_state.get_pipeline_model_parallel_rank()

        def get_layer_offset(self, layer_type=None, vp_stage=None, pp_rank=None):
            """Layers of `layer_type` in every stage before this chunk's stage, in model order."""
            from megatron.core.transformer.enums import LayerType

            layer_type = LayerType.decoder if layer_type is None else layer_type
            stage = self.stage_of[(self._pp_rank(pp_rank), vp_stage or 0)]
            return sum(s.count(layer_type) for s in self._flat_stages[:stage])

    return MappedLayout


def plan_model_provider(plan, model, provider, *, hybrid: bool = False, vocab_size: int | None = None):
    """Wrap a `model_provider(pre_process, post_process, vp_stage=..., config=..., ...)` to build the plan's chunks.

    Megatron's get_model derives pre/post_process round-robin and hands every chunk the same
    config: the wrapper gives each chunk the plan's flags, puts the plan's `MappedLayout` into
    that config (layer counts and global layer numbers per chunk) and, once the rank's chunks
    hold several copies of the tied embedding, copies the embedding into them (Megatron leaves
    a same-rank copy zero-filled). `hybrid`: the provider builds HybridModels, which take no
    layout: each takes the plan's segment of the '|' pattern and its global layer offset inside
    the pipeline view the provider runs in (hooks.pipeline_view). Under a split LM head the rank's
    head shard is attached once its last chunk is built (`attach_head_shard`; `vocab_size`: the
    padded vocabulary, default Megatron's `args.padded_vocab_size`).
    """
    layout = None
    built: list = []
    made: list = []  # the config made here when get_model hands none (its model_provider route passes config=None)

    def wrapped(pre_process=True, post_process=True, vp_stage=None, **kwargs):
        from megatron.core import parallel_state

        nonlocal layout
        rank = parallel_state.get_pipeline_model_parallel_rank()
        spec = chunk_specs(plan, model, rank)[vp_stage or 0]
        if kwargs.get("config") is None:
            # a provider would build its config from the arguments, whose layout string is round-robin:
            # chunks would get another stage's layer numbers (a V-shape's layers run in a swapped order)
            if not made:
                from megatron.training import get_args
                from megatron.training.arguments import core_transformer_config_from_args

                made.append(core_transformer_config_from_args(get_args()))
            kwargs["config"] = made[0]
        config = kwargs["config"]
        if not hybrid and (layout is None or
                           getattr(config.pipeline_model_parallel_layout, "stage_devices", None) is None):
            layout = layout or mapped_layout(plan, model)
            apply_layout(config, layout)
        with plan_pipeline_view(plan, rank):
            chunk = provider(pre_process=spec.pre_process, post_process=spec.post_process, vp_stage=vp_stage,
                             **kwargs)
        built.append(chunk)
        tie_local_copies(built)
        if len(built) == len(plan.stages_of(rank)) and plan.splits:
            attach_head_shard(plan, built, rank, config, vocab_size)
            attach_embedding_shard(plan, built, rank, config, vocab_size)  # after the head's: same order everywhere
        return chunk

    return wrapped


def padded_vocab_size() -> int:
    """The run's padded vocabulary (Megatron's args.padded_vocab_size: --make-vocab-size-divisible-by x TP)."""
    from megatron.training import get_args

    return get_args().padded_vocab_size


def attach_head_shard(plan, chunks, rank: int, config, vocab_size: int | None = None):
    """This rank's HeadShard of a split LM head as `output_layer` of its chunk (None off the shard set).

    Collective over the head's owner and its shard ranks (vocab_shards.build_head_shard hands each its
    rows of the head the owner built as the unsplit run builds it). The owner's shard replaces
    Megatron's output layer; another shard rank's sits on its last chunk (no forward of that chunk uses
    it). Called before Float16Module / DDP wrapping, so the optimizer, DDP's buffers, the gradient
    reduction and checkpoints (under Megatron's own key, `output_layer.weight`) include it. A head tied
    to the word embedding takes its rows from the embedding's rank instead (`_attach_tied_head_shard`).
    """
    from .vocab_shards import build_head_shard

    sp = head_split(plan)
    if sp is None:
        return None
    problem = split_problem(plan, mtp_layers=getattr(config, "mtp_num_layers", None) or 0)
    if problem is not None:  # before the collective: a refused plan sends nothing
        raise OctoPipeError(problem)
    owner = plan.stages[-1].device
    vocab = padded_vocab_size() if vocab_size is None else vocab_size
    if any(getattr(c, "share_embeddings_and_output_weights", False) for c in chunks):  # every rank's chunks know
        return _attach_tied_head_shard(plan, sp, chunks, rank, config, vocab)
    if rank != owner and rank not in sp.devices:
        return None
    owner_chunk = chunks[plan.stages_of(rank).index(plan.num_stages - 1)] if rank == owner else None
    shard = build_head_shard(config, split=sp, device=rank, owner=owner, vocab_size=vocab,
                             hidden_size=config.hidden_size,
                             owner_weight=owner_chunk.output_layer.weight if owner_chunk is not None else None)
    (owner_chunk if owner_chunk is not None else chunks[-1]).output_layer = shard
    return shard


def _attach_tied_head_shard(plan, sp, chunks, rank: int, config, vocab: int):
    """attach_head_shard for a head tied to the word embedding: the rows come from the embedding's rank.

    Collective over the embedding's rank and the shard ranks. The owner's chunk drops its output layer (Megatron
    zero-filled that copy and, its rank being outside the embedding group, never filled it: mapping.copy_ranks);
    the chunk hosting a shard stops answering as a tied model (`share_embeddings_and_output_weights = False`), so
    Megatron's own tying leaves the shard alone: its state dict does not replace the shard's entry with the whole
    embedding and its finalize step does not all-reduce a copy that is none. The tie's gradients are summed by
    embeddings.sum_head_tie after each step."""
    from .embeddings import HeadTie, register_head_tie, uneven_embedding_entry
    from .vocab_shards import build_tied_head_shard

    owner, first = plan.stages[-1].device, plan.stages[0].device
    if rank not in (owner, first, *sp.devices):
        return None
    mine = plan.stages_of(rank)
    emb_chunk = chunks[mine.index(0)] if rank == first else None
    emb_weight = emb_chunk.embedding.word_embeddings.weight if emb_chunk is not None else None
    shard, tie = build_tied_head_shard(config, split=sp, device=rank, embedding_device=first, vocab_size=vocab,
                                       hidden_size=config.hidden_size, embedding_weight=emb_weight)
    host = chunks[mine.index(plan.num_stages - 1)] if rank == owner else (chunks[-1] if shard is not None else None)
    if host is not None:
        host.output_layer = shard
        host.share_embeddings_and_output_weights = False
    if emb_chunk is not None:
        uneven_embedding_entry(emb_chunk)
    register_head_tie(chunks, HeadTie(tie=tie, full=emb_weight, shard=shard.weight if shard is not None else None))
    return shard


def attach_embedding_shard(plan, chunks, rank: int, config, vocab_size: int | None = None):
    """Under a split embedding: this rank's EmbeddingShard (split_embedding.py; None off the shard set), and stage
    0's word_embeddings made its fed lookup.

    Collective over stage 0's rank and the shard ranks (each gets its rows of the word embedding stage 0's
    chunk built as the unsplit run builds it). On stage 0's rank the shard (or a FedLookup, without rows)
    replaces `embedding.word_embeddings`; another shard rank's sits in an `embedding` of its first chunk
    (EmbeddingRows: Megatron's parameter name, no forward uses it). Called before Float16Module / DDP
    wrapping, so the optimizer, DDP's buffers and checkpoints (`embedding.word_embeddings.weight`) include it.
    """
    from megatron.core import parallel_state

    from .split_embedding import EmbeddingRows, FedLookup, build_embedding_shard

    sp = embedding_split(plan)
    if sp is None:
        return None
    problem = split_problem(plan, mtp_layers=getattr(config, "mtp_num_layers", None) or 0,
                            tp_size=parallel_state.get_tensor_model_parallel_world_size())
    if problem is None and any(getattr(c, "share_embeddings_and_output_weights", False) for c in chunks):
        problem = tied_embedding_split_problem(plan)
    if problem is not None:  # before the collective: a refused plan sends nothing
        raise OctoPipeError(problem)
    owner = plan.stages[0].device
    if rank != owner and rank not in sp.devices:
        return None
    vocab = padded_vocab_size() if vocab_size is None else vocab_size
    owner_chunk = chunks[plan.stages_of(rank).index(0)] if rank == owner else None
    shard = build_embedding_shard(config, split=sp, device=rank, owner=owner, vocab_size=vocab,
                                  hidden_size=config.hidden_size,
                                  owner_weight=owner_chunk.embedding.word_embeddings.weight if owner_chunk is not None
                                  else None)
    if owner_chunk is not None:
        owner_chunk.embedding.word_embeddings = shard if shard is not None else FedLookup(vocab)
    else:
        chunks[0].embedding = EmbeddingRows(shard)
    return shard


def apply_layout(config, layout) -> None:
    """Put `layout` into a TransformerConfig as its __post_init__ would (virtual size, Megatron's validation)."""
    config.pipeline_model_parallel_layout = layout
    vp = layout.virtual_pipeline_model_parallel_size
    config.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    config.mtp_standalone = layout.validate_layer_layout(num_layers=config.num_layers,
                                                         mtp_num_layers=config.mtp_num_layers)


def plan_float16_wrappers(model, plan, rank: int) -> int:
    """Make each Float16Module (fp16/bf16 runs) cast where the plan puts the pipeline's ends; returns how many.

    Megatron's wrapper casts the inputs of the first stage to half precision and the loss of
    the last stage back to fp32, asking the round-robin rule which chunk that is: under a
    V-shape it would upcast a middle stage's activation (the boundary's dtype breaks) and
    leave the real loss in half precision. The replacement forward does the same casts on the
    plan's first and last stage (GPU path: fp16/bf16 is not run on this CPU-only machine).
    """
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    stages = plan.stages_of(rank)
    count = 0
    # under a split LM head the last stage hands on the head's input, not the loss: it stays in half precision, as
    # Megatron's output layer receives it (the shards' statistics and the loss are computed in fp32)
    split = head_split(plan) is not None
    for chunk, stage in zip(model, stages):
        wrapper = next((m for m in chunk.modules() if isinstance(m, Float16Module)), None)
        if wrapper is None:
            continue
        first, last = stage == 0, stage == plan.num_stages - 1 and not split

        def make(_megatron, _w=wrapper, _first=first, _last=last):
            def forward(*inputs, fp32_output=True, **kwargs):
                if _first:
                    inputs = fp32_to_float16(inputs, _w.float16_convertor)
                outputs = _w.module(*inputs, **kwargs)
                if _last and fp32_output is True:
                    outputs = float16_to_fp32(outputs)
                return outputs

            return forward

        count += replace_forward(wrapper, make, "casts on the plan's first and last stage")
    return count


def plan_pipeline_view(plan, rank: int):
    """Context in which `parallel_state.is_pipeline_first/last_stage` answer for the plan (hooks.pipeline_view)."""
    return pipeline_view(plan, rank)
