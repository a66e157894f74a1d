"""A plan's per-layer memory choices on Megatron chunks (docs/formats.md "Memory choices", docs/megatron-schedule.md).

Each layer the plan names (the embedding, a decoder layer, the LM head's output layer) gets its own recompute or
offload, where Megatron's `--recompute-*` arguments apply one setting to every chunk:

- `recompute`: the layer's forward runs under a non-reentrant `torch.utils.checkpoint` (the executor's
  `checkpointed`, Megatron's CUDA RNG tracker states restored for the recompute as Megatron's own checkpoint does);
  non-reentrant, so the plan's I (an `autograd.grad`) may run through it, which Megatron's reentrant
  `--recompute-granularity full` cannot.
- `selective:<modules>`: the flags Megatron's constructors set from `recompute_granularity='selective'` and
  `recompute_modules` are set on that layer's modules alone (`_FLAGS`), so Megatron's own selective recompute runs
  there (CheckpointWithoutOutput for the norms, its checkpoint for core attention and the MoE layer). Those
  checkpoints are reentrant: a stage the plan runs with I/W (split backward) is refused by name. The dense MLP
  (`mlp`) runs under the same non-reentrant checkpoint as `recompute` (Megatron-core 0.19.2's own `recompute_mlp`
  recurses in its backward), so it runs under I/W too.
- `offload`: the layer's forward runs under the executor's saved-tensor hooks (`offloaded`, `Offloader`), its
  copy-ins started as the stage's I or B begins (the `LayerMemory` the runner takes).

Applied once per chunk (`apply_plan_memory`, from the schedule's first step); the layers' state-dict keys do not
change (only instance attributes are replaced, through `hooks`), so checkpoints cross between plans with and
without memory choices. Megatron's uniform recompute and offload arguments beside a plan that sets choices are
refused (`uniform_memory_refusal`): the plan decides every layer.
"""

from __future__ import annotations

import contextlib
import weakref

from ...actions import Kind
from ...errors import OctoPipeError
from ...formats.memory import OFFLOAD, OFFLOAD_W, RECOMPUTE, SELECTIVE

# Megatron's uniform memory levers (TransformerConfig / args attribute, its command-line flag): "unset" values
# are None / False.
UNIFORM = (("recompute_granularity", "--recompute-granularity"), ("recompute_activations", "--recompute-activations"),
           ("recompute_method", "--recompute-method"), ("recompute_num_layers", "--recompute-num-layers"),
           ("cpu_offloading", "--cpu-offloading"),
           ("fine_grained_activation_offloading", "--fine-grained-activation-offloading"))

WHY = "the plan's per-layer memory choice (adapters/megatron/memory.py)"
# the uniform levers' flags as a launch writes them, and those taking values (--recompute-modules: one or more)
_FLAGS = tuple(flag.split(" ")[0] for _, flag in UNIFORM) + ("--recompute-modules",)
_VALUED = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules")


def split_uniform_memory(argv) -> tuple[list[str], list[str]]:
    """(the launch's words without Megatron's uniform recompute/offload arguments, those arguments' words)."""
    kept, uniform, i = [], [], 0
    argv = list(argv)
    while i < len(argv):
        word = argv[i]
        name = word.split("=", 1)[0]
        if name not in _FLAGS:
            kept.append(word)
            i += 1
            continue
        uniform.append(word)
        i += 1
        if name in _VALUED and "=" not in word:  # its values: the words up to the next option
            while i < len(argv) and not argv[i].startswith("--"):
                uniform.append(argv[i])
                i += 1
    return kept, uniform


def uniform_memory_refusal(settings, plan) -> str | None:
    """Why Megatron's uniform recompute/offload `settings` (args or TransformerConfig) cannot run beside `plan`."""
    if not getattr(plan, "memory", ()):
        return None
    given = [flag for name, flag in UNIFORM if getattr(settings, name, None) not in (None, False)]
    if not given:
        return None
    return (f"plan $.memory sets each layer's recompute/offload; drop {', '.join(given)} (and --recompute-modules): "
            f"the plan's choices replace them (or drop the plan's memory choices to keep Megatron's uniform ones)")


