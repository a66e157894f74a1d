"""Multi-process checks of what frameworks rely on (shared by tests and scripts/gpu_check.sh).

- several tensors per boundary (hidden + integer mask; a branched model's live outputs),
  declared or learned by handshake, two steps with different sequence lengths;
- loss and every owned gradient against a single-process reference;
- gradient accumulations counted by hooks on the grad accumulator (Megatron DDP's way) and
  by post-accumulate-grad hooks (DeepSpeed's): exactly once per parameter and micro-batch;
- `on_last_backward` once per stage and step, after the stage's gradients are final;
- per-micro-batch loss outputs, logging dicts and token counts;
- forward_only: the training step's losses, no gradient touched, nothing kept;
- no process group made after the first executor of a plan.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from ..formats import plan_from_dict
from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.launch import init_gloo
from ..executor.torch_stage import TorchStages
from .toy_branched import GraphSpec, GraphToy, MaskedSpec, MaskedToy, to_device


class NewGroupCounter:
    """Counts `dist.new_group` calls while installed (the communicators a process opens).

    Installed only as a `with` block inside a spawned test worker: importing this module patches
    nothing, and the original `dist.new_group` is back when the block ends, also on an error.
    """

    def __init__(self):
        self.calls = 0
        self._orig = None

    def __enter__(self):
        if getattr(dist.new_group, "_octopipe_counting", False):  # nested: the outer counter would miss calls
            raise RuntimeError("NewGroupCounter is already installed in this process")
        self._orig = dist.new_group

        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        counting._octopipe_counting = True
        dist.new_group = counting
        return self

    def __exit__(self, *exc):
        dist.new_group = self._orig


class AccumulationCounter:
    """Per parameter: AccumulateGrad hook calls and post-accumulate-grad hook calls."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.acc = Counter()
        self.post = Counter()
        self.handles = []
        self.keep = []  # the grad accumulators must outlive the hooks (as Megatron DDP keeps them)
        for name, p in params.items():
            grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
            self.keep.append(grad_acc)
            self.handles.append(grad_acc.register_hook(lambda *_, n=name: self.acc.update([n])))
            self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: self.post.update([n])))

    def reset(self) -> None:
        """Start counting a new step."""
        self.acc.clear()
        self.post.clear()


def _model(case: dict):
    if case["model"] == "masked":
        return MaskedToy(MaskedSpec())
    from ..costs import resolve_model

    return GraphToy(resolve_model("vlm"), GraphSpec())


def _runner(case: dict, toy, layers, plan, rank: int) -> TorchStages:
    ns, m = plan.num_stages, plan.num_microbatches
    bounds = [(st.start, st.end) for st in plan.stages]
    mine = plan.stages_of(rank)
    if isinstance(toy, MaskedToy):
        modules = {s: torch.nn.Sequential(*layers[bounds[s][0]:bounds[s][1]]) for s in mine}
        return TorchStages(modules=modules, num_stages=ns, num_microbatches=m, call=toy.call, loss_fn=toy.loss_fn,
                           scale_loss=toy.scale_loss(m), grad_sink=case["sink"])
    return TorchStages(modules=toy.stage_modules(layers, bounds, mine), num_stages=ns, num_microbatches=m,
                       call=toy.stage_call(bounds), loss_fn=toy.loss_fn, grad_sink=case["sink"])


def _metas(case: dict, toy, plan, seq: int):
    if not case["declared"]:
        return None
    if isinstance(toy, MaskedToy):
        return toy.metas(plan.num_stages, seq)
    return toy.metas([(st.start, st.end) for st in plan.stages], seq)


def check_case(rank: int, case: dict, timeout_s: float = 30.0, device: str = "cpu") -> list[str]:
    """Run one case (two training steps of different sequence lengths, each preceded by a forward_only
    step) on this rank and assert everything the module docstring lists; returns printable lines."""
    plan = plan_from_dict(case["plan"])
    label = f"rank {rank}, {case['label']}"
    toy = _model(case)
    layers, ref = toy.build().to(device), toy.build().to(device)
    runner = _runner(case, toy, layers, plan, rank)
    mine = plan.stages_of(rank)
    owned = {f"{s}.{n}": p for s in mine for n, p in runner.modules[s].named_parameters()}
    counter = AccumulationCounter(owned) if case["sink"] == "autograd" else None
    done: list[int] = []
    at_callback: dict[int, list] = {}

    def last_backward(stage: int) -> None:
        done.append(stage)
        # what a framework would start reducing now: it must already be the step's final gradient
        at_callback[stage] = [None if p.grad is None else p.grad.clone() for p in runner.modules[stage].parameters()]

    opts = ExecutorOptions(timeout_s=timeout_s, tags=case.get("tags", True))
    with NewGroupCounter() as groups:
        executor = PipelineExecutor(plan, runner, options=opts, on_last_backward=last_backward, device=device)
        made = groups.calls
        lines = []
        m, last = plan.num_microbatches, plan.num_stages - 1
        for seq in case["seqs"]:
            runner.metas = _metas(case, toy, plan, seq)
            for p in layers.parameters():
                p.grad = None
            ref.zero_grad(set_to_none=True)
            ref_loss = toy.reference(ref, m, seq, device)
            evaluation = executor.run_step(data=to_device(toy.data(m, seq), device), forward_only=True)
            assert all(p.grad is None for p in layers.parameters()), f"{label}: forward_only touched a gradient"
            assert runner.pending() == 0, f"{label}: forward_only kept state"
            if counter is not None:
                counter.reset()
            done.clear()
            t0 = time.perf_counter()
            result = executor.run_step(data=to_device(toy.data(m, seq), device))
            step_ms = (time.perf_counter() - t0) * 1000
            _check_outputs(label, seq, last in mine, result, evaluation, ref_loss, m)
            _check_grads(label, seq, plan, layers, ref, mine)
            assert sorted(done) == sorted(mine), f"{label}: last-backward calls {done}, stages {mine}"
            for s in mine:
                for g, p in zip(at_callback[s], runner.modules[s].parameters()):
                    assert g is not None and torch.equal(g, p.grad), \
                        f"{label}: stage {s}'s gradients changed after on_last_backward"
            if counter is not None:
                for name in owned:
                    assert counter.acc[name] == m and counter.post[name] == m, \
                        f"{label} seq {seq}: {name} accumulated {counter.acc[name]}/{counter.post[name]} times, " \
                        f"expected {m} (once per micro-batch)"
            assert runner.pending() == 0, f"{label}: state of {runner.pending()} (stage, mb) pairs not freed"
            lines.append(f"{label} seq {seq}: step {step_ms:.1f} ms, gradients match")
        assert groups.calls == made, f"{label}: {groups.calls - made} process groups made after the first step"
    return lines


