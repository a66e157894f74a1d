"""The pure plan -> Megatron mapping: which layers, flags and ranks a plan gives each Megatron chunk.

The leaf of the Megatron adapter: no framework import (nothing of megatron, nothing of torch),
only the plan, the model graph (`graph.py`, whose Megatron imports are lazy) and Megatron's layout
symbols (`layout.py`, pure). The
modules that build chunks or patch Megatron (`placement`, `embeddings`, `pretrain_hooks`,
`startup`, `schedule`, `hooks`) import their answers from here, so none of them has to import
another for a rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from ...actions import Action, Kind
from ...errors import OctoPipeError
from ...formats import plan_from_dict
from ...formats.ranges import stage_range_problem
from .graph import hybrid_pattern
from .layout import GPT_SYMBOLS, HYBRID_SYMBOLS

DECODER = "t"  # layout symbol of a decoder layer
MTP = "m"  # layout symbol of an MTP layer
# A HybridModel chunk's layers (Mamba, attention, MLP, MoE) count as decoder layers: its HybridStack numbers
# them globally like a TransformerBlock does, and the plan's chunk holds the same ends (embedding, MTP, loss).
CHUNK_SYMBOLS = MappingProxyType({**{kind: DECODER for kind in HYBRID_SYMBOLS}, **GPT_SYMBOLS})


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkSpec:
    """What one (rank, virtual stage) chunk builds under a plan."""

    stage: int  # the plan's stage index
    vp_stage: int  # position among the rank's chunks (model order) = Megatron's vp_stage
    layers: tuple[int, int]  # the plan's layer range [start, end) in the model graph
    decoder: tuple[int, int]  # global 0-based decoder layer numbers [start, end)
    mtp: tuple[int, int]  # global 0-based MTP layer numbers [start, end)
    pre_process: bool  # builds the embedding (input of the pipeline)
    post_process: bool  # builds the final norm, LM head and loss

    @property
    def num_decoder_layers(self) -> int:
        """Decoder layers the chunk builds."""
        return self.decoder[1] - self.decoder[0]


def stage_symbols(plan, model) -> list[list[str]]:
    """Megatron layout symbols (E, t, m, L) of each plan stage, checked against the model's layer kinds (GPT or hybrid)."""
    problem = stage_range_problem([(st.start, st.end) for st in plan.stages], model.num_layers)
    if problem is not None:
        raise OctoPipeError(f"model {model.name!r}: {problem.message}")
    symbols = []
    for i, layer in enumerate(model.layers):
        sym = CHUNK_SYMBOLS.get(layer.kind)
        if sym is None:
            raise OctoPipeError(f"model {model.name!r} layer {i} ({layer.name!r}) has kind {layer.kind!r}; a Megatron "
                                f"GPTModel or HybridModel chunk can hold only {sorted(CHUNK_SYMBOLS)}")
        symbols.append(sym)
    out = [symbols[st.start:st.end] for st in plan.stages]
    if "E" not in out[0]:
        raise OctoPipeError("plan: the embedding must sit in stage 0 (the stage that reads the batch); "
                            f"stage 0 holds layers {plan.stages[0].start}..{plan.stages[0].end - 1}")
    if "L" not in out[-1]:
        raise OctoPipeError(f"plan: the lm_head must sit in the last stage ({plan.num_stages - 1}), where the loss is "
                            "computed")
    return out


def chunk_specs(plan, model, rank: int) -> list[ChunkSpec]:
    """The chunks `rank` builds under `plan`, in vp_stage order (one per stage the plan places on it)."""
    syms = stage_symbols(plan, model)
    dec_before, mtp_before = [0], [0]
    for s in syms:
        dec_before.append(dec_before[-1] + s.count(DECODER))
        mtp_before.append(mtp_before[-1] + s.count(MTP))
    out = []
    for v, s in enumerate(plan.stages_of(rank)):
        st = plan.stages[s]
        out.append(ChunkSpec(stage=s, vp_stage=v, layers=(st.start, st.end),
                             decoder=(dec_before[s], dec_before[s + 1]), mtp=(mtp_before[s], mtp_before[s + 1]),
                             pre_process="E" in syms[s], post_process="L" in syms[s]))
    return out


def loss_rank(plan) -> int:
    """Pipeline rank that computes the loss (the last stage's device)."""
    return plan.loss_device


def first_rank(plan) -> int:
    """Pipeline rank that reads the batch (stage 0's device)."""
    return plan.first_device


def is_looped(plan) -> bool:
    """Whether stage i runs on rank i % P (the placement megatron.training's model builders make)."""
    return all(st.device == s % plan.num_devices for s, st in enumerate(plan.stages))


def plan_of_args(args):
    """The Plan resolved at start-up (None under Megatron's default schedule)."""
    doc = getattr(args, "octopipe_plan", None)
    return plan_from_dict(doc, "<args.octopipe_plan>") if isinstance(doc, dict) and doc else None