def _chunk_layers(chunk, st) -> list:
    """The module of each plan layer of stage `st` in its (wrapped) GPTModel / HybridModel chunk: the embedding,
    the decoder layers, None for MTP layers (not run per layer here), the LM head's output layer."""
    from megatron.core.utils import get_attr_wrapped_model

    inner = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)
    pre, post = bool(getattr(inner, "pre_process", False)), bool(getattr(inner, "post_process", False))
    layers = list(inner.decoder.layers)
    out = [getattr(inner, "embedding", None)] if pre else []
    out += layers
    out += [None] * (st.num_layers - len(out) - post)
    return out + ([getattr(inner, "output_layer", None)] if post else [])


def _rng_contexts():
    """torch checkpoint's (forward, recompute) contexts: Megatron's CUDA RNG tracker states as the forward began,
    set again for the recompute (dropout in tensor-parallel regions draws the same masks), restored after."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return contextlib.nullcontext(), _TrackerStates(tracker, tracker.get_states())


class _TrackerStates:
    """Megatron's RNG tracker set to `states` inside (re-enterable: I and W of a split backward may each recompute)."""

    def __init__(self, tracker, states):
        self.tracker, self.states, self.saved = tracker, states, []

    def __enter__(self):
        self.saved.append(self.tracker.get_states())
        # a copy: the tracker keeps the dict it is given and its forks write their advanced states into it
        self.tracker.set_states(dict(self.states))

    def __exit__(self, *exc):
        self.tracker.set_states(self.saved.pop())
        return False


