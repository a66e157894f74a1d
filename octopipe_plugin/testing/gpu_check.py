"""Device self-check of the executor (what scripts/gpu_check.sh runs): one summary line per check.

Usage: python -m octopipe_plugin.testing.gpu_check [--device auto|cuda|cpu] [--ranks N] [--steps S] [--plans ...]

Checks (each prints `[passed|failed|skipped] name: detail`; the last line is
`gpu check: N passed, M failed`, exit status non-zero when one failed):

- `cuda lane self path` (CUDA only): the NCCL lane of a world of one rank sends to itself
  (send and receive coalesced in one NCCL group, which NCCL needs for a self transfer; the
  executor never messages its own device, so this is the lane driven directly): side
  stream, ready event, device-side wait of the consumer stream, `record_stream`, buffers
  kept across steps, the watchdog thread. Values checked against the same kernels run
  without the transfer.
- `local stages`: one rank (NCCL on CUDA, gloo on CPU), a plan of three stages on its one
  device, both exchanges, gradients against a single-process reference.
- `plan <name>` for 1F1B, interleaved 1F1B, ZB-V and a plan tuned on costs measured here:
  two or more GPUs: NCCL, one rank per GPU (per-direction communicators, CUDA lane); one
  GPU: several ranks share it over gloo (NCCL refuses two ranks on one device; host-staged
  lane); no GPU: gloo on CPU. Gradients against a single-process reference on the same
  device (float64) with both exchanges, then the median of `--steps` timed steps of a larger
  float32 model against the simulator's prediction from per-layer times measured here
  (ranks sharing one GPU time-share it: there the prediction is a lower bound and the
  "one device" figure, all compute back to back, the other reference).
- `multi-tensor`: a (hidden, integer mask) model through ZB-V with metas learned by handshake.
- `megatron`, `deepspeed`, `transformer-engine`: one step of the framework on the device,
  through a hook module of octopipe_plugin.testing (HOOKS) when the package imports;
  "skipped: not installed" (or "hook not provided") otherwise, never failed for that.
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

from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.launch import free_port
from .plans import make_plan, random_bounds, sample_schedule
from ..executor.split_backward import backward_input, backward_weight
from ..executor.torch_stage import TorchStages
from .toy import ToySpec, boundary_metas, build_layers, microbatch, stage_modules
from ..formats import Layer, Model, plan_from_dict, plan_to_dict

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
    from ..executor.dryrun import zero_cost_cluster

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


EXCHANGES = ("message", "batched")


def _grads_match(plan, rank: int, device: torch.device, exchange: str | None = None) -> tuple[bool, str]:
    layers = build_layers(CHECK).to(device)
    ex = PipelineExecutor(plan, _runner(CHECK, layers, plan, rank, device), device=device,
                          options=ExecutorOptions(timeout_s=120, exchange=exchange))
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
        checks = [_grads_match(plan, rank, device, x) for x in EXCHANGES]
        ok = all(c[0] for c in checks)
        detail = ", ".join(f"{d} ({x})" for x, (_, d) in zip(EXCHANGES, checks))
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
    from .seam_checks import check_case

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
    from ..executor.dryrun import zero_cost_cluster

    sim = simulate(model, zero_cost_cluster(plan.num_devices), plan, detail=False)
    m = plan.num_microbatches
    serial = m * sum(x.fwd_ms + x.bwd_ms + x.wgrad_ms for x in model.layers)
    return sim.step_time_ms, serial


# ----- the checks that run in their own processes


def _spawn_bounded(fn, world: int, args: tuple, limit_s: float) -> None:
    """Run `fn(rank, world, port, *args)` on `world` spawned processes; a hang past `limit_s` kills them (raises)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"not finished after {limit_s:g} s (killed)")


def _init(backend: str, rank: int, world: int, port: int, device: torch.device) -> None:
    import datetime

    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))


def _write(out: str, name: str, doc) -> None:
    with open(os.path.join(out, name), "w") as fh:
        json.dump(doc, fh)