def is_first_stage(plan, rank: int, running: int | None = None, *, ignore_virtual: bool = True,
                   vp_stage: int | None = None) -> bool:
    """The plan's answer to Megatron's `is_pipeline_first_stage` on `rank` (a chunk's, or any chunk's)."""
    return _holds(plan.stages_of(rank), 0, ignore_virtual, vp_stage, running)


def is_last_stage(plan, rank: int, running: int | None = None, *, ignore_virtual: bool = True,
                  vp_stage: int | None = None) -> bool:
    """The plan's answer to Megatron's `is_pipeline_last_stage` on `rank` (a chunk's, or any chunk's)."""
    return _holds(plan.stages_of(rank), plan.num_stages - 1, ignore_virtual, vp_stage, running)


def _holds(mine, stage: int, ignore_virtual: bool, vp_stage: int | None, running: int | None = None) -> bool:
    if not ignore_virtual and vp_stage is not None:
        return vp_stage < len(mine) and mine[vp_stage] == stage
    if running is not None:
        # inside a chunk's forward the rank-level question is about that chunk: under a V-shape rank 0
        # runs stage 0 and the loss stage, and pretrain_gpt's get_batch drops the labels on a "first stage"
        return running == stage
    return stage in mine


def copy_ranks(plan, model, tied: bool) -> list[int]:
    """Pipeline ranks holding a word-embedding copy: embedding, MTP, and (when tied) the LM head, in model order.

    A tied head that the plan splits holds no whole copy: its shards are rows of the embedding, tied to it by
    `executor.tied_rows` (placement._attach_tied_head_shard), so the head's rank joins Megatron's embedding group only
    for another copy it holds."""
    syms = stage_symbols(plan, model)
    whole_head = tied and head_split(plan) is None
    ranks = []
    for s, st in enumerate(plan.stages):
        if "E" in syms[s] or MTP in syms[s] or (whole_head and "L" in syms[s]):
            if st.device not in ranks:
                ranks.append(st.device)
    return ranks


def embedding_ranks_fn(plan, model, tied: bool):
    """`get_embedding_ranks` for initialize_model_parallel: the ranks holding copies under `plan`."""
    ranks = copy_ranks(plan, model, tied)
    if len(ranks) > 1 and (ranks[0] != min(ranks) or ranks[-1] != max(ranks)):
        raise OctoPipeError(f"plan puts the word-embedding copies on pipeline ranks {ranks} (model order); Megatron's "
                            "embedding group needs the embedding on its lowest rank and the LM head on its highest")

    def get_embedding_ranks(pp_ranks, *unused):
        return [pp_ranks[r] for r in sorted(ranks)]

    return get_embedding_ranks


def plan_segment(plan, rank: int, vp_stage: int | None, main_pattern: str) -> tuple[str, int]:
    """The hybrid pattern segment chunk `vp_stage` of `rank` builds under `plan`, and its global layer offset.

    Start-up writes the plan's stages into `--hybrid-layer-pattern` in stage order ('|' between them,
    `stage_layout_args`); Megatron's select_pipeline_segment reads segment `vp_stage * P + rank` of it
    (round-robin). Under the plan the chunk is the plan's `vp_stage`-th stage on `rank` (model order), and
    its layers keep the global numbers of that stage (checkpoint keys match any other split)."""
    segments = main_pattern.split("|") if main_pattern else [""]
    if len(segments) != plan.num_stages:
        raise OctoPipeError(f"hybrid layer pattern {main_pattern!r} has {len(segments)} '|' segments but the plan "
                            f"has {plan.num_stages} stages; start-up writes one segment per plan stage (do not pass "
                            "'|' in --hybrid-layer-pattern under --pipeline-schedule octopipe)")
    mine = plan.stages_of(rank)
    v = vp_stage or 0
    if v >= len(mine):
        raise OctoPipeError(f"plan places {len(mine)} stages on pipeline rank {rank}; Megatron asked for its chunk "
                            f"{v} (vp_stage); the virtual pipeline size must be the plan's stages per rank")
    stage = mine[v]
    return segments[stage], sum(len(seg) for seg in segments[:stage])


def stage_layout_args(plan, specs, args) -> dict:
    """The Megatron arguments that build the plan's stages, in stage order (the plan's map places them)."""
    if hybrid_pattern(args):
        pieces = ["".join(HYBRID_SYMBOLS[s.kind] for s in specs[st.start:st.end] if s.kind not in
                          ("embedding", "lm_head", "mtp")) for st in plan.stages]
        mtp = hybrid_pattern(args).split("/", 1)
        return {"hybrid_layer_pattern": "|".join(pieces) + ("/" + mtp[1] if len(mtp) > 1 else ""),
                "hybrid_override_pattern": None}
    layout = "|".join("".join(GPT_SYMBOLS[s.kind] for s in specs[st.start:st.end]) for st in plan.stages)
    return {"pipeline_model_parallel_layout": layout}


