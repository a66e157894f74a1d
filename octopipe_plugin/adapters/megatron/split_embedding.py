"""A split input embedding in a Megatron run (docs/formats.md, "Split layers"): the shards, stage 0's fed lookup,
and the token ids the shards look up.

Under a plan that splits the embedding (layer 0), each shard rank holds rows [lo, hi) of Megatron's
`embedding.word_embeddings.weight` (an `EmbeddingShard`: a vocab_shards.HeadShard under that key, no
`_extra_state`, initialised from the rows stage 0's rank built as the unsplit run builds them). The
shards' E look up the micro-batch's tokens in their rows; the executor sums the partials into stage 0's
input; stage 0's `embedding.word_embeddings` (its rows, or a `FedLookup` when stage 0's rank holds none)
returns that sum where Megatron's lookup would, so LanguageModelEmbedding adds the position embeddings,
transposes, casts and applies dropout as it does after its own lookup; G adds stage 0's input gradient
into the rows.

Token ids. In Megatron they exist only inside the user's `forward_step` (get_batch on the ranks that read
data, then `model(tokens, position_ids, ...)`), at stage 0's F, and the shards' E run before it. So at step
start stage 0's rank runs the forward step once per micro-batch with a `_Recorder` standing in for its
chunk: the model call's arguments and the `loss_func` are kept (`ModelCall`), a sentinel is returned; the
token ids (the call's `input_ids`) travel to every other shard rank in one int64 message per step
([m, seq, mbs], before the executor's step: executor/token_exchange.py, where a refusal of stage 0's rank ends
every rank); each real F of stage 0 runs Megatron's `schedules.forward_step` on `replay(call)`, which calls the
chunk with the kept arguments. The forward
step therefore runs once per micro-batch, as under Megatron's schedule; one that changes the model's
output after the call (the replay would not) is refused by name.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import OctoPipeError
from .vocab_shards import HeadShard, build_head_shard

KEY = "embedding.word_embeddings.weight"  # Megatron's checkpoint key of the word embedding


def _fed(module, input_ids: torch.Tensor) -> torch.Tensor:
    """What stage 0's word_embeddings gives for `input_ids` [mbs, seq]: the summed shard partials [mbs, seq, h]
    (kept sequence-major, [seq, mbs, h], by the executor; LanguageModelEmbedding transposes back)."""
    x = module.fed
    if x is None:
        raise OctoPipeError("a split embedding's lookup ran outside stage 0's F (no shard partials fed): under a "
                            "plan that splits the embedding, run the chunk through the OctoPipe schedule")
    if tuple(input_ids.shape) != (x.shape[1], x.shape[0]):
        raise OctoPipeError(f"split embedding: the model call's input_ids have shape {tuple(input_ids.shape)}, the "
                            f"shards' partials {tuple(x.shape)} ([seq, mbs, hidden]): expected [mbs, seq] = "
                            f"{(x.shape[1], x.shape[0])}")
    return x.transpose(0, 1)


class EmbeddingShard(HeadShard):
    """Rows [lo, hi) of the global word embedding (checkpoint key `embedding.word_embeddings.weight`, no
    `_extra_state`, as VocabParallelEmbedding); on stage 0's rank also its lookup (`forward` gives the fed
    partials)."""

    def __init__(self, config, **kwargs):
        super().__init__(config, key=KEY, extra_state=False, **kwargs)
        self.fed: torch.Tensor | None = None  # (HeadShard marks the weight as Megatron marks the word embedding's)

    def forward(self, input_ids: torch.Tensor, *unused, **unused_kw):
        """The fed partials (stage 0's rank); no other rank calls its shard."""
        return _fed(self, input_ids)


class FedLookup(torch.nn.Module):
    """Stage 0's word_embeddings when stage 0's rank holds no rows of the split embedding: the fed partials."""

    weight = None  # LanguageModule.shared_embedding_or_output_weight reads it (embeddings.py skips None)

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size  # the padded vocabulary the shards split (the shards factory reads it)
        self.fed: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, *unused, **unused_kw):
        """The fed partials."""
        return _fed(self, input_ids)


class EmbeddingRows(torch.nn.Module):
    """`embedding` of a shard rank's chunk that is not stage 0's: holds its EmbeddingShard as `word_embeddings`,
    so the parameter keeps Megatron's name; the chunk's forward never uses it (no pre_process)."""

    def __init__(self, shard: EmbeddingShard):
        super().__init__()
        self.word_embeddings = shard

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        """The shard's rows only (a plain module's default would save the rows as a whole replicated tensor)."""
        return self.word_embeddings.sharded_state_dict(f"{prefix}word_embeddings.", sharded_offsets, metadata)


