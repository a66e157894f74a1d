"""Overlapped pairs (`3F12+5B7`) under DeepSpeed: MoE layers of the list run phase by phase.

A pair hides one half's all-to-alls behind the other half's compute (docs/formats.md, "Overlapped
pairs"). DeepSpeed's `deepspeed.moe.layer.MoE` runs its two all-to-alls inside `MOELayer.forward`
(deepspeed/moe/sharded_moe.py: `_AllToAll.apply`, synchronous), so the engine runs a list entry that
*is* a MoE (`LayerSpec(MoE, ...)`, its forward DeepSpeed's) as five phases of the executor's phased
runtime (executor/phased.py), with DeepSpeed's own modules and functions doing the math:

1. gate: `MOELayer.gate` (TopKGate, sparse routes, as MOELayer.forward calls it), then
   `_route_slots` and `_sparse_encode` -> the [experts, capacity, hidden] dispatch buffer;
2. dispatch all-to-all of that buffer over the layer's expert-parallel group (asynchronous; the
   reverse exchange of its gradient in the backward, as `_AllToAll.backward`);
3. experts: `MOELayer.experts` on the received tokens, reshaped as MOELayer.forward does;
4. combine all-to-all of the experts' output;
5. combine: `_sparse_decode` with the gate's weights, reshaped to the input's shape;
the entry hands on `(output, l_aux, exp_counts)` as `MoE.forward` returns them (and sets the layer's
`l_aux` / `exp_counts`). Every other list entry is one compute phase. With EP 1 the two exchanges
are not phases (MOELayer.forward makes the buffer contiguous instead). Each entry is seeded as
`PipelineModule.forward` seeds it under `seed_layers`.

When the plan has pairs, every training action (F, B, I, W, and the pairs) of the rank's stages runs
through `PhasedStages`; evaluation runs as without pairs. Nominal phase durations (the interleaving
order of `simulator.pairs.overlap_order`) are 1 ms each: the same on every rank of an expert group,
which runs the same stage of the same plan, so every rank issues its all-to-alls in the same order.

Refused on every rank in one line (the engine gathers the problems): a paired stage whose MoE is not
its own list entry (nested in another module: its all-to-alls run inside that module's forward), a
MoE with `use_residual`, Tutel or tensor-parallel experts, activation checkpointing
(`activation_checkpoint_interval`) or per-layer memory choices beside pairs, and split layers beside
pairs. Which entries are MoE is read from the LayerSpecs before anything is built (`moe_entries`),
for plan_check's refusal of pairs on stages without one.
"""

from __future__ import annotations

import torch

from ...executor.interface import LossOutput
from ...executor.phased import AllToAll, Compute, PhasedStages

MOE_NAME = "deepspeed.moe.layer.MoE"


def _moe_class():
    from deepspeed.moe.layer import MoE

    return MoE


def exposes_moe(entry) -> bool:
    """Whether a list entry (a LayerSpec, a built module) is a DeepSpeed MoE layer whose forward is DeepSpeed's own."""
    moe = _moe_class()
    typ = getattr(entry, "typename", None)
    if typ is None:
        typ = type(entry) if isinstance(entry, torch.nn.Module) else None
    return isinstance(typ, type) and issubclass(typ, moe) and typ.forward is moe.forward


def moe_entries(specs) -> frozenset[int]:
    """The indices of the list entries that are DeepSpeed MoE layers (read from the specs, nothing built)."""
    return frozenset(j for j, spec in enumerate(specs) if exposes_moe(spec))


def expert_groups(specs) -> list[tuple[int, bool]]:
    """(ep_size, enable_expert_tensor_parallelism) of the list's MoE entries (LayerSpecs or built), once each, in
    list order."""
    import inspect

    moe = _moe_class()
    out: list = []
    for spec in specs:
        typ = getattr(spec, "typename", None)
        if isinstance(typ, type) and issubclass(typ, moe):
            bound = inspect.signature(typ.__init__).bind_partial(None, *spec.module_args, **spec.module_kwargs)
            bound.apply_defaults()
            got = (int(bound.arguments.get("ep_size", 1)),
                   bool(bound.arguments.get("enable_expert_tensor_parallelism", False)))
        elif isinstance(spec, moe):
            got = (spec.ep_size, spec.enable_expert_tensor_parallelism)
        else:
            continue
        if got not in out:
            out.append(got)
    return out


