"""The comparison of a tuned plan against every built-in schedule on both splits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..schedules.registry import SCHEDULES
from .seeds import Baseline

BASELINE = ("interleaved-1f1b", "megatron")  # Megatron-LM's default: interleaved 1F1B on its own split
# The state of the art the issue names, compared on the balanced split. interleaved-zb at v = 1
# is exactly ZB-H1's order, so ZB-H1 is covered without being listed; combined-1f1b is what
# Megatron runs with the MoE all-to-all overlapped (--overlap-moe-expert-parallel-comm).
SOTA = ("zb-v", "dualpipev", "interleaved-zb", "combined-1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One line of the comparison table."""

    label: str
    schedule: str
    split: str
    stages_per_device: int | str  # 'lo-hi' when the tuned plan gives devices different counts
    step_ms: float | None
    bubble: float | None
    peak_bytes: int | None
    fits: bool
    speedup: float | None  # baseline step time / this step time
    note: str = ""

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def best_of(baselines, name: str, split: str, allowed=None) -> Baseline | None:
    """The fastest fitting run of a schedule on a split (any v); else the fastest that ran at all.

    `allowed` (a Baseline -> bool) prefers the runs that keep to the tuner's constraints when any ran.
    """
    runs = [b for b in baselines if b.name == name and b.split == split and b.outcome is not None]
    if allowed is not None and any(allowed(b) for b in runs):
        runs = [b for b in runs if allowed(b)]
    if not runs:
        return None
    fitting = [b for b in runs if b.outcome.fits]
    return min(fitting or runs, key=lambda b: b.outcome.step_ms)


def baseline_ms(baselines) -> float | None:
    """Step time of Megatron interleaved 1F1B on the Megatron split at its best v (fitting runs first)."""
    b = best_of(baselines, *BASELINE)
    return None if b is None else b.outcome.step_ms


def sota_ms(baselines, names=SOTA) -> float | None:
    """Fastest fitting ZB-V / DualPipeV / interleaved zero-bubble / combined 1F1B run (any v), balanced split."""
    runs = [b.outcome.step_ms for b in baselines if b.name in names and b.split == "balanced"
            and b.outcome is not None and b.outcome.fits]
    return min(runs) if runs else None


def best_builtin_ms(baselines) -> float | None:
    """Fastest fitting built-in run of any schedule, split and v."""
    runs = [b.outcome.step_ms for b in baselines if b.outcome is not None and b.outcome.fits]
    return min(runs) if runs else None


def comparison_rows(result, cluster=None) -> list[Row]:
    """OctoPipe first, then each built-in schedule on the Megatron and the balanced split.

    With the `cluster` the plans were tuned for, notes say which built-ins the tuner's
    constraints exclude and which fit only without the cluster's memory headroom.
    """
    base = baseline_ms(result.baselines)
    cons = getattr(result, "constraints", None)
    rows = [Row(label="OctoPipe (tuned)", schedule="octopipe", split="tuned",
                stages_per_device=per_device(result.plan), step_ms=result.step_ms,
                bubble=result.bubble, peak_bytes=max(result.peak), fits=True,
                speedup=base / result.step_ms if base else None,
                note="" if result.source == "octopipe" else f"= {result.source}")]
    for name in SCHEDULES:  # the registry's order (gpipe ... dualpipev, combined-1f1b), one row pair each
        for split in ("megatron", "balanced"):
            rows.append(_noted(_row(result.baselines, name, split, base, cons, cluster), cons, cluster))
    return rows


def _excluded(cons, cluster, name: str, v) -> str:
    """The options that exclude a built-in run ('' when none does, or without constraints)."""
    if cons is None or not cons.active or cluster is None or not isinstance(v, int) or v < 1:
        return ""
    from ..schedules.registry import SCHEDULES

    return cons.excludes_builtin(SCHEDULES[name], cluster.num_devices, v)


def _noted(row: Row, cons, cluster) -> Row:
    """The row with what the constraints and the headroom say of it added to its note."""
    notes = [row.note] if row.note else []
    why = _excluded(cons, cluster, row.schedule, row.stages_per_device) if row.step_ms is not None else ""
    if why:
        notes.append(f"excluded by {why}")
    if cluster is not None and cluster.memory_headroom_bytes and row.peak_bytes is not None and not row.fits \
            and row.peak_bytes <= cluster.memory_bytes:
        notes.append(f"fits only without the {cluster.memory_headroom_bytes / 2**30:.1f} GiB headroom")
    return replace(row, note="; ".join(notes))


def _row(baselines, name, split, base, cons=None, cluster=None) -> Row:
    b = best_of(baselines, name, split,
                None if cons is None else (lambda x: not _excluded(cons, cluster, x.name, x.stages_per_device)))
    label = f"{name} ({split})"
    if b is None:
        why = next((x.reason for x in baselines if x.name == name and x.split == split), "not run")
        return Row(label=label, schedule=name, split=split, stages_per_device=0, step_ms=None, bubble=None,
                   peak_bytes=None, fits=False, speedup=None, note=why)
    o = b.outcome
    return Row(label=label, schedule=name, split=split, stages_per_device=b.stages_per_device, step_ms=o.step_ms,
               bubble=o.bubble, peak_bytes=o.max_peak, fits=o.fits,
               speedup=base / o.step_ms if base else None,
               note="baseline" if (name, split) == BASELINE else "")


def per_device(plan) -> int | str:
    """Stages per device of a plan: one number when every device holds as many, else 'lo-hi'."""
    counts = [len(plan.stages_of(d)) for d in range(plan.num_devices)]
    lo, hi = min(counts), max(counts)
    return lo if lo == hi else f"{lo}-{hi}"


def format_table(rows: list[Row], memory_bytes: int, headroom_bytes: int = 0) -> str:
    """The comparison as aligned text."""
    head = f"{'schedule':<28} {'v':>3} {'step ms':>10} {'bubble':>7} {'peak GiB':>9} {'fits':>4} {'speedup':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.step_ms is None:
            lines.append(f"{r.label:<28} {'-':>3} {'-':>10} {'-':>7} {'-':>9} {'-':>4} {'-':>8}  {r.note[:60]}")
            continue
        sp = f"{r.speedup:.2f}x" if r.speedup else "-"
        lines.append(f"{r.label:<28} {r.stages_per_device!s:>3} {r.step_ms:>10.1f} {r.bubble:>7.1%} "
                     f"{r.peak_bytes / 2**30:>9.1f} {'yes' if r.fits else 'NO':>4} {sp:>8}  {r.note}")
    room = (f"{(memory_bytes - headroom_bytes) / 2**30:.1f} GiB usable per device ({memory_bytes / 2**30:.1f} GiB "
            f"less {headroom_bytes / 2**30:.1f} GiB headroom)" if headroom_bytes else
            f"memory per device {memory_bytes / 2**30:.1f} GiB")
    lines.append(f"({room}; speedup = baseline step / step, "
                 f"baseline = interleaved-1f1b on the Megatron split, best v)")
    return "\n".join(lines)