def build_embedding_shard(config, *, split, device: int, owner: int, vocab_size: int, hidden_size: int,
                          owner_weight: torch.Tensor | None, pp_group=None) -> EmbeddingShard | None:
    """This pipeline rank's EmbeddingShard (None off the shard set), its rows copied from stage 0's Megatron-built
    word embedding (collective over stage 0's rank and the split's devices: vocab_shards.build_head_shard)."""
    rows = build_head_shard(config, split=split, device=device, owner=owner, vocab_size=vocab_size,
                            hidden_size=hidden_size, owner_weight=owner_weight, pp_group=pp_group, key=KEY,
                            extra_state=False)
    if rows is None:
        return None
    return EmbeddingShard(config, vocab_size=vocab_size, hidden_size=hidden_size, rows=rows.rows,
                          tp_rank=rows.tp_rank, tp_size=rows.tp_size, weight=rows.weight.data)


def fed_lookup(chunk) -> torch.nn.Module:
    """Stage 0's fed lookup in its (wrapped) chunk (placement.attach_embedding_shard put it there)."""
    from megatron.core.utils import get_attr_wrapped_model

    lookup = get_attr_wrapped_model(chunk, "embedding").word_embeddings
    if not isinstance(lookup, (EmbeddingShard, FedLookup)):
        raise OctoPipeError(f"plan splits the embedding, but stage 0's chunk holds Megatron's own "
                            f"{type(lookup).__name__}: build the chunks through plan_model_provider (it attaches the "
                            f"shards)")
    return lookup


@contextlib.contextmanager
def feeding(lookup, x: torch.Tensor):
    """Inside, stage 0's lookup gives `x` (the summed shard partials of the micro-batch being run)."""
    lookup.fed = x
    try:
        yield
    finally:
        lookup.fed = None


# ----- the token ids: stage 0's forward step read ahead, its model call replayed

class _Pending:
    """What the recorded model call returns: the forward step must hand it on unchanged."""

    __slots__ = ()


_PENDING = _Pending()


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCall:
    """Stage 0's forward step of one micro-batch, read ahead: the chunk's call and the loss_func it returned."""

    args: tuple
    kwargs: dict
    loss_func: Callable
    tokens: torch.Tensor  # the call's input_ids, [seq, mbs] int64 (the partials' sequence-major token order)


class _Recorder:
    """Stands in for stage 0's chunk while its forward step is read ahead: keeps the call, delegates the rest."""

    def __init__(self, model):
        self._model = model
        self.calls: list = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return _PENDING

    def __getattr__(self, name):  # get_attr_wrapped_model(model, "vp_stage") and the like reach the real chunk
        return getattr(self._model, name)


def read_model_calls(forward_step_func, batches, model, num_microbatches: int, device) -> list[ModelCall]:
    """Run the forward step of stage 0's micro-batches 0..m-1 (`batches(mb)`: its data iterator) against a recorder;
    every call's arguments, loss_func and token ids (on `device`)."""
    calls = []
    for mb in range(num_microbatches):
        rec = _Recorder(model)
        out, loss_func = forward_step_func(batches(mb), rec)
        if len(rec.calls) != 1 or out is not _PENDING:
            why = (f"called the model {len(rec.calls)} times" if len(rec.calls) != 1 else
                   "returned something other than the model's output")
            raise OctoPipeError(f"plan splits the embedding: stage 0's forward step (micro-batch {mb}) {why}; a split "
                                f"embedding replays the step's one model call at stage 0's F (return the model's "
                                f"output as it is, or drop the embedding's split)")
        args, kwargs = rec.calls[0]
        tokens = _input_ids(model, args, kwargs)
        calls.append(ModelCall(args=args, kwargs=kwargs, loss_func=loss_func,
                               tokens=tokens.t().to(device=device, dtype=torch.int64).contiguous()))
    return calls


def _input_ids(model, args, kwargs) -> torch.Tensor:
    """The `input_ids` of a call of the chunk (bound to the innermost model's forward: GPTModel's signature)."""
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "embedding"):
        inner = inner.module  # DDP, Float16Module
    try:
        ids = inspect.signature(inner.forward).bind(*args, **kwargs).arguments.get("input_ids")
    except TypeError as exc:
        raise OctoPipeError(f"plan splits the embedding: stage 0's forward step calls {type(inner).__name__} with "
                            f"arguments its forward does not take ({exc})") from None
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point():
        raise OctoPipeError(f"plan splits the embedding: stage 0's forward step passes input_ids "
                            f"{type(ids).__name__ if not torch.is_tensor(ids) else tuple(ids.shape)}; expected token "
                            f"ids [mbs, seq]")
    return ids


def replay(call: ModelCall):
    """A forward step for Megatron's schedules.forward_step that makes the kept call on the real chunk."""
    def step(data_iterator, model, *unused):
        return model(*call.args, **call.kwargs), call.loss_func

    return step


def stacked_tokens(calls: list[ModelCall]) -> torch.Tensor:
    """The step's token ids [m, seq, mbs] of stage 0's read-ahead calls (executor/token_exchange.py sends them to the
    shards, or stage 0's refusal to every rank)."""
    shapes = {tuple(c.tokens.shape) for c in calls}
    if len(shapes) > 1:
        raise OctoPipeError(f"plan splits the embedding: stage 0's token ids change shape within the step "
                            f"({sorted(sh[::-1] for sh in shapes)}, [mbs, seq]): feed one micro-batch shape")
    return torch.stack([c.tokens for c in calls])