def _selective_flags(layer, module: str, index: int) -> list[tuple[object, dict]]:
    """(module, {flag: True}) Megatron's constructors set for `module` under selective recompute, on this layer;
    refused in one line where the layer has nothing `module` recomputes or Megatron would not run it."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = layer.config

    def refuse(why: str, fix: str = "use recompute or offload for this layer") -> OctoPipeError:
        return OctoPipeError(f"plan $.memory.{index}: selective:{module} on layer {index} ({type(layer).__name__}): "
                             f"{why}; fix: {fix}")

    mlp = getattr(layer, "mlp", None)
    moe = isinstance(mlp, MoELayer)
    attn = getattr(layer, "self_attention", None)
    if module in ("layernorm", "moe_act") and (config.fp8 or config.fp4):
        raise refuse("under fp8/fp4 Megatron also switches its linears to save their original inputs, which the "
                     "plan's per-layer choice does not", "use --recompute-modules uniformly without per-layer choices")
    if module == "core_attn":
        if not hasattr(attn, "checkpoint_core_attention"):
            raise refuse("no self_attention with a core attention")
        return [(attn, {"checkpoint_core_attention": True})]
    if module == "mla_up_proj":
        if not hasattr(attn, "recompute_up_proj"):
            raise refuse("no multi-latent attention")
        return [(attn, {"recompute_up_proj": True})]
    if module in ("layernorm", "moe_act"):
        from megatron.core.tensor_parallel import random

        if not random.HAVE_TE:  # its CheckpointWithoutOutput reads Transformer Engine's fp8 state
            raise refuse("Megatron recomputes it through CheckpointWithoutOutput, which needs Transformer Engine",
                         "install Transformer Engine, or use core_attn/mlp, recompute or offload for this layer")
    if module == "layernorm":
        if config.cuda_graph_impl != "none":
            raise refuse("Megatron's norm recompute and CUDA graphs", "drop --cuda-graph-impl or use recompute")
        flags = {name: True for name, norm in (("recompute_input_layernorm", layer.input_layernorm),
                                               ("recompute_pre_mlp_layernorm", layer.pre_mlp_layernorm))
                 if not isinstance(norm, IdentityOp)}
        if not flags:
            raise refuse("its layer norms are fused into the linears (the layer spec's layernorm-linear)")
        return [(layer, flags)]
    if module == "mlp":
        if moe or mlp is None or isinstance(mlp, IdentityOp):
            raise refuse("no dense MLP" + (" (a MoE layer)" if moe else ""), "selective:moe or moe_act" if moe
                         else "use recompute or offload for this layer")
        return []  # not Megatron's flag: see apply_plan_memory
    if not moe:
        raise refuse("not a MoE layer")
    if module == "moe":
        if config.cuda_graph_impl == "local":
            raise refuse("Megatron recomputes the MoE layer itself under local CUDA graphs", "drop --cuda-graph-impl")
        return [(mlp, {"moe_layer_recompute": True})]
    if module == "shared_experts":
        if getattr(mlp, "shared_experts", None) is None:
            raise refuse("no shared experts")
        return [(mlp, {"shared_experts_recompute": True})]
    assert module == "moe_act"
    if not hasattr(mlp.experts, "activation_recompute"):
        raise refuse(f"its experts ({type(mlp.experts).__name__}) have no activation recompute (Megatron's "
                     f"TEGroupedMLP has)", "use --moe-grouped-gemm with Transformer Engine, or selective:moe")
    return [(mlp.experts, {"activation_recompute": True})]


# chunk -> the plan memory it was set up for and its LayerMemory: set up once per chunk (weak: dies with it)
_APPLIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def apply_plan_memory(plan, rank: int, model, config):
    """Set up the plan's memory choices on this rank's chunks (once); the LayerMemory the runner takes, or None."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from ...executor.memory_choices import LayerMemory, Offloader, checkpointed, offloaded
    from .hooks import replace_forward, set_flags

    memory = dict(getattr(plan, "memory", ()))
    if not memory:
        return None
    problem = uniform_memory_refusal(config, plan)
    if problem is not None:
        raise OctoPipeError(f"--pipeline-schedule octopipe: {problem}")
    done = _APPLIED.get(model[0])
    if done is not None:
        if done[0] != plan.memory:
            raise OctoPipeError("plan $.memory: these chunks already run another plan's memory choices; fix: build "
                                "the model again for a plan with other memory choices")
        return done[1]
    deferred = [str(i) for i, c in sorted(memory.items()) if c.kind == OFFLOAD_W]
    if deferred:
        raise OctoPipeError(f"plan $.memory: offload_w on layers {', '.join(deferred)} runs in OctoPipe's own "
                            f"executor only; fix: keep or offload those layers for Megatron")
    offloader = Offloader() if any(c.kind == OFFLOAD for c in memory.values()) else None
    split = {a.stage for a in plan.schedule[rank] if a.kind in (Kind.I, Kind.W)}
    split_layers = {sp.layer for sp in plan.splits}
    for v, s in enumerate(plan.stages_of(rank)):
        st = plan.stages[s]
        modules = _chunk_layers(model[v], st)
        for i in range(st.start, st.end):
            choice = memory.get(i)
            if choice is None:
                continue
            layer = modules[i - st.start]
            decoder = isinstance(layer, TransformerLayer)
            if layer is None or i in split_layers or (choice.kind == SELECTIVE and not decoder):
                what = ("a split layer (its shards run it)" if i in split_layers else "an MTP layer" if layer is None
                        else f"a {type(layer).__name__}, which has no sub-modules to recompute selectively")
                raise OctoPipeError(f"plan $.memory.{i}: layer {i} of stage {s} is {what}; Megatron's runner "
                                    f"applies this choice to its embedding, decoder layers and LM head only; fix: "
                                    f"drop the entry{' or use recompute or offload' if layer is not None else ''}")
            if choice.kind == RECOMPUTE:
                replace_forward(layer, lambda fwd: checkpointed(fwd, context_fn=_rng_contexts), WHY)
            elif choice.kind == OFFLOAD:
                replace_forward(layer, lambda fwd, layer=layer: offloaded(fwd, offloader, layer.parameters), WHY)
            else:
                flagged = [(o, f) for module in choice.modules for o, f in _selective_flags(layer, module, i)]
                if flagged and s in split:
                    raise OctoPipeError(f"plan $.memory.{i}: {choice.text} on layer {i}, whose stage {s} the plan runs "
                                        f"with I/W (a split backward, autograd.grad), and Megatron's selective "
                                        f"recompute is a reentrant checkpoint that only a whole backward can run; "
                                        f"fix: recompute, offload or selective:mlp for this layer, or B for stage {s}")
                for owner, flags in flagged:
                    set_flags(owner, flags, WHY)
                if "mlp" in choice.modules:
                    # Megatron-core 0.19.2's own recompute_mlp re-enters its checkpoint in its backward (recursion
                    # until the stack runs out, measured on CPU): the MLP's forward runs under the layer's checkpoint
                    replace_forward(layer.mlp, lambda fwd: checkpointed(fwd, context_fn=_rng_contexts), WHY)
    out = LayerMemory(offloader)
    _APPLIED[model[0]] = (plan.memory, out)
    return out
