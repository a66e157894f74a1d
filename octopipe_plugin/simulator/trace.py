"""Chrome / Perfetto trace of a simulated plan: one process per device with a compute track,
a send track and a memory counter (open in ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import json
import os

from .core import SimOptions, SimResult, detailed

_US = 1000.0  # trace timestamps are microseconds, simulator times milliseconds
_COMPUTE_TID, _SEND_TID = 0, 1
_COLOURS = {"F": "thread_state_running", "B": "thread_state_iowait", "I": "rail_load", "W": "rail_idle"}


def trace_events(plan, result: SimResult) -> list[dict]:
    """The trace's events: metadata, compute slices, transfer slices and memory counters."""
    events: list[dict] = []
    critical = set(result.critical_path)  # (device, action): a split layer's shard action runs on several devices
    for d in range(plan.num_devices):
        events += _metadata(d)
        for a, start, end in result.timeline[d]:
            events.append({
                "name": str(a), "cat": a.kind.value, "ph": "X", "pid": d, "tid": _COMPUTE_TID,
                "ts": start * _US, "dur": (end - start) * _US, "cname": _COLOURS.get(a.kind.value, "generic_work"),
                "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind.value,
                         "critical_path": (d, a) in critical},
            })
        for t, nbytes in result.memory_curve(d):
            events.append({"name": "memory", "ph": "C", "pid": d, "ts": t * _US,
                           "args": {"GiB": round(nbytes / 2**30, 6)}})
    for tr in result.transfers:
        events.append({
            "name": f"{tr.label} -> dev{tr.dst}", "cat": "transfer", "ph": "X", "pid": tr.src, "tid": _SEND_TID,
            "ts": tr.start * _US, "dur": (tr.end - tr.start) * _US,
            "args": {"src": tr.src, "dst": tr.dst, "label": tr.label},
        })
    return events


def _metadata(d: int) -> list[dict]:
    return [
        {"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}},
        {"name": "process_sort_index", "ph": "M", "pid": d, "args": {"sort_index": d}},
        {"name": "thread_name", "ph": "M", "pid": d, "tid": _COMPUTE_TID, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": d, "tid": _SEND_TID, "args": {"name": "send"}},
    ]


def trace_document(model, cluster, plan, options: SimOptions | None = None, result: SimResult | None = None) -> dict:
    """The whole trace as a JSON-ready dict (simulating the plan unless `result` is given)."""
    res = detailed(model, cluster, plan, options, result)
    return {
        "traceEvents": trace_events(plan, res),
        "displayTimeUnit": "ms",
        "otherData": {"model": plan.model, "step_time_ms": res.step_time_ms, "bubble_ratio": res.bubble_ratio,
                      "schedule": plan.meta.get("schedule", "custom")},
    }


def write_trace(model, cluster, plan, path, options: SimOptions | None = None,
                result: SimResult | None = None) -> None:
    """Write the Chrome/Perfetto JSON trace of a plan to `path`."""
    doc = trace_document(model, cluster, plan, options, result)
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
