"""Device check of the executor (what scripts/gpu_check.sh runs): CUDA tensors, side streams, events.

Usage: python -m octopipe_plugin.executor.gpu_check [--device auto|cuda|cpu] [--ranks N] [--steps S]

- Two or more GPUs: NCCL, one rank per GPU (up to --ranks), per-direction communicators,
  side-stream sends and receives ordered by events.
- One GPU: several ranks share it over gloo (NCCL refuses two ranks on one device); the
  transport stages every device tensor through host memory.
- No GPU (--device cpu, or auto without one): the same checks on CPU tensors (what tests run).

For each plan (1F1B, interleaved 1F1B, ZB-V, a plan tuned on costs measured here, and a
multi-tensor (hidden, mask) plan) every rank checks loss and gradients against a
single-process reference on the same device (float64), then times `--steps` training steps
of a larger float32 model and prints the median step against the simulator's prediction
from per-layer F / I / W times measured on this device. Ranks sharing one GPU time-share
it, so there the prediction for separate devices is a lower bound, and the printed
"one device" figure (all compute back to back) is the other reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..formats import Layer, Model, plan_from_dict, plan_to_dict
from .engine import ExecutorOptions, PipelineExecutor
from .launch import free_port
from ..testing.plans import make_plan, random_bounds
from .split_backward import backward_input, backward_weight
from .torch_stage import TorchStages
from ..testing.toy import ToySpec, boundary_metas, build_layers, microbatch, stage_modules

CHECK = ToySpec(layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "head"))
TIMED = ToySpec(hidden=512, seq=256, batch=4, dtype=torch.float32,
                layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "head"))
TIMED_CPU = replace(TIMED, hidden=32, seq=16, batch=2)  # CPU runs check the mechanics, not the speed


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """Backend, device kind and rank count of the run."""

    backend: str
    device: str  # "cuda" or "cpu"
    world: int
    shared_gpu: bool  # several ranks on one GPU (gloo, staged through host)

    def rank_device(self, rank: int) -> torch.device:
        """The device rank `rank` computes on."""
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.shared_gpu else rank)


def choose_setup(device: str = "auto", ranks: int = 4, gpus: int | None = None) -> Setup:
    """NCCL with one rank per GPU where there are two or more, gloo sharing one GPU, or gloo on CPU."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if device == "cpu" or (device == "auto" and gpus == 0):
        return Setup(backend="gloo", device="cpu", world=ranks, shared_gpu=False)
    if gpus == 0:
        raise SystemExit("--device cuda: no GPU visible")
    if gpus >= 2:
        return Setup(backend="nccl", device="cuda", world=min(ranks, gpus), shared_gpu=False)
    return Setup(backend="gloo", device="cuda", world=ranks, shared_gpu=True)


def layer_costs(spec: ToySpec, device: torch.device, reps: int = 5) -> Model:
    """Per-layer F, I and W milliseconds of `spec`'s layers measured on `device` (medians)."""
    layers = build_layers(spec).to(device)
    x = microbatch(spec, 0)[0].to(device)
    out_bytes = x.numel() * x.element_size()
    costs = []
    for i, layer in enumerate(layers):
        f, b, w = [], [], []
        for _ in range(reps + 1):
            inp = x.detach().requires_grad_(True)
            t0 = _now(device)
            y = layer(inp)
            t1 = _now(device)
            (_,), work = backward_input([y], [torch.ones_like(y)], [inp], list(layer.parameters()))
            t2 = _now(device)
            backward_weight(work)
            t3 = _now(device)
            f.append(t1 - t0), b.append(t2 - t1), w.append(t3 - t2)
        layer.zero_grad(set_to_none=True)
        x = y.detach()
        med = lambda v: statistics.median(v[1:]) * 1000.0  # noqa: E731 - the first rep warms up
        costs.append(Layer(name=f"l{i}", kind=spec.layers[i], fwd_ms=med(f), bwd_ms=med(b), wgrad_ms=med(w),
                           state_bytes=sum(p.numel() * p.element_size() * 4 for p in layer.parameters()),
                           activation_bytes=out_bytes * 4, output_bytes=out_bytes))
    return Model(name="gpu-check", layers=tuple(costs))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


PLANS = ("1f1b", "interleaved-1f1b", "zb-v", "tuned", "masked")