def create_expert_groups(specs, use_data_before_expert_parallel_: bool = False) -> None:
    """DeepSpeed's expert groups of every MoE entry of the whole list, made on every rank in list order, as each
    MoE layer makes its own (deepspeed/moe/layer.py `_create_process_groups`). A rank whose stages hold no MoE layer
    would otherwise make none, and `new_group` (collective over the world) would then number every later group
    differently on the ranks: the next group spanning them waits forever."""
    from deepspeed.utils import groups

    for ep, tensor_parallel in expert_groups(specs):
        if f"ep_size_{ep}" in groups._get_expert_parallel_group_dict():
            continue
        if groups.mpu is None or not tensor_parallel:
            groups._create_expert_and_data_parallel(
                ep, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        else:
            groups._create_expert_data_and_model_parallel(
                ep, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_)


def _entry_params(f) -> tuple:
    module = f if isinstance(f, torch.nn.Module) else getattr(f, "args", (None,))[0]
    if not isinstance(module, torch.nn.Module):
        return ()
    return tuple(p for p in module.parameters() if p.requires_grad)


def stage_problem(module, stage: int) -> str | None:
    """Why stage `stage` of the OctoPipePipelineModule cannot run phase by phase (one line), or None."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    moe = _moe_class()
    start = module._stage_starts[stage]
    for k, f in enumerate(module._stage_funcs[stage]):
        entry = start + k
        if isinstance(f, moe) and exposes_moe(f):
            layer = f.deepspeed_moe
            if f.use_residual:
                return (f"list entry {entry}: {MOE_NAME}(use_residual=True) on a paired stage {stage}; the phased "
                        f"runtime runs DeepSpeed's MOELayer only; build it with use_residual=False, or re-plan without "
                        f"pairs on stage {stage}")
            if layer.use_tutel:
                return (f"list entry {entry}: {MOE_NAME}(use_tutel=True) on a paired stage {stage}; the phased runtime "
                        f"runs DeepSpeed's sparse dispatch only; build it with use_tutel=False, or re-plan without "
                        f"pairs on stage {stage}")
            if layer.ep_size > 1 and bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
                return (f"list entry {entry}: {MOE_NAME} under tensor parallelism on a paired stage {stage} (its "
                        f"drop/gather of duplicate tokens is not phased); re-plan without pairs on stage {stage}")
            continue
        inner = f if isinstance(f, torch.nn.Module) else getattr(f, "args", (None,))[0]
        if isinstance(inner, torch.nn.Module) and any(isinstance(m, moe) for m in inner.modules()):
            return (f"list entry {entry} ({type(inner).__name__}) holds a {MOE_NAME} inside its own forward on a "
                    f"paired stage {stage}, which runs its all-to-alls synchronously where a pair expects them as "
                    f"phases; give the MoE layer its own LayerSpec(MoE, ...) entry, or re-plan without pairs on "
                    f"stage {stage}")
    return None


def pairs_problem(module, plan) -> str | None:
    """Why this rank cannot run `plan`'s pairs (one line), or None: checked on the stages the rank builds."""
    if not plan.pairs:
        return None
    interval = getattr(module, "activation_checkpoint_interval", 0) or 0
    if interval > 0:
        return (f"plan $.pairs: a plan with overlapped pairs runs its layers phase by phase, without DeepSpeed's "
                f"activation checkpointing; drop PipelineModule(activation_checkpoint_interval={interval}), or drop "
                f"the plan's pairs")
    if getattr(plan, "memory", ()):
        return ("plan $.pairs: overlapped pairs and per-layer memory choices ($.memory) do not run together under "
                "DeepSpeed yet; re-plan with --recompute none --offload none, or without pairs")
    if plan.splits:
        return (f"plan $.pairs: overlapped pairs beside split layers {[sp.layer for sp in plan.splits]} do not run "
                f"under DeepSpeed; re-plan without splits or without pairs")
    paired = {a.stage for p in plan.pairs for a in p}
    for s in module.local_stages:
        if s in paired:
            problem = stage_problem(module, s)
            if problem is not None:
                return problem
    return None


def _seeder(module, entry: int, offset: int):
    """PipelineModule.forward's per-layer seed under seed_layers (deepspeed/runtime/pipe/module.py exec_func)."""
    if not module.seed_layers:
        return None
    from deepspeed.runtime import utils as ds_utils

    def seed():
        module.curr_layer = entry
        new_seed = module.base_seed * offset + entry
        (module.seed_fn or ds_utils.set_random_seed)(new_seed)

    return seed


def _plain_phase(f, entry: int, seed) -> Compute:
    def fn(*value):
        if seed is not None:
            seed()
        return f(value[0] if len(value) == 1 else tuple(value))

    return Compute(fn=fn, params=_entry_params(f), name=f"entry {entry}")


def moe_phases(moe, entry: int, seed=None) -> list:
    """The five phases of a DeepSpeed MoE entry (module docstring), made for one forward (they share its shapes)."""
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    layer = moe.deepspeed_moe
    shapes: dict = {}

    def gate(x):  # MOELayer.forward up to the first all-to-all
        if seed is not None:
            seed()
        d_model = x.shape[-1]
        reshaped = x.reshape(-1, d_model)
        l_aux, cap, experts, indices, locations, gates, exp_counts = layer.gate(reshaped, None, True, layer.use_tutel)
        cap = int(cap)
        shapes.update(shape=x.shape, tokens=reshaped.size(0), d_model=d_model, experts=experts, capacity=cap)
        slots = _route_slots(indices, locations, experts, cap)
        return l_aux, exp_counts, slots, gates, _sparse_encode(reshaped, slots, experts, cap)

    def experts(l_aux, exp_counts, slots, gates, dispatched):  # between the two all-to-alls
        d_model = shapes["d_model"]
        if layer.ep_size <= 1:
            dispatched = dispatched.contiguous()
        out = layer.experts(dispatched.reshape(layer.ep_size, layer.num_local_experts, -1, d_model))
        return l_aux, exp_counts, slots, gates, out.reshape(layer.ep_size * layer.num_local_experts, -1, d_model)

    def combine(l_aux, exp_counts, slots, gates, expert_output):  # after the second all-to-all
        if layer.ep_size <= 1:
            expert_output = expert_output.contiguous()
        e, c, d_model = shapes["experts"], shapes["capacity"], shapes["d_model"]
        out = _sparse_decode(expert_output.view(e * c, d_model), slots, gates, shapes["tokens"])
        layer.l_aux, layer.exp_counts = l_aux, exp_counts
        return out.reshape(shapes["shape"]), l_aux, exp_counts

    phases = [Compute(fn=gate, params=tuple(p for p in layer.gate.parameters() if p.requires_grad),
                      name=f"entry {entry} gate")]
    if layer.ep_size > 1:
        phases.append(AllToAll(group=layer.ep_group, name=f"entry {entry} dispatch"))
    phases.append(Compute(fn=experts, params=tuple(p for p in layer.experts.parameters() if p.requires_grad),
                          name=f"entry {entry} experts"))
    if layer.ep_size > 1:
        phases.append(AllToAll(group=layer.ep_group, name=f"entry {entry} combine"))
    phases.append(Compute(fn=combine, name=f"entry {entry} combine-out"))
    return phases


class StagePhases:
    """A PhasedModule over one stage of an OctoPipePipelineModule: its forward list entries as phases."""

    def __init__(self, module, stage: int):
        self.module, self.stage = module, stage

    def phases(self) -> list:
        """The stage's phases for one forward (PipelineModule.forward's micro-offset advanced as a forward does)."""
        module = self.module
        moe = _moe_class()
        module.micro_offset += 1
        offset = module.micro_offset + 1
        start = module._stage_starts[self.stage]
        out = []
        for k, f in enumerate(module._stage_funcs[self.stage]):
            entry = start + k
            seed = _seeder(module, entry, offset)
            if isinstance(f, moe) and exposes_moe(f):
                out += moe_phases(f, entry, seed)
            else:
                out.append(_plain_phase(f, entry, seed))
        return out

    def parameters(self):
        """The stage's trainable weights."""
        return iter(self.module.stage_parameters(self.stage))


class PairedStages(PhasedStages):
    """PhasedStages over a DeepSpeedStages runner's stages: its data (`first_input`), its loss bookkeeping
    (`_loss`: total_loss, return_logits), fp16's loss scale on the backward's root, and boundary metas learned per
    step (outputs marked as needing a gradient where the stage's graph gives them one)."""

    def __init__(self, runner):
        module = runner.module
        self.runner = runner
        super().__init__(modules={s: StagePhases(module, s) for s in module.local_stages},
                         num_stages=runner.num_stages, num_microbatches=runner.num_microbatches, metas=(),
                         load_input=runner.first_input, loss_fn=self._loss)

    def _loss(self, out, mb: int):
        loss = self.runner._loss(out[0] if len(out) == 1 else tuple(out), mb)
        return self.runner.grad_scale(loss) if self.runner.grad_scale is not None else loss

    def marked(self, stage: int, mb: int, out):
        """A stage's output as the executor learns its boundary meta: float tensors the graph made need a gradient."""
        if stage == self.num_stages - 1 or isinstance(out, LossOutput):
            return out
        fwd = self.state.get((stage, mb))
        last = next((s for s in reversed(fwd.saved) if s is not None), None) if fwd is not None else None
        values = out if isinstance(out, tuple) else (out,)
        grads = [t.requires_grad for t in last.outputs] if last is not None else [True] * len(values)
        for t, g in zip(values, grads):
            if isinstance(t, torch.Tensor) and g and t.is_floating_point():
                t.requires_grad_(True)
        return out

    def forward(self, stage, mb, inputs, *, batch=None, forward_only: bool = False):
        """F through the phases; its output marked for the boundary meta."""
        return self.marked(stage, mb, super().forward(stage, mb, inputs, batch=batch, forward_only=forward_only))

    def pair(self, first, first_input, second, second_input, *, batch=None, last_backward: bool = False):
        """The pair through PhasedStages (its halves interleaved), the F's output marked."""
        out_f, dx = super().pair(first, first_input, second, second_input, batch=batch)
        return self.marked(first.stage, first.microbatch, out_f), dx

