"""The OctoPipe model of a PipelineModule's layer list, without building a layer.

Each `LayerSpec` / `TiedLayerSpec` is read from its type and constructor arguments and costed
with the analytic model of `octopipe_plugin.costs` (the same FLOP/byte formulas the zoo uses):
embeddings (and a head tied to one), Linear (kind "lm_head" as the list's last entry when
`head_split` can split it: `LayerSpec(nn.Linear, hidden, vocab, bias=False)`), LayerNorm/RMSNorm,
torch's Transformer encoder/decoder layers and Hugging Face style decoder blocks built from a config that has
`hidden_size`, `intermediate_size`, `num_attention_heads`, and DeepSpeed MoE layers
(`LayerSpec(deepspeed.moe.layer.MoE, hidden, expert, num_experts=, ep_size=, k=, capacity_factor=,
min_capacity=)`: gate, experts at their capacity, and with `ep_size` > 1 the dispatch and combine
all-to-alls as communication phases, the phases OctoPipeEngine runs a pair's MoE entries in,
moe_pairs.py). Plain functions in the list cost nothing. Anything else is refused with its index
and type, unless `costs` supplies it: a mapping from list index or type name to a `Layer`, a dict
of Layer fields, or a callable `(spec, index) -> either`; measured costs come the same way (or as a
whole octopipe-model/1 file in the block's "model" field).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ...costs.analytic import adam_state_bytes_per_param, layer_cost
from ...costs.arch import Arch
from ...costs.blocks import llm_dims, norm
from ...gpus import get_gpu
from ...costs.ops import matmul, total_times
from ...errors import OctoPipeError
from ...formats.model import Layer, Model
from .head_split import splittable_head

_HINT = ("supply its costs: model_from_specs(..., costs={index or type name: {fwd_ms, bwd_ms, wgrad_ms, "
         "state_bytes, activation_bytes, output_bytes}}), or name an octopipe-model/1 file (e.g. measured by "
         "`octopipe profile`) in the block's \"model\" field")


def _spec_parts(spec):
    """(type, args, kwargs, tied forward_fn or None) of a LayerSpec, a built module or a function."""
    typename = getattr(spec, "typename", None)
    if typename is not None:
        return typename, tuple(spec.module_args), dict(spec.module_kwargs), getattr(spec, "forward_fn", None)
    if isinstance(spec, nn.Module):
        return type(spec), None, None, None
    return None, None, None, None


def _arg(args, kwargs, i: int, name: str, default=None):
    if kwargs and name in kwargs:
        return kwargs[name]
    if args is not None and len(args) > i:
        return args[i]
    return default


def _arch(name: str, hidden: int, *, seq_len: int, micro_batch_size: int, dtype_bytes: int, **kw) -> Arch:
    return Arch(name=name, num_layers=1, hidden=hidden, ffn=kw.pop("ffn", 4 * hidden), heads=kw.pop("heads", 1),
                vocab=kw.pop("vocab", 1), seq_len=seq_len, micro_batch_size=micro_batch_size,
                dtype_bytes=dtype_bytes, **kw)


def _from_cost(name: str, kind: str, c) -> Layer:
    return Layer(name=name, kind=kind, fwd_ms=c.fwd_ms, bwd_ms=c.bwd_ms, wgrad_ms=c.wgrad_ms,
                 state_bytes=c.state_bytes, activation_bytes=c.activation_bytes, output_bytes=c.output_bytes,
                 source="analytic")


def _linear(name, args, kwargs, env) -> Layer:
    k, n = int(_arg(args, kwargs, 0, "in_features")), int(_arg(args, kwargs, 1, "out_features"))
    bias = bool(_arg(args, kwargs, 2, "bias", True))
    tokens, dt = env["tokens"], env["dtype_bytes"]
    f, i, w = total_times([matmul(name, tokens, k, n, dt)], env["gpu"])
    params = k * n + (n if bias else 0)
    return Layer(name=name, kind="linear", fwd_ms=f, bwd_ms=i, wgrad_ms=w,
                 state_bytes=int(params * adam_state_bytes_per_param(dt)), activation_bytes=tokens * k * dt,
                 output_bytes=tokens * n * dt, source="analytic")


def _norm(name, hidden: int, layernorm: bool, env) -> Layer:
    arch = _arch(name, hidden, seq_len=env["seq_len"], micro_batch_size=env["micro_batch_size"],
                 dtype_bytes=env["dtype_bytes"], layernorm=layernorm)
    op, params, act = norm(llm_dims(arch))
    f, i, w = total_times([op], env["gpu"])
    return Layer(name=name, kind="norm", fwd_ms=f, bwd_ms=i, wgrad_ms=w,
                 state_bytes=int(params * adam_state_bytes_per_param(env["dtype_bytes"])), activation_bytes=act,
                 output_bytes=act, source="analytic")


def _analytic(name: str, spec, env) -> Layer | None:
    """The analytic Layer of one list entry, or None when its type is not recognised."""
    typ, args, kwargs, forward_fn = _spec_parts(spec)
    if typ is None:
        return None
    if args is None:  # a built module: read its attributes
        return _analytic_module(name, spec, env)
    base = dict(seq_len=env["seq_len"], micro_batch_size=env["micro_batch_size"], dtype_bytes=env["dtype_bytes"])
    if issubclass(typ, nn.Embedding):
        vocab, hidden = int(_arg(args, kwargs, 0, "num_embeddings")), int(_arg(args, kwargs, 1, "embedding_dim"))
        kind = "lm_head" if forward_fn is not None else "embedding"
        return _from_cost(name, kind, layer_cost(_arch(name, hidden, vocab=vocab, **base), kind, env["gpu"]))
    if issubclass(typ, nn.Linear):
        return _linear(name, args, kwargs, env)
    if _is_moe(typ):
        return _moe(name, args, kwargs, env)
    if issubclass(typ, nn.LayerNorm) or typ.__name__.lower().endswith("rmsnorm"):
        shape = _arg(args, kwargs, 0, "normalized_shape") or _arg(args, kwargs, 0, "hidden_size")
        hidden = int(shape if isinstance(shape, int) else shape[-1])
        return _norm(name, hidden, issubclass(typ, nn.LayerNorm), env)
    if issubclass(typ, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        d, heads = int(_arg(args, kwargs, 0, "d_model")), int(_arg(args, kwargs, 1, "nhead"))
        ffn = int(_arg(args, kwargs, 2, "dim_feedforward", 2048))
        arch = _arch(name, d, heads=heads, ffn=ffn, gated_mlp=False, layernorm=True, bias=True, rope=False,
                     flash_attention=False, **base)
        return _from_cost(name, "dense", layer_cost(arch, "dense", env["gpu"]))
    config = _arg(args, kwargs, 0, "config")
    if config is not None and all(hasattr(config, a) for a in ("hidden_size", "intermediate_size",
                                                              "num_attention_heads")):
        heads = int(config.num_attention_heads)
        arch = _arch(name, int(config.hidden_size), heads=heads, ffn=int(config.intermediate_size),
                     kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                     vocab=int(getattr(config, "vocab_size", 1) or 1), **base)
        return _from_cost(name, "dense", layer_cost(arch, "dense", env["gpu"]))
    return _meta_built(name, spec, env)


def _is_moe(typ) -> bool:
    """Whether a list entry's type is DeepSpeed's MoE layer (its forward DeepSpeed's own: moe_pairs.exposes_moe)."""
    try:
        from deepspeed.moe.layer import MoE
    except ImportError:
        return False
    return isinstance(typ, type) and issubclass(typ, MoE) and typ.forward is MoE.forward


def _moe(name: str, args, kwargs, env) -> Layer | None:
    """A DeepSpeed MoE entry (deepspeed/moe/layer.py MoE, sharded_moe.py MOELayer): the gate on every token, the
    experts of this rank on their capacity of every rank's tokens, and with ep > 1 the dispatch and combine
    all-to-alls of the [experts, capacity, hidden] buffer as communication phases (costs/ops.py alltoall, the EP
    group in one node); None where the expert module cannot be costed."""
    import math

    from ...costs.ops import alltoall, elementwise, op_times
    from ...formats.model import Phase

    h = int(_arg(args, kwargs, 0, "hidden_size"))
    expert = _arg(args, kwargs, 1, "expert")
    e = int(_arg(args, kwargs, 2, "num_experts", 1))
    ep = int(_arg(args, kwargs, 3, "ep_size", 1))
    k = int(_arg(args, kwargs, 4, "k", 1))
    cf = float(_arg(args, kwargs, 5, "capacity_factor", 1.0))
    min_cap = int(_arg(args, kwargs, 7, "min_capacity", 4))
    if not isinstance(expert, nn.Module) or ep < 1 or e % ep:
        return None
    n, dt, gpu = env["tokens"], env["dtype_bytes"], env["gpu"]
    cap = max(math.ceil(n / e * cf * k), min_cap)  # sharded_moe._capacity with the top-k factor
    slots = e * cap  # the dispatch buffer's rows on every rank: e/ep local experts x ep senders x capacity
    ex = _analytic_module(f"{name}.expert", expert, {**env, "tokens": slots // e})
    if ex is None:
        return None
    local = e // ep
    gate_ops = [matmul("gate", n, h, e, 4), elementwise("routing", 8.0 * n * e),
                elementwise("encode", 2.0 * slots * h * dt)]
    gf, gi, gw = total_times(gate_ops, gpu)
    ef, ei, ew = ex.fwd_ms * e, ex.bwd_ms * e, ex.wgrad_ms * e  # every local expert on ep x capacity rows
    cf_ms, ci_ms, _ = op_times(elementwise("decode", (2.0 * slots + n) * h * dt), gpu)
    phases = [Phase(name="gate", resource="compute", fwd_ms=gf, bwd_ms=gi)]
    if ep > 1:
        a_f, a_i, _ = op_times(alltoall("dispatch", slots * h * dt, ep, 1), gpu)
        phases.append(Phase(name="dispatch", resource="comm", fwd_ms=a_f, bwd_ms=a_i))
    phases.append(Phase(name="experts", resource="compute", fwd_ms=ef, bwd_ms=ei))
    if ep > 1:
        phases.append(Phase(name="combine", resource="comm", fwd_ms=a_f, bwd_ms=a_i))
    phases.append(Phase(name="combine-out", resource="compute", fwd_ms=cf_ms, bwd_ms=ci_ms))
    params = h * e + local * ex.state_bytes / adam_state_bytes_per_param(dt)
    return Layer(name=name, kind="moe", fwd_ms=sum(p.fwd_ms for p in phases), bwd_ms=sum(p.bwd_ms for p in phases),
                 wgrad_ms=gw + ew, state_bytes=int(params * adam_state_bytes_per_param(dt)),
                 activation_bytes=int(n * h * dt + 4 * n * e + 2 * slots * h * dt + ex.activation_bytes * e),
                 output_bytes=n * h * dt, source="analytic", phases=tuple(phases) if ep > 1 else ())


def _analytic_module(name: str, module: nn.Module, env) -> Layer | None:
    """Cost a module from its attributes (a built one, or one built on the meta device)."""
    if isinstance(module, nn.Embedding):
        return _analytic(name, _Spec(nn.Embedding, (module.num_embeddings, module.embedding_dim)), env)
    if isinstance(module, nn.Linear):
        return _linear(name, (module.in_features, module.out_features, module.bias is not None), {}, env)
    if isinstance(module, nn.LayerNorm):
        return _norm(name, int(module.normalized_shape[-1]), True, env)
    attn = [m for m in module.modules() if isinstance(m, nn.MultiheadAttention)]
    if len(attn) == 1:  # a transformer block: attention + MLP (e.g. a class wrapping TransformerEncoderLayer)
        hidden, heads = int(attn[0].embed_dim), int(attn[0].num_heads)
        inner = {id(m) for m in attn[0].modules()}
        up = [m.out_features for m in module.modules()
              if isinstance(m, nn.Linear) and id(m) not in inner and m.in_features == hidden]
        ffn = max(up) if up else 4 * hidden
        arch = _arch(name, hidden, heads=heads, ffn=ffn, gated_mlp=up.count(ffn) >= 2,
                     layernorm=any(isinstance(m, nn.LayerNorm) for m in module.modules()), bias=True, rope=False,
                     flash_attention=False, seq_len=env["seq_len"], micro_batch_size=env["micro_batch_size"],
                     dtype_bytes=env["dtype_bytes"])
        return _from_cost(name, "dense", layer_cost(arch, "dense", env["gpu"]))
    return _composite(name, module, env)


def _composite(name: str, module: nn.Module, env) -> Layer | None:
    """A module whose parameters all sit in Linear and norm layers (an MLP block): the sum of their costs."""
    parts = []
    for sub in module.modules():
        if sub is module or not any(True for _ in sub.parameters(recurse=False)):
            continue
        if not isinstance(sub, (nn.Linear, nn.LayerNorm)):
            return None
        parts.append(_analytic_module(f"{name}.part", sub, env))
    if not parts or any(p is None for p in parts):
        return None
    return Layer(name=name, kind="mlp", fwd_ms=sum(p.fwd_ms for p in parts), bwd_ms=sum(p.bwd_ms for p in parts),
                 wgrad_ms=sum(p.wgrad_ms for p in parts), state_bytes=sum(p.state_bytes for p in parts),
                 activation_bytes=sum(p.activation_bytes for p in parts), output_bytes=parts[-1].output_bytes,
                 source="analytic")


def _meta_built(name: str, spec, env) -> Layer | None:
    """Build a LayerSpec on the meta device (no memory, no compute) and cost what it contains."""
    import torch

    try:
        with torch.device("meta"):
            module = spec.build()
    except Exception:  # noqa: BLE001 - a constructor that needs real tensors: not recognised
        return None
    return _analytic_module(name, module, env)


class _Spec:
    def __init__(self, typename, args):
        self.typename, self.module_args, self.module_kwargs = typename, args, {}


def _supplied(entry, spec, index: int, name: str) -> Layer:
    if callable(entry) and not isinstance(entry, (Layer, dict)):
        entry = entry(spec, index)
    if isinstance(entry, Layer):
        return replace(entry, name=name)
    if isinstance(entry, dict):
        fields = {"kind": "custom", "source": "measured", **entry, "name": name}
        try:
            return Layer(**fields)
        except TypeError as exc:
            raise OctoPipeError(f"costs for layer {index} ({name}): {exc}; expected the fields fwd_ms, bwd_ms, "
                                "wgrad_ms, state_bytes, activation_bytes, output_bytes") from None
    raise OctoPipeError(f"costs for layer {index} ({name}): expected a Layer, a dict of its fields or a callable, "
                        f"got {type(entry).__name__}")


def spec_name(spec) -> str:
    """The type name of a list entry (LayerSpec type, module class or function name)."""
    typ = _spec_parts(spec)[0]
    if typ is not None:
        return typ.__name__
    return getattr(spec, "__name__", type(spec).__name__)


def model_from_specs(specs, *, seq_len: int = 2048, micro_batch_size: int = 1, gpu="H100", dtype_bytes: int = 2,
                     costs: dict | None = None, name: str = "deepspeed-pipeline") -> Model:
    """The cost-annotated Model of a PipelineModule layer list (one OctoPipe layer per entry)."""
    env = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, dtype_bytes=dtype_bytes, gpu=get_gpu(gpu),
               tokens=seq_len * micro_batch_size)
    costs = costs or {}
    layers = []
    for j, spec in enumerate(specs):
        type_name = spec_name(spec)
        lname = f"{j:02d}_{type_name}"
        entry = costs.get(j, costs.get(type_name))
        if entry is not None:
            layers.append(_supplied(entry, spec, j, lname))
            continue
        layer = _analytic(lname, spec, env)
        if layer is None and _spec_parts(spec)[0] is None and callable(spec):
            prev = layers[-1].output_bytes if layers else 0
            layer = Layer(name=lname, kind="function", fwd_ms=0.0, bwd_ms=0.0, wgrad_ms=0.0, state_bytes=0,
                          activation_bytes=0, output_bytes=prev, source="analytic")
        if layer is None:
            raise OctoPipeError(f"layer {j} ({type_name}): the analytic cost model does not recognise this layer "
                                f"type; {_HINT}")
        if j == len(specs) - 1 and j > 0 and layer.kind == "linear" and splittable_head(spec):
            layer = replace(layer, kind="lm_head")  # the LM head a split plan may divide (head_split.py)
        layers.append(layer)
    return Model(name=name, layers=tuple(layers), meta={"cost_model": "analytic", "gpu": env["gpu"].name,
                                                       "seq_len": seq_len, "micro_batch_size": micro_batch_size})
