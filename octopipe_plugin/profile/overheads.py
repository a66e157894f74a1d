"""Measure the executor's own host cost per action kind and per message (`octopipe profile --overheads`).

Per action: each of the two ranks runs, at the same time (as both compute during a real step),
a plan of its own on a one-rank group: 4 stages of one tiny linear layer on its device, 8
micro-batches, once with fused backward (F, B) and once split (F, I, W). An action's cost is its
runner call's median span less the same layer's profiled time (profile/measure.py: what the
layer profile already charges), plus the gap the executor spends between two actions (the
lower quartile of the gaps: a gap only grows when the host is kept from running).
Per message: a forward-only plan of two pass-through stages, stage 0 on rank 0 and stage 1 on
rank 1, whose last stage sleeps so every message has arrived before it is waited on. The
sender's gap between actions (lower quartile) less the local plan's gap is its cost per
message, the receiver's likewise; both at a few sizes, fitted as fixed + per-MB (least squares, clipped at
0).
Per message in flight, from a busy sender: rank 0 computes (a matmul loop, its producer), posts a
message to rank 1 and at once computes again, as a stage does when its next action starts right
away; rank 1 waits in its receive. The same trial with a sender that waits on its send instead
(idle, as the link's ping-pong measures) is the reference, interleaved trial by trial; the
receiver's (trimmed) mean wait less the reference's is the delivery delay the link model does not
charge. gloo's tcp transport writes a message from the sender's own thread only when the
receiver's notice that it is ready has already been handled and the whole message fits the socket
buffer; otherwise its device-loop thread writes it (gloo/transport/tcp/pair.cc: Pair::send,
handleRemotePendingRecv, sendAsyncMode), and that thread waits for a core while the sender computes.
The sender posts as the executor does (executor/comm.py `give_way`: on gloo it yields its core
once after posting, which lets that thread write first), so the figure is the delay left under
the executor's own posting; the wait from a sender that does not give way is kept in `meta`.
Only the receiver's clock is read, so ranks need not share one. Fitted as fixed + per-MB likewise.
The figures are cached like layer profiles (profile/cache.py), keyed by device, backend,
library versions and the settings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..actions import Action, Kind
from ..executor import ExecutorOptions, PipelineExecutor, TensorMeta, TorchStages
from ..executor.comm import give_way, yields_after_send
from ..formats import Plan, Stage
from ..formats.overheads import MessageCost, Overheads, overheads_from_dict, overheads_to_dict, read_overheads
from .cache import ProfileCache, cache_key
from .device import device_name, library_versions
from .measure import measure_layer

STAGES, MICROBATCHES, WIDTH = 4, 8, 16
SIZES = (4096, 1 << 20, 4 << 20)  # message bytes: the fit's points
RECEIVER_SLEEP_S = 0.002  # the receiver's stage sleeps this long, so every message has landed before its wait
BUSY_MS = 4.0  # the sender computes this long before posting and (busy) after: a stage's action on the models profiled
BUSY_TAG = 7  # the busy-sender trials' tag (their own: no executor message is in flight meanwhile)


@dataclass(frozen=True, kw_only=True, slots=True)
class OverheadSettings:
    """How many steps to time, the message sizes, and the cache (None: default directory; use_cache False: none)."""

    steps: int = 5
    warmup: int = 2
    sizes: tuple[int, ...] = SIZES
    busy_ms: float = BUSY_MS
    busy_trials: int = 24  # per size and mode (busy / idle sender)
    cache_dir: str | None = None
    use_cache: bool = True


def _local_plan(split: bool) -> Plan:
    """All stages on one device, micro-batch by micro-batch: F of every stage, then its backward."""
    rows = []
    for mb in range(MICROBATCHES):
        rows += [Action(s, Kind.F, mb) for s in range(STAGES)]
        for s in reversed(range(STAGES)):
            rows += [Action(s, Kind.I, mb), Action(s, Kind.W, mb)] if split else [Action(s, Kind.B, mb)]
    return Plan(model="overheads", num_devices=1, num_microbatches=MICROBATCHES,
                stages=tuple(Stage(start=s, end=s + 1, device=0) for s in range(STAGES)), schedule=(tuple(rows),))


def _pair_plan() -> Plan:
    """Two stages, one per device; forward-only runs use only the F actions."""
    rows = (tuple(a for mb in range(MICROBATCHES) for a in [Action(0, Kind.F, mb)]) +
            tuple(Action(0, Kind.B, mb) for mb in range(MICROBATCHES)),
            tuple(a for mb in range(MICROBATCHES) for a in (Action(1, Kind.F, mb), Action(1, Kind.B, mb))))
    return Plan(model="overheads", num_devices=2, num_microbatches=MICROBATCHES,
                stages=(Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1)), schedule=rows)


class _Sleep(nn.Module):
    """The receiver's stage: sleeps (freeing the core), then gives the scalar its loss is."""

    def forward(self, x):
        time.sleep(RECEIVER_SLEEP_S)
        return torch.zeros(())


