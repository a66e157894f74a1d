"""A toy MoE model whose stages are phased (executor/phased.py): the real all-to-alls an overlapped pair hides.

Each layer is, per token, DeepSeek's MoE layer without the router: an attention-like residual
linear, a dispatch all-to-all over the expert-parallel (EP) group, this EP rank's expert (a
linear and tanh), a combine all-to-all back, and the residual sum. The "router" is a fixed split:
the tokens of every micro-batch are cut into EP equal chunks in order, chunk j goes to EP rank
j's expert. Everything is float64, so runs can be compared at rtol 1e-10.

Layout of the tests (tests/executor/test_pairs.py): R pipeline replicas of P devices each, rank
= replica * P + device; the ranks of one device across the replicas form that device's EP group
(group rank = replica). Every replica has its own micro-batches (`microbatch(spec, replica, mb)`)
and the same attention weights; replica r holds expert r of every layer. `reference_step` runs
all replicas' experts in one process: each replica's loss, and the gradients every rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.interface import TensorMeta
from ..executor.launch import init_gloo
from ..executor.phased import AllToAll, Compute, PhasedStages, hidden_exchanges
from ..formats import plan_from_dict


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Shape of the toy MoE model and its data; `*_ms` the phases' nominal durations (the pair order's)."""

    hidden: int = 4
    tokens: int = 8  # per micro-batch and replica, a multiple of the EP group's size
    layers: int = 4
    seed: int = 0
    compute_ms: float = 1.0
    comm_ms: float = 1.0


class MoELayer(nn.Module):
    """One layer: `attn` (shared by the replicas) and this EP rank's `expert`."""

    def __init__(self, spec: MoESpec, layer: int, expert: int):
        super().__init__()
        h = spec.hidden
        torch.manual_seed(spec.seed * 1009 + layer)
        self.attn = nn.Linear(h, h).to(torch.float64)
        torch.manual_seed(spec.seed * 1009 + layer + 7919 * (expert + 1))
        self.expert = nn.Linear(h, h).to(torch.float64)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """x + tanh(attn(x)): the attention-like part."""
        return x + torch.tanh(self.attn(x))

    def experts(self, d: torch.Tensor) -> torch.Tensor:
        """This EP rank's expert on the tokens dispatched to it."""
        return torch.tanh(self.expert(d))


def build_layers(spec: MoESpec, expert: int) -> nn.ModuleList:
    """Every layer with expert `expert` (identically seeded in every process)."""
    return nn.ModuleList([MoELayer(spec, i, expert) for i in range(spec.layers)])


class MoEStage(nn.Module):
    """A stage of layers as phases: per layer attention, dispatch, experts, combine; then the residual sum."""

    def __init__(self, layers, group, spec: MoESpec):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.group = group
        self.spec = spec

    def phases(self):
        """[attention, dispatch, experts, combine] per layer, and the last residual sum (executor/phased.py)."""
        c, m = self.spec.compute_ms, self.spec.comm_ms
        out = []
        for layer in self.layers:
            def attention(*v, layer=layer):
                x = v[0] if len(v) == 1 else v[0] + v[1]  # the previous layer's residual sum
                h = layer.attention(x)
                return h, h  # the residual, and the tokens to dispatch

            def experts(h, d, layer=layer):
                return h, layer.experts(d)

            out += [Compute(fn=attention, params=tuple(layer.attn.parameters()), ms=c, name="attention"),
                    AllToAll(group=self.group, ms=m, name="dispatch"),
                    Compute(fn=experts, params=tuple(layer.expert.parameters()), ms=c, name="experts"),
                    AllToAll(group=self.group, ms=m, name="combine")]
        out.append(Compute(fn=lambda h, e: h + e, ms=0.0, name="residual"))
        return out


