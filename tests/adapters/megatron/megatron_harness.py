"""A tiny Megatron GPT on CPU/gloo for the adapter's tests (local spec, DDP, distributed optimizer).

Every parameter is seeded from its *global* name (decoder layers by their global layer
number), so any split — PP=1, Megatron's round-robin layout, an OctoPipe plan with any
stage->rank map — starts from identical weights and computes the same function. The
forward step and loss function follow pretrain_gpt.py (3-tuple loss, labels only where
`is_first_or_last_pipeline_stage(vp_stage)` says so, through Megatron's own helper).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import megatron_cpu_shims as cpu_shims
from octopipe_plugin.testing.process_groups import destroy_groups_since


@dataclass(frozen=True, kw_only=True)
class TinyGPT:
    """Shape of the tiny model and its data."""

    num_layers: int = 6
    hidden: int = 32
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    mbs: int = 2
    moe_layers: tuple[int, ...] = ()  # global decoder layer numbers (0-based) that are MoE layers
    num_experts: int = 4
    mtp: int = 0
    tied: bool = False
    bf16: bool = False  # Megatron's Float16Module around each chunk, fp32 main params in the optimizer
    three_tuple_loss: bool = True
    args: tuple[str, ...] = ()  # more Megatron command-line arguments

    def graph(self):
        """The OctoPipe model graph of this GPT (embedding, decoder layers, MTP layers, LM head)."""
        from octopipe_plugin.formats import Layer, Model

        cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
        kinds = (["embedding"] + ["moe" if i in self.moe_layers else "dense" for i in range(self.num_layers)]
                 + ["mtp"] * self.mtp + ["lm_head"])
        return Model(name="tiny-gpt", layers=tuple(Layer(name=f"l{i}", kind=k, **cost) for i, k in enumerate(kinds)))


def init_process(rank: int, world: int, port: int) -> None:
    """Shims first, then a gloo world of `world` ranks."""
    cpu_shims.install()
    from octopipe_plugin.executor.launch import init_gloo

    init_gloo(rank, world, port, timeout_s=120)


def spawn(fn, world: int, *args) -> None:
    """executor.launch.spawn (fn(rank, world, port, *args) on `world` ranks), the ranks forked from the session's
    forkserver, which imported the CPU shims and Megatron once (megatron_preload.py)."""
    import os

    from octopipe_plugin.executor.launch import spawn as spawn_ranks
    from octopipe_plugin.executor.launch import use_forkserver

    # the server finds its preload on the PYTHONPATH it starts with (Python 3.11 drops the sys.path it is given;
    # a preload that fails to import is skipped, the ranks then import for themselves)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [old])])
    try:
        use_forkserver(PRELOAD)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    spawn_ranks(fn, world, *args, preload=PRELOAD)


PRELOAD = ["megatron_preload"]


def _size(spec: TinyGPT, flag: str) -> int:
    args = list(spec.args)
    return int(args[args.index(flag) + 1]) if flag in args else 1


def tp_size(spec: TinyGPT) -> int:
    """The spec's --tensor-model-parallel-size (1 unless its extra arguments set it)."""
    return _size(spec, "--tensor-model-parallel-size")


def ep_size(spec: TinyGPT) -> int:
    """The spec's --expert-model-parallel-size (1 unless its extra arguments set it)."""
    return _size(spec, "--expert-model-parallel-size")


shim_device_arch = cpu_shims.shim_device_arch  # validate_args' GPU-architecture question at TP > 1
shim_sequence_parallel_norm = cpu_shims.shim_sequence_parallel_norm  # --sequence-parallel's norms on CPU


def release_parallel() -> None:
    """Megatron's parallel state destroyed, with its process groups (a case's end, or before the next state)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    # Megatron's destroy only drops its references: each re-initialisation would add its ~25 gloo groups to the live
    # ones until the spawn ends (process_groups.py); every group but the default one and those made to be reused
    destroy_groups_since({dist.group.WORLD} if dist.is_initialized() else set())


def init_parallel(pp: int, vp: int | None = None, embedding_ranks=None, tp: int = 1, ep: int = 1) -> None:
    """(Re)initialise Megatron's parallel state: TP=tp, PP=pp, the rest DP, EP=ep carved from it (the previous
    state's groups destroyed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    release_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
                                 get_embedding_ranks=embedding_ranks, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)