def _gaps(timeline) -> list[float]:
    """Seconds between one runner call's end and the next one's start."""
    return [b[1] - a[2] for a, b in zip(timeline, timeline[1:])]


def _timed_steps(ex: PipelineExecutor, settings: OverheadSettings, group, forward_only: bool = False) -> list:
    """The timelines of `settings.steps` steps after the warm-up ones."""
    out = []
    for i in range(settings.warmup + settings.steps):
        dist.barrier(group)
        res = ex.run_step(forward_only=forward_only)
        if i >= settings.warmup:
            out.append(res.timeline)
    return out


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(WIDTH, WIDTH)


def _action_costs(rank: int, group, settings: OverheadSettings) -> tuple[dict[str, float], float]:
    """Per kind, ms beyond the tiny layer's profiled time; and the median gap (ms) between two local actions."""
    x = torch.randn(1, WIDTH)
    prof = measure_layer(_tiny(), x, torch.device("cpu"), warmup=settings.warmup, repeats=4 * settings.steps)
    layer_ms = {"F": prof.fwd.median_ms, "I": prof.bwd.median_ms, "W": prof.wgrad.median_ms,
                "B": prof.fused.median_ms}
    spans: dict[str, list[float]] = {k: [] for k in layer_ms}
    gaps: list[float] = []
    for split in (False, True):
        plan = _local_plan(split)
        mods = {s: _tiny() for s in range(STAGES)}
        meta = TensorMeta(shape=(1, WIDTH), dtype=torch.float32)
        runner = TorchStages(modules=mods, num_stages=STAGES, num_microbatches=MICROBATCHES,
                             metas=(meta,) * (STAGES - 1) + (TensorMeta(shape=(), dtype=torch.float32),),
                             load_input=lambda mb: x, loss_fn=lambda out, mb: out.sum())
        ex = PipelineExecutor(plan, runner, rank=0, group=group, options=ExecutorOptions(timeout_s=120))
        for tl in _timed_steps(ex, settings, group):
            for a, t0, t1 in tl:
                spans[a.kind.value].append(t1 - t0)
            gaps += _gaps(tl)
    gap_ms = 1000 * _low(gaps)
    costs = {k: max(0.0, 1000 * statistics.median(v) - layer_ms[k] + gap_ms) for k, v in spans.items()}
    return costs, gap_ms


