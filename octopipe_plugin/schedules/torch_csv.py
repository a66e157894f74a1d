"""Which plans torch.distributed.pipelining's CSV runtime and torchtitan's stage assignment can run.

`_PipelineScheduleRuntime._load_csv` reads one row of actions per rank (our notation is
torch's: `2F0`, `1I3`, `0W1`, `3B2`) and lowers it with torch's own send/recv passes; the
stages of a rank are whatever the runtime was given. torchtitan builds those stages itself:
`stage_ids_this_rank` gives rank r the stages r, r + P, r + 2P, ... ("loop", used for CSV
schedules and every looped schedule) or, for the V schedules, exactly r and 2P - 1 - r ("v").
Torch's runtime also keeps the last stage's losses by position: the k-th forward of the last
stage must be micro-batch k, or a backward would start from another micro-batch's loss.
"""

from __future__ import annotations

import csv
import io

STYLES = ("loop", "v")


def plan_to_torch_csv(plan) -> str:
    """The plan's per-device action lists as torch's compute-only CSV text (one row per rank)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in plan.schedule:
        writer.writerow([str(a) for a in row])
    return buf.getvalue()


def torch_csv_problems(plan, style: str = "loop") -> list[str]:
    """Why torch's CSV runtime under torchtitan's `style` stage assignment cannot run `plan` (empty: it can)."""
    p, ns = plan.num_devices, plan.num_stages
    devices = [st.device for st in plan.stages]
    out = []
    if style == "loop":
        if ns % p:
            out.append(f"{ns} stages on {p} ranks: torchtitan gives every rank the same number of stages "
                       f"(a multiple of {p})")
        elif devices != [s % p for s in range(ns)]:
            out.append(f"stages placed {devices[:2 * p]}{'...' if ns > 2 * p else ''}: torchtitan's 'loop' "
                       f"assignment puts stage s on rank s % {p}; tune with --placement looped "
                       f"--uniform-stages-per-device")
    elif style == "v":
        want = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
        if devices != want:
            out.append(f"stages placed {devices[:2 * p]}{'...' if ns > 2 * p else ''}: torchtitan's 'v' assignment "
                       f"is exactly two stages per rank, r and {2 * p - 1} - r; tune with --placement v "
                       f"--max-stages-per-device 2 --uniform-stages-per-device")
    else:
        out.append(f"style {style!r}: expected one of {', '.join(STYLES)}")
    last = [a.microbatch for row in plan.schedule for a in row if a.stage == ns - 1 and a.kind.value == "F"]
    if last != sorted(last):
        out.append("the last stage runs its forwards out of micro-batch order; torch's runtime keeps their "
                   "losses by position, so a backward would take another micro-batch's loss")
    return out