def fuse_backward(plan, stages):
    """The plan with each I of `stages` run as a fused B in its place and their W dropped; (plan, pairs fused).

    B computes what I and W compute together, at I's position (where the input gradient is due), so
    every dependency still holds; only memory is freed earlier than the split plan said."""
    fused = set(stages)
    count = 0
    schedule = []
    for actions in plan.schedule:
        row = []
        for a in actions:
            if a.stage in fused and a.kind == Kind.I:
                row.append(Action(a.stage, Kind.B, a.microbatch))
                count += 1
            elif not (a.stage in fused and a.kind == Kind.W):
                row.append(a)
        schedule.append(tuple(row))
    if not count:
        return plan, 0
    # a pair's I half becomes the B in its place (the pair stays adjacent: its W was elsewhere in the row)
    pairs = tuple((first, Action(second.stage, Kind.B, second.microbatch) if second.stage in fused
                   and second.kind == Kind.I else second) for first, second in plan.pairs)
    return replace(plan, schedule=tuple(schedule), pairs=pairs), count


def split_stages(plan) -> list[int]:
    """Stages the plan runs with split backward (I and W)."""
    return sorted({a.stage for actions in plan.schedule for a in actions if a.kind == Kind.I})


def head_split(plan):
    """The plan's split of the LM head (a formats.splits.SplitLayer), or None."""
    from ...formats.splits import side_of

    n = plan.stages[-1].end
    return next((sp for sp in plan.splits if side_of(sp, n) == "output"), None)


def embedding_split(plan):
    """The plan's split of the input embedding (a formats.splits.SplitLayer), or None."""
    from ...formats.splits import side_of

    n = plan.stages[-1].end
    return next((sp for sp in plan.splits if side_of(sp, n) == "input"), None)


def embedding_split_blocker(*, mtp_layers: int = 0, tp_size: int = 1, tied: bool = False) -> str | None:
    """Why a Megatron run with these settings cannot split its input embedding (reason and fix), or None: the
    input side of `side_split_blocker`."""
    if mtp_layers:
        return (f"--mtp-num-layers {mtp_layers} with a split embedding is not supported (MTP looks up the word "
                f"embedding); drop the embedding's split or MTP")
    if tp_size > 1:
        return (f"tensor parallelism (size {tp_size}) with a split embedding is not supported yet; split the "
                f"embedding at --tensor-model-parallel-size 1")
    if tied:
        return ("a split embedding tied to the LM head is not supported; pass --untie-embeddings-and-output-weights "
                "or drop the embedding's split")
    return None


def side_split_blocker(side: str, *, mtp_layers: int = 0, tp_size: int = 1, tied: bool = False) -> str | None:
    """Why a Megatron run with these settings cannot split the layer on `side` ("input": the embedding, "output":
    the LM head) whatever the plan (reason and fix), or None: the one rule behind split_problem (plan by plan),
    tied_embedding_split_problem and what `--splits auto` tunes for a launch (startup.run_splits).

    Tensor parallelism (and sequence parallelism) is no refusal for the LM head: each TP rank's shards hold rows
    of its TP slice of the vocabulary (vocab_shards.head_rows) and reduce their statistics over the TP group
    first (vocab_shards.shard_tensor_parallel); a head tied to the embedding runs (executor.tied_rows)."""
    if side == "input":  # split_embedding.py: stage 0's rank need not hold a shard
        return embedding_split_blocker(mtp_layers=mtp_layers, tp_size=tp_size, tied=tied)
    if mtp_layers:
        return (f"--mtp-num-layers {mtp_layers} with a split LM head is not supported (MTP reuses the output "
                f"layer); drop the LM head's split or MTP")
    return None


def tied_embedding_split_problem(plan) -> str | None:
    """Why a model whose embedding is tied to its LM head cannot run the plan's split embedding, or None."""
    sp = embedding_split(plan)
    if sp is None:
        return None
    return f"plan splits[{plan.splits.index(sp)}] (layer {sp.layer}): {embedding_split_blocker(tied=True)}"


def split_problem(plan, *, mtp_layers: int = 0, tp_size: int = 1, tied: bool = False) -> str | None:
    """Why a Megatron run cannot run the plan's split layers (one line naming the plan field), or None: the
    settings' refusals of each split's side (side_split_blocker; `tied`: the embedding tied to the head), and
    a split head's shards without its owner (the last stage's device)."""
    from ...formats.splits import side_of

    n = plan.stages[-1].end
    owner = plan.stages[-1].device
    for i, sp in enumerate(plan.splits):
        where = f"plan splits[{i}] (layer {sp.layer})"
        side = side_of(sp, n)
        if side != "input" and owner not in sp.devices:
            return (f"{where}: devices {list(sp.devices)} must include device {owner}, the LM head's owner (the last "
                    f"stage's device: its J reports Megatron's loss); add it to the split's devices")
        blocker = side_split_blocker(side, mtp_layers=mtp_layers, tp_size=tp_size, tied=tied)
        if blocker is not None:
            return f"{where}: {blocker}"
    return None