# Switched off because they need CUDA (fused kernels, Transformer Engine) — each is a Megatron default on GPU.
CUDA_ONLY_ARGS = ("--transformer-impl", "local",  # Transformer Engine layers need CUDA
                  "--no-gradient-accumulation-fusion",  # fused wgrad-into-main_grad CUDA kernel
                  "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",  # fused kernels
                  "--no-persist-layer-norm",  # apex persistent layer-norm kernel
                  "--no-rope-fusion",  # fused RoPE kernel
                  "--use-cpu-initialization")  # weights initialised on the host (no GPU to initialise on)
# Not CUDA, but needed by the oracles: dropout draws would differ between schedules that run the forwards in
# different orders, so the comparisons run without dropout.
ORACLE_ARGS = ("--hidden-dropout", "0", "--attention-dropout", "0")


def megatron_argv(spec: TinyGPT, pp: int, global_batch: int, train_iters: int = 3, layout: str | None = None) -> list:
    """Megatron command-line arguments of the tiny model (what a user would type, CUDA-only switches off)."""
    argv = ["--num-layers", str(spec.num_layers), "--hidden-size", str(spec.hidden),
            "--num-attention-heads", str(spec.heads), "--ffn-hidden-size", str(2 * spec.hidden),
            "--seq-length", str(spec.seq), "--max-position-embeddings", str(spec.seq),
            "--micro-batch-size", str(spec.mbs), "--global-batch-size", str(global_batch),
            "--pipeline-model-parallel-size", str(pp), "--position-embedding-type", "rope",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec.vocab),
            "--lr", "0.01", "--min-lr", "0.01", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--train-iters", str(train_iters), "--use-distributed-optimizer",
            *CUDA_ONLY_ARGS, *ORACLE_ARGS]
    if not spec.tied:
        argv.append("--untie-embeddings-and-output-weights")
    if spec.moe_layers:
        freq = "[" + ",".join("1" if i in spec.moe_layers else "0" for i in range(spec.num_layers)) + "]"
        argv += ["--num-experts", str(spec.num_experts), "--moe-layer-freq", freq, "--moe-router-topk", "2",
                 "--moe-ffn-hidden-size", str(spec.hidden), "--moe-aux-loss-coeff", "0.01",
                 "--moe-router-load-balancing-type", "aux_loss", "--moe-token-dispatcher-type", "alltoall"]
    if spec.mtp:
        argv += ["--mtp-num-layers", str(spec.mtp), "--mtp-loss-scaling-factor", "0.1"]
    if spec.bf16:
        argv.append("--bf16")
    if layout is not None:
        argv += ["--pipeline-model-parallel-layout", layout]
    return argv + list(spec.args)


def megatron_args(argv: list, world: int | None = None):
    """Megatron's own parse_args + validate_args over `argv` (as pretrain_gpt.py's start-up runs them)."""
    import contextlib
    import io
    import os
    import sys

    from megatron.training.arguments import parse_args, validate_args

    world = dist.get_world_size() if world is None else world
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world), str(dist.get_rank() if dist.is_initialized() else 0)
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            args = parse_args()
            validate_args(args, {})
    finally:
        sys.argv = saved
    return args


def make_config(spec: TinyGPT, pp: int, layout=None, **over):
    """TransformerConfig of the tiny model for `pp` pipeline ranks, from Megatron's own parser, validation and
    `core_transformer_config_from_args` (so Megatron's defaults hold: deallocate_pipeline_outputs=True, ...);
    `layout` is a layout string (through --pipeline-model-parallel-layout) or a layout object (put in as
    the adapter's apply_layout does)."""
    from megatron.training.arguments import core_transformer_config_from_args

    dp = (dist.get_world_size() if dist.is_initialized() else 1) // pp // tp_size(spec)
    if tp_size(spec) > 1:
        shim_device_arch()
    if "--sequence-parallel" in spec.args:
        shim_sequence_parallel_norm()
    text = layout if isinstance(layout, str) else None
    args = megatron_args(megatron_argv(spec, pp, spec.mbs * dp, layout=text))
    config = core_transformer_config_from_args(args)
    # Megatron's batched isend/irecv (batch_p2p_comm, its default without VP) gives wrong results on gloo
    # (measured, megatron-contract.md): the Megatron oracles run on CPU need the unbatched p2p path.
    config.batch_p2p_comm = False
    if layout is not None and text is None:
        from octopipe_plugin.adapters.megatron.placement import apply_layout

        apply_layout(config, layout)
    for k, v in over.items():
        setattr(config, k, v)
    return config