def check_plans(p: int, measured: Model, names=PLANS) -> list[dict]:
    """The plans to run on p ranks: built-in schedules on non-uniform stages and one tuned on `measured`."""
    import random

    from ..schedules.registry import SCHEDULES, stage_devices_for
    from ..tuner import tune
    from .dryrun import zero_cost_cluster

    rng = random.Random(p)
    docs = []
    for name, v, m in (("1f1b", 1, 2 * p), ("interleaved-1f1b", 2, 2 * p), ("zb-v", 2, 2 * p)):
        if name not in names:
            continue
        devs = stage_devices_for(name, p, v)
        if len(devs) > len(CHECK.layers):
            continue
        plan = make_plan(stage_devices=devs, bounds=random_bounds(len(CHECK.layers), len(devs), rng), num_devices=p,
                         num_microbatches=m, schedule=SCHEDULES[name].generate(devs, p, m))
        docs.append({"label": name, "plan": plan_to_dict(plan)})
    if "tuned" in names:
        cluster = replace(zero_cost_cluster(p), memory_bytes=1 << 40)
        tuned = tune(measured, cluster, 2 * p, time_budget_s=10, iterations=30, seed=0).plan
        docs.append({"label": "tuned", "plan": plan_to_dict(tuned)})
    return docs


def _runner(spec: ToySpec, layers, plan, rank: int, device: torch.device) -> TorchStages:
    bounds = [(s.start, s.end) for s in plan.stages]
    target = {}

    def load(mb: int):
        x, y = microbatch(spec, mb)
        target[mb] = y.to(device)
        return x.to(device)

    def loss(out, mb):
        if mb not in target:  # the last stage's rank did not load stage 0's input
            target[mb] = microbatch(spec, mb)[1].to(device)
        return torch.nn.functional.mse_loss(out, target.pop(mb))

    return TorchStages(modules=stage_modules(layers, bounds, plan.stages_of(rank)), num_stages=plan.num_stages,
                       num_microbatches=plan.num_microbatches, metas=boundary_metas(spec, plan.num_stages),
                       load_input=load, loss_fn=loss)


def _grads_match(plan, rank: int, device: torch.device) -> tuple[bool, str]:
    layers = build_layers(CHECK).to(device)
    ex = PipelineExecutor(plan, _runner(CHECK, layers, plan, rank, device), device=device,
                          options=ExecutorOptions(timeout_s=120))
    result = ex.run_step()
    ref = build_layers(CHECK).to(device)
    ref_loss = _reference(CHECK, ref, plan.num_microbatches, device)
    worst = 0.0
    if result.loss is not None:
        worst = float((result.loss - ref_loss).abs())
    for s in plan.stages_of(rank):
        st = plan.stages[s]
        for idx in range(st.start, st.end):
            for p, q in zip(layers[idx].parameters(), ref[idx].parameters()):
                if p.grad is None:
                    return False, f"layer {idx}: no gradient"
                worst = max(worst, float((p.grad - q.grad).abs().max()))
    return worst < 1e-9, f"max |diff| {worst:.2e}"


def _reference(spec: ToySpec, layers, m: int, device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=spec.dtype, device=device)
    for mb in range(m):
        x, y = (t.to(device) for t in microbatch(spec, mb))
        for layer in layers:
            x = layer(x)
        loss = torch.nn.functional.mse_loss(x, y) / m
        loss.backward()
        total += loss.detach()
    return total


def _timed_steps(spec: ToySpec, plan, rank: int, device: torch.device, steps: int) -> list[float]:
    layers = build_layers(spec).to(device)
    ex = PipelineExecutor(plan, _runner(spec, layers, plan, rank, device), device=device,
                          options=ExecutorOptions(timeout_s=120))
    times = []
    for i in range(steps + 1):  # the first step warms up (allocator, kernels, connections)
        dist.barrier()
        t0 = _now(device)
        ex.run_step()
        times.append((_now(device) - t0) * 1000.0)
    return times[1:]


def worker(rank: int, world: int, port: int, setup: Setup, docs: list[dict], timed: ToySpec, steps: int,
           multi: bool, out: str) -> None:
    """One rank: gradient check and timed steps of every plan; writes its results as JSON."""
    import datetime

    device = setup.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(setup.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    for doc in docs:
        plan = plan_from_dict(doc["plan"])
        ok, detail = _grads_match(plan, rank, device)
        times = _timed_steps(timed, plan, rank, device, steps) if steps else []
        results.append({"label": doc["label"], "ok": ok, "detail": detail, "times": times})
    multi = _multi_tensor_ok(rank, world, device) if multi else "not run"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"results": results, "multi": multi}, fh)
    dist.barrier()
    dist.destroy_process_group()