def lane_self_worker(rank: int, world: int, port: int, device_name: str, out: str) -> None:
    """NCCL world of one: the CUDA lane sends to itself over two steps; writes {ok, detail}."""
    from ..executor.lanes import CudaLane, Request, Transfer, make_lane

    device = torch.device(device_name)
    _init("nccl", 0, 1, port, device)
    lane = make_lane(backend="nccl", device=device, timeout_s=60, rank=0, groups=(dist.group.WORLD,))
    assert isinstance(lane, CudaLane), type(lane).__name__
    compute = torch.cuda.current_stream(device)
    kept: dict[int, torch.Tensor] = {}
    ptrs, worst = [], 0.0
    for step in range(2):
        lane.begin()
        for k in range(4):
            x = torch.randn(512, 1024, device=device) * (k + 1)  # made on the compute stream
            with lane.issuing():  # the receive buffer belongs to the side stream that fills it
                if k not in kept:
                    kept[k] = torch.empty_like(x)
                buf = kept[k]
            recv = Transfer(f"self{k}", (buf,), (Request(send=False, wire=buf, group=dist.group.WORLD, peer=0, tag=0),))
            wire = lane.send_wire(x)
            send = Transfer(f"self{k}", (wire,), (Request(send=True, wire=wire, group=dist.group.WORLD, peer=0,
                                                          tag=0),))
            # a transfer to oneself completes only inside one NCCL group holding both ends
            works = lane.issue_batch([*send.requests, *recv.requests])
            recv.works = send.works = tuple(works)
            lane.wait(recv, (f"step {step} self{k}", "receive", 0))
            got = lane.received(recv)[0]
            y = (got * 2.0).sum(dim=1)  # the consumer kernel, on the compute stream after the device-side wait
            worst = max(worst, float((y - (x * 2.0).sum(dim=1)).abs().max()))
            del x, wire  # freed while the transfer may still be read: only safe because the stream waited
        ptrs.append([kept[k].data_ptr() for k in range(4)])
    compute.synchronize()
    failure = lane.failure()
    lane.close()
    ok = worst == 0.0 and ptrs[0] == ptrs[1] and failure is None and lane.stream != compute
    detail = (f"4 messages x 2 steps, NCCL self transfer (send + receive in one group), side stream + ready event, "
              f"device-side wait, record_stream; max |diff| {worst:.1e}; buffers kept across steps: "
              f"{ptrs[0] == ptrs[1]}; watchdog: {failure or 'quiet'}")
    _write(out, "lane.json", {"ok": ok, "detail": detail})
    dist.destroy_process_group()


def local_stages_worker(rank: int, world: int, port: int, backend: str, device_name: str, out: str) -> None:
    """One rank, three stages on its one device, both exchanges: gradients against the reference."""
    import random

    device = torch.device(device_name)
    _init(backend, 0, 1, port, device)
    devs = [0, 0, 0]
    plan = make_plan(stage_devices=devs, bounds=random_bounds(len(CHECK.layers), 3, random.Random(1)), num_devices=1,
                     num_microbatches=4, schedule=sample_schedule(devs, 1, 4, random.Random(2)))
    checks = [_grads_match(plan, 0, device, x) for x in EXCHANGES]
    detail = ", ".join(f"{d} ({x})" for x, (_, d) in zip(EXCHANGES, checks))
    _write(out, "local.json", {"ok": all(c[0] for c in checks), "detail": f"3 stages on {device}: {detail}"})
    dist.destroy_process_group()


# ----- framework hooks: one step of the framework on the device, where the framework imports

# (check name, package that must import, hook module in octopipe_plugin.testing, function(device) -> detail)
HOOKS = (
    ("megatron", "megatron.core", "octopipe_plugin.testing.megatron_device", "one_step"),
    ("deepspeed", "deepspeed", "octopipe_plugin.testing.deepspeed_device", "one_step"),
    ("transformer-engine", "transformer_engine", "octopipe_plugin.testing.te_device", "split_check"),
)


def hook_check(package: str, module: str, func: str, device: torch.device) -> tuple[str, str]:
    """(status, detail) of one framework hook: skipped when the package or the hook is absent."""
    import importlib
    import importlib.util

    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "skipped", f"not installed ({package})"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return "skipped", f"hook not provided ({module}.{func})"
        raise
    return "passed", str(getattr(mod, func)(device))


# ----- the run