def build_chunk(spec: TinyGPT, config, pre_process: bool, post_process: bool, vp_stage: int | None):
    """One GPTModel chunk (local spec), parameters seeded by global name."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if spec.moe_layers else None,
                                          moe_grouped_gemm=False)
    if spec.moe_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    mtp_spec = None
    if spec.mtp:
        base = get_gpt_layer_local_spec()
        mtp_spec = get_gpt_mtp_block_spec(config, base, use_transformer_engine=False, vp_stage=vp_stage)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=spec.vocab,
                     max_sequence_length=spec.seq, pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
                     mtp_block_spec=mtp_spec, vp_stage=vp_stage)
    seed_by_global_name(model, spec.tied)
    return model


def tp_suffix(p=None) -> str:
    """"@tp<rank>" at TP > 1 (for `p`: only when it is a tensor-parallel slice), else "": TP slices named apart."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return ""
    if p is not None and not getattr(p, "tensor_model_parallel", False):
        return ""
    return f"@tp{ps.get_tensor_model_parallel_rank()}"


def global_names(model) -> dict[str, torch.nn.Parameter]:
    """Parameters of a GPTModel chunk under split-independent names (decoder layers renumbered globally)."""
    out = {}
    layer_ids = {}
    for prefix, layers in (("decoder.layers.", getattr(getattr(model, "decoder", None), "layers", None)),
                           ("mtp.layers.", getattr(getattr(model, "mtp", None), "layers", None))):
        for i, layer in enumerate(layers or ()):
            layer_ids[f"{prefix}{i}."] = f"{prefix}{layer.layer_number - 1}."
    shard_rows = {id(m.weight): m.rows for m in model.modules()
                  if type(m).__name__ in ("HeadShard", "EmbeddingShard")}
    for name, p in model.named_parameters():
        for local, glob in layer_ids.items():
            if name.startswith(local):
                name = glob + name[len(local):]
                break
        if id(p) in shard_rows:  # a split head's / embedding's shard: its rows of output_layer.weight / the embedding
            lo, hi = shard_rows[id(p)]
            name = f"{name}[{lo}:{hi}]"
        out[name] = p
    return out