def _check_outputs(label, seq, has_last, result, evaluation, ref_loss, m) -> None:
    if not has_last:
        assert result.loss is None and evaluation.loss is None, f"{label}: a rank without the last stage has a loss"
        return
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=1e-14, msg=f"{label} seq {seq}: loss")
    for mb in range(m):
        torch.testing.assert_close(evaluation.losses[mb], result.losses[mb], rtol=1e-12, atol=1e-14,
                                   msg=f"{label} seq {seq}: forward_only loss of micro-batch {mb}")
    assert len(result.logs) == m and all(isinstance(d, dict) for d in result.logs), f"{label}: logs {result.logs}"
    counts = [o.num_tokens for o in result.outputs.values()]
    if counts[0] is not None:
        assert int(result.num_tokens) == sum(int(c) for c in counts), f"{label}: num_tokens"
        assert all(int(d["tokens"]) == int(c) for d, c in zip(result.logs, counts)), f"{label}: per-mb tokens"


def _check_grads(label, seq, plan, layers, ref, mine) -> None:
    for s in mine:
        st = plan.stages[s]
        for idx in range(st.start, st.end):
            for (name, p), q in zip(layers[idx].named_parameters(), ref[idx].parameters()):
                assert p.grad is not None, f"{label} seq {seq}: layer {idx} {name} has no gradient"
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                           msg=f"{label} seq {seq}: layer {idx} {name}")


def check_cases_worker(rank: int, world: int, port: int, cases: list[dict]) -> None:
    """Spawn target: join a gloo group of `world` ranks and check every case in turn."""
    init_gloo(rank, world, port, timeout_s=60)
    for case in cases:
        check_case(rank, case)
    dist.destroy_process_group()


def _toy_step_matches(executor, runner, layers, spec, plan, rank: int, label: str) -> None:
    """One training step of the toy model equals the single-process reference on this rank's layers."""
    from .toy import build_layers, reference_step

    for p in layers.parameters():
        p.grad = None
    result = executor.run_step()
    ref = build_layers(spec)
    ref_loss = reference_step(spec, ref, plan.num_microbatches)
    if plan.num_stages - 1 in plan.stages_of(rank):
        torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=1e-14, msg=f"{label}: loss")
    for s in plan.stages_of(rank):
        st = plan.stages[s]
        for idx in range(st.start, st.end):
            for (name, p), q in zip(layers[idx].named_parameters(), ref[idx].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=f"{label}: layer {idx} {name}")


def check_pair_groups_worker(rank: int, world: int, port: int, plan_doc: dict, spec) -> None:
    """Spawn target: the world splits into pipeline groups of `plan.num_devices` ranks (as with TP x DP > 1);
    every group runs the plan with one communicator per direction. The first executor makes the pairs of
    every group; a second executor and later steps make none, and gradients match the reference."""
    from .checks import toy_runner
    from .toy import build_layers

    init_gloo(rank, world, port, timeout_s=60)
    plan = plan_from_dict(plan_doc)
    p = plan.num_devices
    pipelines = [dist.new_group(ranks=list(range(g, g + p))) for g in range(0, world, p)]  # collective: every rank
    mine = pipelines[rank // p]
    me = dist.get_rank(mine)
    opts = ExecutorOptions(timeout_s=30, pair_groups=True)
    label = f"rank {rank} (pipeline rank {me})"
    with NewGroupCounter() as groups:
        layers = build_layers(spec)
        first = PipelineExecutor(plan, toy_runner(spec, layers, plan, me), group=mine, options=opts)
        pairs = {(src, dst) for src in range(p) for dst in range(p) if src != dst and abs(src - dst) == 1}
        made = groups.calls
        assert made == len(pairs) * (world // p), f"{label}: {made} process groups for {world // p} pipelines"
        assert set(first.pair_groups) == pairs
        _toy_step_matches(first, first.runner, layers, spec, plan, me, f"{label}, first executor, step 1")
        _toy_step_matches(first, first.runner, layers, spec, plan, me, f"{label}, first executor, step 2")
        layers2 = build_layers(spec)
        second = PipelineExecutor(plan, toy_runner(spec, layers2, plan, me), group=mine, options=opts)
        assert second.pair_groups == first.pair_groups
        _toy_step_matches(second, second.runner, layers2, spec, plan, me, f"{label}, second executor")
        assert groups.calls == made, f"{label}: {groups.calls - made} process groups made after the first executor"
    dist.destroy_process_group()
