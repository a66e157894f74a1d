"""A PipelineModule with DeepSpeed MoE layers (`deepspeed.moe.layer.MoE`, EP 2), for the pair tests.

The list: Linear/tanh blocks, four `LayerSpec(MoE, ...)` entries (4 experts, 2 per rank, top-1, no random
token selection, capacity 2 per expert so tokens are dropped), each followed by a function picking the
output from MoE's (output, l_aux, exp_counts) (one adds l_aux to it, so its gradient reaches a gate),
and a Linear head to NCLS classes; float inputs [MBS, SEQ, HID], cross-entropy. DeepSpeed's Experts
deep-copies one expert module, so every expert starts equal: `perturb_experts` gives each expert (by its global id) its own weights, the same in every run, so a
token sent to the wrong expert shows. Scenarios record losses and every gradient handed to the optimizer
(expert parameters keyed by their expert-parallel rank too: the local expert 0 of two EP ranks is two
experts).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import ds_harness as H

HID, MBS, SEQ, NCLS = 8, 2, 4, 5
NUM_EXPERTS, EP = 4, 2
BASE_SEED = 4321
# entries: 0 Block, 1 MoE, 2 pick, 3 MoE, 4 pick_aux, 5 Block, 6 MoE, 7 pick, 8 MoE, 9 pick, 10 head
MOE_ENTRIES = (1, 3, 6, 8)
NUM_ENTRIES = 11
V_DEVICES, V_BOUNDS = [0, 1, 1, 0], [(0, 3), (3, 5), (5, 8), (8, 11)]  # every stage holds a MoE entry
STOCK_PARTS = [0, 5, 11]


def expert():
    """One expert: Linear-tanh-Linear (DeepSpeed copies it for every local expert)."""
    return nn.Sequential(nn.Linear(HID, 16), nn.Tanh(), nn.Linear(16, HID))


def pick(moe_output):
    """The hidden states of MoE's (output, l_aux, exp_counts)."""
    return moe_output[0]


def pick_aux(moe_output):
    """The hidden states plus the gate's auxiliary loss (l_aux: its gradient reaches the gate through it too)."""
    return moe_output[0] + 0.1 * moe_output[1]


def layer_specs():
    """The DeepSpeed layer list (module docstring)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import LayerSpec

    def moe():
        return LayerSpec(MoE, HID, expert(), num_experts=NUM_EXPERTS, ep_size=EP, k=1, capacity_factor=1.0,
                         min_capacity=2, use_rts=False)

    return [LayerSpec(H.Block, HID), moe(), pick, moe(), pick_aux, LayerSpec(H.Block, HID), moe(), pick, moe(), pick,
            LayerSpec(nn.Linear, HID, NCLS)]


def loss_fn(logits, labels):
    """Mean token cross-entropy."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, NCLS), labels.reshape(-1))


def batches(step: int, replica: int, m: int):
    """Micro-batches (hidden inputs, labels) of one step for one data-parallel replica."""
    gen = torch.Generator().manual_seed(777 * step + replica)
    return [(torch.randn(MBS, SEQ, HID, generator=gen), torch.randint(0, NCLS, (MBS, SEQ), generator=gen))
            for _ in range(m)]


