"""A plan's per-layer memory choices on an OctoPipePipelineModule (docs/formats.md "Memory choices").

In place of PipelineModule's one `activation_checkpoint_interval` (a checkpoint every N list entries, on every
stage), each entry of a layer the plan names runs its own choice, through the executor's wrappers:
`recompute` under a non-reentrant torch checkpoint (the plan's I may run through it), `selective:<modules>` with
the named sub-modules checkpointed (executor `SUBMODULES` names; refused by name where the layer has none),
`offload` under the executor's saved-tensor hooks (copy-ins started as the stage's I or B begins).

Only the stage's forward list is wrapped (the layers stay registered as they were), so state dicts and
checkpoints are those of the plan without memory choices. A user's own interval beside a plan that sets choices
is refused (`interval_refusal`): the plan decides every layer.
"""

from __future__ import annotations

from ...errors import OctoPipeError
from ...formats.memory import OFFLOAD, OFFLOAD_W, RECOMPUTE, SELECTIVE


def interval_refusal(module, plan) -> str | None:
    """Why `module`'s own activation_checkpoint_interval cannot run beside `plan`'s memory choices (or None)."""
    interval = getattr(module, "activation_checkpoint_interval", 0) or 0
    if not getattr(plan, "memory", ()) or interval <= 0:
        return None
    return (f"plan $.memory sets each layer's activation checkpointing and offload; drop PipelineModule("
            f"activation_checkpoint_interval={interval}) (the plan's choices replace it), or drop the plan's memory "
            f"choices to keep DeepSpeed's interval")


def apply_plan_memory(module, plan):
    """Wrap the forward-list entries of this rank's stages that the plan's memory choices name (once); the
    LayerMemory the runner takes, or None without choices."""
    from ...executor.memory_choices import LayerMemory, Offloader, checkpoint_submodules, checkpointed, offloaded

    memory = dict(getattr(plan, "memory", ()))
    if not memory:
        return None
    problem = interval_refusal(module, plan)
    if problem is not None:
        raise OctoPipeError(problem)
    done = getattr(module, "_octopipe_memory", None)
    if done is not None:
        return done
    deferred = [str(i) for i, c in sorted(memory.items()) if c.kind == OFFLOAD_W]
    if deferred:
        raise OctoPipeError(f"plan $.memory: offload_w on layers {', '.join(deferred)} runs in OctoPipe's own "
                            f"executor only; fix: keep or offload those layers for DeepSpeed")
    offloader = Offloader() if any(c.kind == OFFLOAD for c in memory.values()) else None
    owners = module._octopipe_owners
    for s in module.local_stages:
        funcs = module._stage_funcs[s]
        for k, f in enumerate(funcs):
            spec = module._stage_starts[s] + k  # stage 0 of a split embedding starts at entry 1
            layer = owners[spec] if owners is not None else spec
            choice = memory.get(layer)
            if choice is None:
                continue
            call = f.__call__ if hasattr(f, "parameters") else f
            if choice.kind == RECOMPUTE:
                funcs[k] = checkpointed(call)
            elif choice.kind == OFFLOAD:
                funcs[k] = offloaded(call, offloader, getattr(f, "parameters", tuple))
            else:
                assert choice.kind == SELECTIVE
                if not hasattr(f, "named_modules"):
                    raise OctoPipeError(f"plan $.memory.{layer}: {choice.text} on list entry {spec}, a function "
                                        f"without sub-modules; fix: use recompute or offload for layer {layer}")
                checkpoint_submodules(f, layer, choice.modules)
    module._octopipe_memory = LayerMemory(offloader)
    return module._octopipe_memory