def seed_by_global_name(model, tied: bool = False) -> None:
    """Fill every parameter from a generator seeded by its global name (same weights under any split)."""
    with torch.no_grad():
        for name, p in global_names(model).items():
            if name == "output_layer.weight" and tied:
                # the LM head's copy of the tied embedding is left to the tying under test (the
                # adapter's same-rank copy; a cross-rank copy would need seeding before Megatron's
                # construction all-reduce, which no case here has)
                continue
            # TP slices seeded apart (a slice swapped between TP ranks changes the function); replicas alike
            g = torch.Generator().manual_seed(zlib.crc32((name + tp_suffix(p)).encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith(("layer_norm_weight", "layernorm.weight", "norm.weight", "_norm.weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.02 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def wrap_ddp(chunks, config, overlap_grad_reduce: bool = False):
    """Megatron's DDP around each chunk (inside a Float16Module for bf16), buffers for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if config.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.bf16,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=True, bucket_size=None)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                    disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]


def release_optimizer(config) -> None:
    """At a case's end: drop its model config's reference to its optimizer (`grad_scale_func = opt.scale_loss`).

    That reference closes a cycle gc cannot collect: the distributed optimizer's parameter shards hold autograd
    nodes of the parameters (C++), whose AccumulateGrad hooks (Megatron DDP's) hold the DDP wrapper, its model
    and config. Left in place, every case's model, optimizer and process groups live until the spawn ends (each
    gloo group 3 threads: a 4-rank split spawn grew by ~60 threads a rank per case, to ~730)."""
    config.grad_scale_func = None


def make_optimizer(chunks):
    """Megatron's distributed Adam over the DDP chunks (fp32 main parameters for bf16 models)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    bf16 = get_model_config(chunks[0]).bf16
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=True,
                          bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          clip_grad=1.0)
    return get_megatron_optimizer(cfg, chunks)


def make_scheduler(opt, total_samples: int = 10 ** 6):
    """Megatron's LR / weight-decay scheduler, constant (what train_step steps after each update); it also
    applies the per-group multipliers (no weight decay on biases and norms)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-2, lr_warmup_steps=0,
                                   lr_decay_steps=total_samples, lr_decay_style="constant", start_wd=0.01,
                                   end_wd=0.01, wd_incr_steps=total_samples, wd_incr_style="constant")


def batch(spec: TinyGPT, index: int) -> dict:
    """Micro-batch `index` (a pure function of it): tokens, labels, mask, positions, causal mask."""
    g = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, spec.vocab, (spec.mbs, spec.seq + 1), generator=g)
    loss_mask = torch.ones(spec.mbs, spec.seq)
    loss_mask[:, : index % 3] = 0  # token counts differ between micro-batches, as with real padding
    causal = torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), diagonal=1)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(spec.seq).unsqueeze(0).expand(spec.mbs, -1).contiguous(),
            "attention_mask": causal.view(1, 1, spec.seq, spec.seq).expand(spec.mbs, 1, -1, -1).contiguous()}


def make_forward_step(spec: TinyGPT):
    """pretrain_gpt.py's forward_step: data only where Megatron's stage helpers say first/last."""
    from functools import partial

    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training.utils import is_first_or_last_pipeline_stage

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        if not spec.three_tuple_loss:
            loss = loss / mask.sum()
            return loss, {"lm loss": loss.detach().view(1)}
        num_tokens = mask.sum().clone().detach().to(torch.int)
        report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
        return loss, num_tokens, {"lm loss": report}

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        if is_first_or_last_pipeline_stage(vp_stage):
            b = next(data_iterator)
        else:
            b = {k: None for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")}
        # --overlap-moe-expert-parallel-comm: the combined 1F1B step asks for the chunk's schedule plan instead
        call = model.build_schedule_plan if return_schedule_plan else model
        out = call(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"])
        return out, partial(loss_func, b["loss_mask"])

    return forward_step


def data_iterators(spec: TinyGPT, num_chunks: int, step: int, num_microbatches: int, dp_rank: int = 0,
                   dp_size: int = 1):
    """One iterator per chunk over this step's micro-batches of this DP replica (Megatron passes a list)."""
    first = (step * dp_size + dp_rank) * num_microbatches
    return [iter([batch(spec, first + k) for k in range(num_microbatches)]) for _ in range(num_chunks)]


def gathered_weights(chunks, group=None) -> dict[str, torch.Tensor]:
    """Every parameter of the whole pipeline by global name (all-gathered over the pipeline group)."""
    from megatron.core.distributed import DistributedDataParallel

    mine = {}
    for c in chunks:
        inner = c.module if isinstance(c, DistributedDataParallel) else c
        inner = getattr(inner, "module", inner) if not hasattr(inner, "decoder") else inner  # Float16Module
        for name, p in global_names(inner).items():
            mine.setdefault(name + tp_suffix(), p.detach().float().clone())  # every TP rank's values at TP > 1
    allw = [None] * dist.get_world_size(group)
    dist.all_gather_object(allw, mine, group=group)
    out = {}
    for part in allw:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def reduced_main_grads(chunks, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's main_grad after the step's gradient reduction (what the optimizer steps on), by global
    name over the whole pipeline. With the distributed optimizer each data-parallel rank holds the reduced
    values of its own shard of each bucket only; the shards are put together over the data-parallel group."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    mine = {}
    for c in chunks:
        inner = c.module if isinstance(c, DistributedDataParallel) else c
        inner = getattr(inner, "module", inner) if not hasattr(inner, "decoder") else inner  # Float16Module
        name_of = {id(p): n + tp_suffix() for n, p in global_names(inner).items()}  # every TP rank's at TP > 1
        for buf in [*c.buffers, *c.expert_parallel_buffers]:
            dp_group = buf.data_parallel_group
            dp, r = dp_group.size(), dp_group.rank()
            full = torch.zeros_like(buf.grad_data)
            base, size = buf.grad_data.data_ptr(), buf.grad_data.element_size()
            for bucket in buf.buckets:
                local = shard_buffer(bucket.grad_data, dp)[r] if dp > 1 else bucket.grad_data
                start = (local.data_ptr() - base) // size
                full[start:start + local.numel()] = local
            if dp > 1:
                dist.all_reduce(full, group=dp_group)
            for p, (s, e, _) in buf.param_index_map.items():
                mine.setdefault(name_of[id(p)], full[s:e].view(p.shape).double().clone())
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    out = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def grad_mismatches(got: dict, want: dict, rel: float = 1e-3) -> list[str]:
    """Parameters whose gradient differs from the reference by more than `rel` in relative norm (a 1% scale
    error, x1.01, is a relative difference of 1e-2: ten times this tolerance)."""
    bad = [f"{name}: missing" for name in want if name not in got]
    for name, w in want.items():
        if name in got:
            err = (got[name] - w).norm().item()
            scale = w.norm().item()
            if err > rel * scale + 1e-12:
                bad.append(f"{name}: |diff| {err:.3e} > {rel} x |want| {scale:.3e}")
    return bad