def _message_gaps(rank: int, nbytes: int, settings: OverheadSettings) -> float:
    """Median ms between two actions on this rank of the pair plan (forward only), messages of `nbytes`."""
    n = max(1, nbytes // 4)
    meta = TensorMeta(shape=(n,), dtype=torch.float32)
    payload = torch.zeros(n)
    mods = {rank: nn.Identity() if rank == 0 else _Sleep()}
    runner = TorchStages(modules=mods, num_stages=2, num_microbatches=MICROBATCHES,
                         metas=(meta, TensorMeta(shape=(), dtype=torch.float32)),
                         load_input=lambda mb: payload, loss_fn=lambda out, mb: out)
    ex = PipelineExecutor(_pair_plan(), runner, options=ExecutorOptions(timeout_s=120))
    gaps = [g for tl in _timed_steps(ex, settings, None, forward_only=True) for g in _gaps(tl)]
    return 1000 * _low(gaps)


def _gather_round(nbytes: int, settings: OverheadSettings) -> float:
    """Lower-quartile ms of one all-gather of `nbytes` a rank over the 2 ranks (one round), both posting at once
    after a barrier, as every shard's H posts its statistics: the executor's own call (lanes.PlainLane.issue_gather)."""
    from ..executor.lanes import PlainLane

    lane = PlainLane(torch.device("cpu"), timeout_s=120.0)
    part, group = torch.zeros(max(1, nbytes // 4)), dist.group.WORLD
    samples = []
    for i in range(settings.warmup + 4 * settings.steps):
        dist.barrier()
        t0 = time.perf_counter()
        lane.wait_gather(lane.issue_gather(part, group, 2)[0])
        if i >= settings.warmup:
            samples.append(1000 * (time.perf_counter() - t0))
    return _low(samples)


def _spin(ms: float, a: torch.Tensor) -> None:
    """Real compute for `ms` (a matmul loop on one thread), as a stage's next action keeps the core busy."""
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        torch.mm(a, a)


def _busy_delivery(rank: int, nbytes: int, settings: OverheadSettings) -> tuple[float, float, float]:
    """(busy, idle, raw): the receiver's mean ms waiting for a message of `nbytes` from a busy sender that posts as
    the executor does (comm.py `give_way` after the send), from an idle one, and from a busy one that does not give way.

    Rank 0 sends, rank 1 receives. A trial: the sender computes `busy_ms` (its producer: the
    receiver's receive, posted at once, reaches it meanwhile, as the executor posts receives
    early), posts the message, then computes `busy_ms` more (busy) or waits on the send (idle).
    Trials rotate the modes, so a drifting load shifts all alike; the sender reaches each trial's
    barrier last, so the barrier's skew is the same in all and cancels in their differences.
    Mean over the trials less the highest and lowest tenth: the delay is bimodal (a message goes
    out at once or waits for a core), so a median would flip between the modes while other
    processes' preemptions, in any mode, are the outliers trimmed. Only rank 1's figures mean anything.
    """
    n = max(1, nbytes // 4)
    payload, buf, a = torch.zeros(n), torch.empty(n), torch.randn(64, 64)
    modes = ("busy", "idle", "raw")
    waits: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(len(modes) * (settings.warmup + settings.busy_trials)):
        mode = modes[i % len(modes)]
        if rank == 0:
            time.sleep(0.002)
        dist.barrier()
        if rank == 0:
            _spin(settings.busy_ms, a)
            work = dist.isend(payload, 1, tag=BUSY_TAG)
            if mode != "idle":
                give_way(mode == "busy" and yields_after_send(dist.get_backend()))
                _spin(settings.busy_ms, a)
            work.wait()
        else:
            t0 = time.perf_counter()
            dist.recv(buf, 0, tag=BUSY_TAG)
            if i >= len(modes) * settings.warmup:
                waits[mode].append(1000 * (time.perf_counter() - t0))
    if rank != 1:
        return 0.0, 0.0, 0.0
    return tuple(_trimmed_mean(waits[m]) for m in modes)


def _trimmed_mean(samples: list[float], cut: float = 0.1) -> float:
    """The mean of `samples` less the highest and the lowest `cut` share of them."""
    xs = sorted(samples)
    k = int(len(xs) * cut)
    return statistics.fmean(xs[k:len(xs) - k] if len(xs) > 2 * k else xs)


def _low(samples: list[float]) -> float:
    """The lower quartile: a gap only grows when the host is kept from running or waits for a message, so on a
    loaded machine the low end is the executor's own cost and the median is not."""
    return statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]


def _fit(sizes, ms) -> MessageCost:
    """Least-squares fixed + per-MB line through (bytes, ms), each part clipped at 0."""
    xs = [s / 1e6 for s in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ms)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ms)) / var) if var > 0 else 0.0
    return MessageCost(fixed_ms=max(0.0, my - slope * mx), per_mb_ms=slope)