def perturb_experts(module) -> None:
    """Each expert's weights drawn from its (list entry, global expert id): equal in every run and partition."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    for name, sub in module.named_modules():
        if not isinstance(sub, MoE):
            continue
        entry = int(name.split(".")[0])
        layer = sub.deepspeed_moe
        ep_rank = dist.get_rank(group=layer.ep_group)
        for i, ex in enumerate(layer.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(1000 * entry + ep_rank * layer.num_local_experts + i)
            with torch.no_grad():
                for p in ex.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _clear_expert_groups() -> None:
    """DeepSpeed keeps its expert groups in module globals by name: a later scenario makes its own."""
    from deepspeed.utils import groups

    for d in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP,
              groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        d.clear()


ONE_RANK_BOUNDS = [(0, 9), (9, 11)]  # every MoE entry on device 0; device 1 holds the last pick and the head


def plan_doc(*, split: bool, m: int, pairs_limit: int | None = None, one_rank: bool = False) -> dict:
    """DualPipeV's order of the V stages on 2 devices (every B as I then W when `split`), with the overlapped pairs
    the executor can run (testing.pair_plans.greedy_pairs: F+B, or F+I under `split`). `one_rank`: 1F1B on
    ONE_RANK_BOUNDS instead, its pairs on device 0 (device 1 holds no MoE layer)."""
    from dataclasses import replace

    from octopipe_plugin.actions import Action, Kind
    from octopipe_plugin.formats import plan_to_dict
    from octopipe_plugin.schedules import generators
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.testing.pair_plans import greedy_pairs
    from octopipe_plugin.testing.plans import make_plan

    if one_rank:
        from octopipe_plugin.formats import Layer, Model

        cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
        model = Model(name="moe", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(NUM_ENTRIES)))
        base = build_plan(model, "1f1b", 2, m)
        plan = make_plan(stage_devices=[0, 1], bounds=ONE_RANK_BOUNDS, num_devices=2, num_microbatches=m,
                         schedule=base.schedule)
        return plan_to_dict(greedy_pairs(plan, limit=pairs_limit))
    sched = generators.dualpipev(V_DEVICES, 2, m)
    plan = make_plan(stage_devices=V_DEVICES, bounds=V_BOUNDS, num_devices=2, num_microbatches=m,
                     schedule=tuple(tuple(r) for r in sched))
    if split:
        def parts(a):
            if a.kind is Kind.B:
                return (Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch))
            return (a,)
        plan = replace(plan, schedule=tuple(tuple(x for a in row for x in parts(a)) for row in plan.schedule))
    return plan_to_dict(greedy_pairs(plan, limit=pairs_limit))


def run_scenario(sc: dict, rank: int, out_dir: str) -> None:
    """One MoE scenario: DeepSpeed's engine at STOCK_PARTS (`parts`) or OctoPipeEngine at the config's plan."""
    import deepspeed
    import torch.distributed as dist

    import octopipe_plugin.deepspeed  # noqa: F401  (installs the engine choice)
    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule
    from octopipe_plugin.adapters.deepspeed.checkpoint import parameter_names

    _clear_expert_groups()
    cfg = sc["config"]
    kwargs = dict(loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED)
    if sc.get("parts") is not None:
        module = OctoPipePipelineModule(layer_specs(), parts=sc["parts"], **kwargs)
    else:
        module = OctoPipePipelineModule(layer_specs(), config=cfg, **kwargs)
    try:
        engine, _, _, _ = deepspeed.initialize(model=module, config=cfg,
                                               model_parameters=[p for p in module.parameters() if p.requires_grad])
        if sc.get("refused_load") is not None:  # a checkpoint of another placement: refused before anything loads
            from octopipe_plugin.errors import OctoPipeError

            try:
                engine.load_checkpoint(sc["refused_load"]["dir"], tag=sc["refused_load"]["tag"])
                report_error = None
            except OctoPipeError as exc:
                report_error = str(exc)
        if sc.get("load") is not None:  # resumed: the checkpoint's experts, not drawn again
            engine.load_checkpoint(sc["load"]["dir"], tag=sc["load"]["tag"])
        else:
            perturb_experts(engine.module)
        if sc.get("grad_scale") is not None:  # a deliberate scale error: the comparison must see it
            for q in engine.module.parameters():
                q.register_hook(lambda g, k=sc["grad_scale"]: g * k)
        dp_rank = engine.grid.data_parallel_id
        m = engine.micro_batches
        report = {"engine": type(engine).__name__, "losses": [], "grads": [], "dp": dp_rank,
                  "load_error": report_error if sc.get("refused_load") is not None else None}
        names, optimizer_step = parameter_names(engine.module), engine.optimizer.step
        ep_rank = {}
        for sub in engine.module.modules():
            if hasattr(sub, "deepspeed_moe"):
                r = dist.get_rank(group=sub.deepspeed_moe.ep_group)
                ep_rank.update({id(p): r for p in sub.deepspeed_moe.experts.parameters()})

        def recording_step(*args, **kw):
            report["grads"].append({names[id(p)] + (f"@ep{ep_rank[id(p)]}" if id(p) in ep_rank else ""):
                                    p.grad.detach().float().clone()
                                    for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None})
            return optimizer_step(*args, **kw)

        engine.optimizer.step = recording_step
        runner = getattr(engine, "_runner", None)
        phased = getattr(runner, "phased", None)
        if phased is not None:
            phased.trace = []  # which exchanges another action's compute ran during (phased.hidden_exchanges)
        report["eval"] = []
        first = sc.get("first_step", 0)
        for step in range(first, first + sc.get("steps", H.STEPS)):
            if sc.get("eval"):  # the forward-only step (each MoE entry whole, MoE.forward) on the step's data
                report["eval"].append(float(engine.eval_batch(H.CountingIter(batches(step, dp_rank, m)))))
            report["losses"].append(float(engine.train_batch(data_iter=H.CountingIter(batches(step, dp_rank, m)))))
        if sc.get("save") is not None:
            engine.save_checkpoint(sc["save"]["dir"], tag=sc["save"]["tag"])
        report["pairs_run"] = None if phased is None else phased.pairs_run
        report["hidden"] = None
        if phased is not None and phased.trace is not None:
            from octopipe_plugin.executor.phased import hidden_exchanges

            report["hidden"] = hidden_exchanges(phased.trace)
        if sc.get("world_group"):  # every rank numbered its groups alike (expert groups made on every rank)
            from datetime import timedelta

            g = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=60))
            one = torch.ones(1)
            dist.all_reduce(one, group=g)
            report["world_group"] = float(one)
        torch.save(report, os.path.join(out_dir, f"{sc['name']}-rank{rank}.pt"))
    finally:
        _clear_expert_groups()


def run_any(sc: dict, rank: int, out_dir: str) -> None:
    """The spawn's scenario runner: this harness's for MoE scenarios, ds_harness's for the others."""
    (run_scenario if sc.get("moe") else H.run_scenario)(sc, rank, out_dir)


def all_grads(reports, step: int) -> dict:
    """Name -> gradient before optimizer step `step`, checking every copy (data-parallel) is identical."""
    merged = {}
    for rep in reports:
        for name, g in rep["grads"][step].items():
            if name in merged:
                assert torch.equal(merged[name], g), f"copies of the gradient of {name} differ"
            else:
                merged[name] = g
    return merged