def microbatch(spec: MoESpec, replica: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of replica `replica`'s micro-batch `mb`: [tokens, hidden], float64."""
    g = torch.Generator().manual_seed(spec.seed * 104729 + replica * 1013 + mb)
    shape = (spec.tokens, spec.hidden)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def moe_runner(spec: MoESpec, layers, plan, device: int, replica: int, group, trace: list | None = None
               ) -> PhasedStages:
    """PhasedStages of `device`'s stages of `plan` over `layers`, the EP all-to-alls over `group`."""
    ns = plan.num_stages
    mods = {s: MoEStage([layers[i] for i in range(plan.stages[s].start, plan.stages[s].end)], group, spec)
            for s in plan.stages_of(device)}
    act = TensorMeta(shape=(spec.tokens, spec.hidden), dtype=torch.float64)
    return PhasedStages(modules=mods, num_stages=ns, num_microbatches=plan.num_microbatches, metas=(act,) * ns,
                        load_input=lambda mb: microbatch(spec, replica, mb)[0],
                        loss_fn=lambda out, mb: torch.nn.functional.mse_loss(out[0], microbatch(spec, replica, mb)[1]),
                        trace=trace)


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(t.chunk(n, dim=0))


def reference_step(spec: MoESpec, replicas: int, num_microbatches: int):
    """One process, every replica and expert: (loss per replica, layers per replica with their gradients)."""
    stacks = [build_layers(spec, r) for r in range(replicas)]
    losses = [torch.zeros((), dtype=torch.float64) for _ in range(replicas)]
    for mb in range(num_microbatches):
        xs = [microbatch(spec, r, mb)[0] for r in range(replicas)]
        for i in range(spec.layers):
            hs = [stacks[r][i].attention(xs[r]) for r in range(replicas)]
            parts = [_chunks(h, replicas) for h in hs]  # parts[j][r]: replica j's tokens for expert r
            es = [stacks[r][i].experts(torch.cat([parts[j][r] for j in range(replicas)])) for r in range(replicas)]
            back = [_chunks(e, replicas) for e in es]  # back[r][j]: expert r's output for replica j's tokens
            xs = [hs[j] + torch.cat([back[r][j] for r in range(replicas)]) for j in range(replicas)]
        total = 0.0
        for r in range(replicas):
            loss = torch.nn.functional.mse_loss(xs[r], microbatch(spec, r, mb)[1]) / num_microbatches
            losses[r] = losses[r] + loss.detach()
            total = total + loss
        total.backward()
    return losses, stacks


def owned_grads(plan, layers, device: int) -> dict[str, torch.Tensor]:
    """Name -> gradient of every parameter of the layers `device`'s stages hold."""
    out = {}
    for s in plan.stages_of(device):
        for i in range(plan.stages[s].start, plan.stages[s].end):
            for name, p in layers[i].named_parameters():
                if p.grad is None:
                    raise AssertionError(f"layer {i} {name} has no gradient")
                out[f"layer{i}.{name}"] = p.grad.detach().clone()
    return out


def _check_pairs_ran(plan, device: int, result, runner, trace: list, label: str) -> None:
    """The rank's pairs went through `pair`, both halves in the timeline over one span, some exchange hidden."""
    mine = [(a, b) for a, b in plan.pairs if plan.stages[a.stage].device == device]
    if runner.pairs_run != len(mine):
        raise AssertionError(f"{label}: ran {runner.pairs_run} pairs through pair(), the plan has {len(mine)}")
    spans = {a: (t0, t1) for a, t0, t1 in result.timeline}
    if len(spans) != len(plan.schedule[device]):
        raise AssertionError(f"{label}: the timeline has {len(spans)} actions, the list {len(plan.schedule[device])}")
    for a, b in mine:
        if spans[a] != spans[b]:
            raise AssertionError(f"{label}: pair {a}+{b}: the halves' spans differ ({spans[a]}, {spans[b]})")
    if mine and hidden_exchanges(trace) == 0:
        raise AssertionError(f"{label}: no all-to-all was in flight while the other half of a pair computed")


def check_moe_worker(rank: int, world: int, port: int, docs: list[dict], spec: MoESpec) -> None:
    """Spawn target: every plan document runs on PP (its num_devices) x EP (world / num_devices) ranks; each gives
    every replica the reference loss and every rank the reference gradients (rtol 1e-10); a paired document equals
    the first document of its device count (unpaired) and ran its pairs through `PhasedStages.pair`."""
    init_gloo(rank, world, port, timeout_s=60)
    groups: dict[int, tuple] = {}
    baseline: dict[int, tuple] = {}
    for doc in docs:
        plan = plan_from_dict(doc)
        p = plan.num_devices
        replicas = world // p
        if p not in groups:  # new_group is collective: every rank makes every group, in one order
            pipes = [dist.new_group(list(range(g * p, g * p + p))) for g in range(replicas)]
            groups[p] = (pipes, [dist.new_group([r * p + d for r in range(replicas)]) for d in range(p)])
        pipes, eps = groups[p]
        replica, device = divmod(rank, p)
        label = (f"rank {rank} (replica {replica}, device {device} of PP {p} x EP {replicas}), plan "
                 f"{doc.get('meta', {}).get('label', '')}")
        layers = build_layers(spec, replica)
        trace: list = []
        runner = moe_runner(spec, layers, plan, device, replica, eps[device], trace)
        result = PipelineExecutor(plan, runner, rank=device, group=pipes[replica],
                                  options=ExecutorOptions(timeout_s=60)).run_step()
        ref_losses, stacks = reference_step(spec, replicas, plan.num_microbatches)
        if plan.num_stages - 1 in plan.stages_of(device):
            torch.testing.assert_close(result.loss, ref_losses[replica], rtol=1e-10, atol=0, msg=f"{label}: loss")
        grads = owned_grads(plan, layers, device)
        ref = owned_grads(plan, stacks[replica], device)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-10, atol=1e-13, msg=f"{label}: {name}")
        if runner.pending():
            raise AssertionError(f"{label}: {runner.pending()} (stage, micro-batch) states not freed")
        _check_pairs_ran(plan, device, result, runner, trace, label)
        if p not in baseline:
            baseline[p] = (result.loss, grads)
            continue
        loss0, grads0 = baseline[p]
        if loss0 is not None:
            torch.testing.assert_close(result.loss, loss0, rtol=1e-10, atol=0, msg=f"{label}: loss vs unpaired")
        for name, g in grads.items():
            torch.testing.assert_close(g, grads0[name], rtol=1e-10, atol=1e-13, msg=f"{label}: {name} vs unpaired")
    dist.destroy_process_group()