def _fit_small(sizes, ms) -> MessageCost:
    """The fixed + per-MB line through the two smallest sizes, each part clipped at 0: what is gathered (softmax
    statistics, some kB) is small, and a copy of MBs through the collective bends the line (a least-squares fit
    through 4 MB put the fixed part at 0)."""
    (x0, y0), (x1, y1) = sorted(zip(sizes, ms))[:2]
    slope = max(0.0, (y1 - y0) / ((x1 - x0) / 1e6)) if x1 > x0 else 0.0
    return MessageCost(fixed_ms=max(0.0, y0 - slope * x0 / 1e6), per_mb_ms=slope)


def _rank_device() -> str:
    """The device name the ranks run as: the CPU with one thread each (executor.launch.init_gloo sets it)."""
    return device_name(torch.device("cpu")).rsplit(" x", 1)[0] + " x1 threads"


def _key_fields(settings: OverheadSettings, backend: str = "gloo") -> dict:
    return {"what": "executor-overheads", "device": _rank_device(),
            "backend": backend, "versions": library_versions(),
            "settings": {"steps": settings.steps, "warmup": settings.warmup, "sizes": list(settings.sizes),
                         "stages": STAGES, "microbatches": MICROBATCHES, "width": WIDTH,
                         "busy_ms": settings.busy_ms, "busy_trials": settings.busy_trials,
                         "give_way": yields_after_send(backend), "gather_round": "lane-2-small"}}