def _multi_tensor_ok(rank: int, world: int, device: torch.device) -> str:
    """The (hidden, integer mask) model through a ZB-V plan with handshaken metas (CPU reference on this rank)."""
    from ..schedules.registry import SCHEDULES, stage_devices_for
    from ..testing.seam_checks import check_case

    devs = stage_devices_for("zb-v", world, 2)
    plan = make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(2 * world - 1)] + [(2 * world - 1, 8)],
                     num_devices=world, num_microbatches=world + 1, schedule=SCHEDULES["zb-v"].generate(devs, world,
                                                                                                        world + 1))
    case = {"model": "masked", "plan": plan_to_dict(plan), "label": "masked zb-v", "sink": "autograd",
            "declared": False, "tags": False, "seqs": [5, 3]}
    check_case(rank, case, device=str(device))
    return "ok (loss, gradients, hook counts, forward_only, two sequence lengths)"


def predicted_ms(model: Model, plan) -> tuple[float, float]:
    """(simulated step with one device per rank, all compute of the step back to back on one device)."""
    from ..simulator import simulate
    from .dryrun import zero_cost_cluster

    sim = simulate(model, zero_cost_cluster(plan.num_devices), plan, detail=False)
    m = plan.num_microbatches
    serial = m * sum(x.fwd_ms + x.bwd_ms + x.wgrad_ms for x in model.layers)
    return sim.step_time_ms, serial


def main(argv=None) -> int:
    """Run the check and print one line per plan; non-zero exit when a gradient differs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan (0: gradient checks only)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {','.join(PLANS)}")
    args = ap.parse_args(argv)
    names = tuple(n.strip() for n in args.plans.split(",") if n.strip())
    unknown = sorted(set(names) - set(PLANS))
    if unknown:
        ap.error(f"--plans: unknown {', '.join(unknown)}; expected names from {', '.join(PLANS)}")
    setup = choose_setup(args.device, args.ranks)
    device = setup.rank_device(0)
    print(f"gpu_check: backend {setup.backend}, {setup.world} ranks on "
          f"{'one shared GPU (staged through host)' if setup.shared_gpu else setup.device}"
          f"{' (' + torch.cuda.get_device_name(0) + ')' if setup.device == 'cuda' else ''}", flush=True)
    t0 = time.perf_counter()
    timed = TIMED if setup.device == "cuda" else TIMED_CPU
    measured = layer_costs(timed, device)
    docs = check_plans(setup.world, measured, names)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="octopipe-gpu-check-") as out:
        mp.start_processes(worker, args=(setup.world, free_port(), setup, docs, timed, args.steps, "masked" in names,
                                         out),
                           nprocs=setup.world, start_method="spawn", join=True)
        ranks = []
        for r in range(setup.world):
            with open(os.path.join(out, f"rank{r}.json"), encoding="utf-8") as fh:
                ranks.append(json.load(fh))
    failed = 0
    print(f"{'plan':<18} {'grads':<6} {'predicted ms':>13} {'one device ms':>14} {'measured ms':>12}")
    for i, doc in enumerate(docs):
        plan = plan_from_dict(doc["plan"])
        oks = [r["results"][i]["ok"] for r in ranks]
        failed += not all(oks)
        pred, serial = predicted_ms(measured, plan)
        times = [max(r["results"][i]["times"][k] for r in ranks) for k in range(args.steps)] if args.steps else []
        meas = f"{statistics.median(times):12.1f}" if times else f"{'-':>12}"
        detail = "; ".join(f"rank {r}: {x['results'][i]['detail']}" for r, x in enumerate(ranks)
                           if not x["results"][i]["ok"])
        print(f"{doc['label']:<18} {'ok' if all(oks) else 'FAIL':<6} {pred:13.1f} {serial:14.1f} {meas} {detail}")
    print(f"multi-tensor (hidden, mask) plan: {ranks[0]['multi']}")
    if setup.device == "cpu":
        print("(CPU: the timings show the mechanics only; on a shared machine they are noise)")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