class Summary:
    """Prints one line per check and counts them."""

    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}

    def line(self, status: str, name: str, detail: str) -> None:
        """Print and count one check."""
        self.counts[status] += 1
        print(f"[{status}] {name}: {detail}", flush=True)

    def run(self, name: str, fn) -> None:
        """Run `fn() -> (status, detail)`; an exception is a failure, summarised in one line."""
        try:
            status, detail = fn()
        except Exception as exc:  # one broken check must not hide the others
            text = str(exc).strip().splitlines()
            status, detail = "failed", f"{type(exc).__name__}: {text[-1] if text else ''}"
        self.line(status, name, detail)


def _read(out: str, name: str) -> dict:
    with open(os.path.join(out, name), encoding="utf-8") as fh:
        return json.load(fh)


def _flag(doc: dict) -> tuple[str, str]:
    return ("passed" if doc["ok"] else "failed"), doc["detail"]


def main(argv=None) -> int:
    """Run every check; one line each and the final count; non-zero exit when one failed."""
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
    summary = Summary()
    with tempfile.TemporaryDirectory(prefix="octopipe-gpu-check-") as out:
        if device.type == "cuda":
            summary.run("cuda lane self path", lambda: (_spawn_bounded(lane_self_worker, 1, (str(device), out), 120),
                                                        _flag(_read(out, "lane.json")))[1])
        else:
            summary.line("skipped", "cuda lane self path", "needs CUDA")
        local_backend = "nccl" if device.type == "cuda" else "gloo"
        summary.run("local stages", lambda: (_spawn_bounded(local_stages_worker, 1, (local_backend, str(device), out),
                                                            120), _flag(_read(out, "local.json")))[1])
        _plans(summary, setup, names, args.steps, device, out)
    for name, package, module, func in HOOKS:
        summary.run(name, lambda p=package, m=module, f=func: hook_check(p, m, f, device))
    if setup.device == "cpu":
        print("(CPU: the timings show the mechanics only; on a shared machine they are noise)")
    c = summary.counts
    print(f"total {time.perf_counter() - t0:.0f} s, {c['skipped']} skipped")
    print(f"gpu check: {c['passed']} passed, {c['failed']} failed")
    return 1 if c["failed"] else 0


def _plans(summary: Summary, setup: Setup, names, steps: int, device: torch.device, out: str) -> None:
    """The multi-rank plans: one line per plan (gradients, both exchanges; predicted and measured step)."""
    timed = TIMED if setup.device == "cuda" else TIMED_CPU
    try:
        measured = layer_costs(timed, device)
        docs = check_plans(setup.world, measured, names)
        _spawn_bounded(worker, setup.world, (setup, docs, timed, steps, "masked" in names, out), 360)
        ranks = [_read(out, f"rank{r}.json") for r in range(setup.world)]
    except Exception as exc:
        text = str(exc).strip().splitlines()
        summary.line("failed", "plans", f"{type(exc).__name__}: {text[-1] if text else ''}")
        return
    lane = "CUDA lane, NCCL" if setup.backend == "nccl" else ("host-staged lane" if setup.shared_gpu else "gloo")
    for i, doc in enumerate(docs):
        plan = plan_from_dict(doc["plan"])
        oks = [r["results"][i]["ok"] for r in ranks]
        pred, serial = predicted_ms(measured, plan)
        times = [max(r["results"][i]["times"][k] for r in ranks) for k in range(steps)] if steps else []
        meas = f"measured {statistics.median(times):.1f} ms" if times else "not timed"
        bad = "; ".join(f"rank {r}: {x['results'][i]['detail']}" for r, x in enumerate(ranks)
                        if not x["results"][i]["ok"])
        detail = (f"{setup.world} ranks, {lane}; grads {'match' if all(oks) else 'DIFFER: ' + bad} "
                  f"({ranks[0]['results'][i]['detail']}); predicted {pred:.1f} ms, one device {serial:.1f} ms, {meas}")
        summary.line("passed" if all(oks) else "failed", f"plan {doc['label']}", detail)
    if "masked" in names:
        multi = ranks[0]["multi"]
        summary.line("passed" if multi.startswith("ok") else "failed", "multi-tensor", multi)


if __name__ == "__main__":
    sys.exit(main())