def measure_overheads(settings: OverheadSettings | None = None) -> Overheads:
    """Measure (or read from the cache) the executor's overheads; collective over a default group of 2 ranks.

    Every rank returns the same figures: the mean of the two ranks' action costs, the sender's
    (rank 0) and the receiver's (rank 1) message costs.
    """
    s = settings or OverheadSettings()
    rank = dist.get_rank()
    if dist.get_world_size() != 2 or dist.get_backend() != "gloo":
        raise ValueError(f"measure_overheads: times the executor over a default gloo group of 2 CPU ranks, got "
                         f"{dist.get_world_size()} ranks on {dist.get_backend()}")
    fields = _key_fields(s, dist.get_backend())
    key = cache_key(fields)
    cache = ProfileCache(s.cache_dir) if s.use_cache else None
    box = [cache.get(key) if cache is not None and rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        box[0] = _measure(rank, s, fields)
        if cache is not None and rank == 0:
            cache.put(key, box[0], fields)
    return overheads_from_dict(box[0], "profile cache")


def _measure(rank: int, s: OverheadSettings, fields: dict) -> dict:
    """Both ranks measure; every rank gets rank 0's octopipe-overheads/1 document."""
    groups = [dist.new_group([r]) for r in range(2)]  # every rank makes every group
    costs, gap_ms = _action_costs(rank, groups[rank], s)
    msg = [_message_gaps(rank, n, s) - gap_ms for n in s.sizes]
    busy = [_busy_delivery(rank, n, s) for n in s.sizes]
    gather = [_gather_round(n, s) for n in s.sizes]
    mine = {"costs": costs, "gap_ms": gap_ms, "msg": msg, "busy": busy, "gather": gather}
    both = [None, None]
    dist.all_gather_object(both, mine)
    extra = [max(0.0, b - i) for b, i, _ in both[1]["busy"]]  # the receiver's figures
    action_ms = tuple((k, statistics.fmean(b["costs"][k] for b in both)) for k in sorted(costs))
    meta = {"method": "profile/overheads.py", "settings": fields["settings"],
            "gap_us": [round(1000 * b["gap_ms"], 3) for b in both],
            "message_points": {"bytes": list(s.sizes), "send_us": [round(1000 * v, 3) for v in both[0]["msg"]],
                               "recv_us": [round(1000 * v, 3) for v in both[1]["msg"]],
                               "busy_wait_us": [round(1000 * b, 3) for b, _, _ in both[1]["busy"]],
                               "idle_wait_us": [round(1000 * i, 3) for _, i, _ in both[1]["busy"]],
                               # a busy sender that does not give way after posting (what comm.py's yield saves)
                               "busy_no_yield_wait_us": [round(1000 * r, 3) for _, _, r in both[1]["busy"]]},
            "gather_round_us": [round(1000 * min(a, b), 3) for a, b in zip(both[0]["gather"], both[1]["gather"])]}
    # the later rank out of the barrier waits less: the lower of the two is the round's own cost
    ov = Overheads(action_ms=action_ms, send=_fit(s.sizes, both[0]["msg"]), recv=_fit(s.sizes, both[1]["msg"]),
                   delivery=_fit(s.sizes, extra),
                   gather_round=_fit_small(s.sizes, [min(a, b) for a, b in zip(both[0]["gather"], both[1]["gather"])]),
                   device=fields["device"], backend=fields["backend"], meta=meta)
    return overheads_to_dict(ov)


def _spawned(rank: int, world: int, port: int, settings: OverheadSettings, out: str) -> None:
    from ..executor.launch import init_gloo
    from ..formats.overheads import write_overheads

    init_gloo(rank, world, port, timeout_s=300)
    ov = measure_overheads(settings)
    if rank == 0:
        write_overheads(ov, out)
    dist.destroy_process_group()


def profile_overheads(settings: OverheadSettings | None = None) -> Overheads:
    """Start 2 local gloo ranks (one thread each) and measure the executor's overheads on this machine's CPU."""
    import os
    import tempfile

    from ..executor.launch import spawn

    with tempfile.TemporaryDirectory(prefix="octopipe-overheads-") as tmp:
        path = os.path.join(tmp, "overheads.json")
        spawn(_spawned, 2, settings or OverheadSettings(), path)
        return read_overheads(path)


def format_overheads(ov: Overheads) -> str:
    """The figures as a few lines of text (microseconds)."""
    acts = "  ".join(f"{k} {1000 * ms:.1f}" for k, ms in ov.action_ms)
    return "\n".join([
        f"executor overheads on {ov.device} ({ov.backend}), microseconds",
        f"  per action:  {acts}",
        f"  per message: sender {1000 * ov.send.fixed_ms:.1f} + {1000 * ov.send.per_mb_ms:.1f}/MB, "
        f"receiver {1000 * ov.recv.fixed_ms:.1f} + {1000 * ov.recv.per_mb_ms:.1f}/MB",
        f"  in flight:   busy sender's delivery {1000 * ov.delivery.fixed_ms:.1f} + "
        f"{1000 * ov.delivery.per_mb_ms:.1f}/MB beyond the link"
        + (f", launch {1000 * ov.launch_ms:.1f}" if ov.launch_ms else ""),
        f"  all-gather:  {1000 * ov.gather_round.fixed_ms:.1f} + {1000 * ov.gather_round.per_mb_ms:.1f}/MB a "
        f"round beyond the link"])


def machine_overheads(path: str | None = None, *, measure: bool = True,
                      settings: OverheadSettings | None = None) -> Overheads | None:
    """The overheads to check a run against: the file at `path`, else this machine's from the profile cache,
    else (when `measure`) measured now on 2 local ranks (about 15 s, then cached); None when none is at hand."""
    if path is not None:
        return read_overheads(path)
    s = settings or OverheadSettings()
    if s.use_cache:
        fields = _key_fields(s)
        rec = ProfileCache(s.cache_dir).get(cache_key(fields))
        if rec is not None:
            return overheads_from_dict(rec, "profile cache")
    return profile_overheads(s) if measure else None
