"""PNG Gantt chart of a simulated plan (matplotlib, Agg backend).

Each device gets a row of compute boxes coloured by kind (F, B, I, W; later virtual stages of
a device in a lighter shade) with the micro-batch number inside when it fits, idle time shown
as hatching behind the boxes, and under it a strip with the device's memory over time (static
state + live activations) scaled to the cluster's memory, whose limit is the strip's top (a
dashed line marks the usable memory when the cluster keeps headroom). Each row is labelled
with the device and the layer ranges its stages hold; the legend explains colours and shades.
Rows thin out and fonts shrink with the device count, so 16-64 devices stay legible; dotted
lines separate nodes.
"""

from __future__ import annotations

import os

from ..actions import KINDS, RULES
from .core import SimOptions, SimResult, detailed

KIND_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
KIND_NAMES = {"F": "forward", "B": "backward (fused)", "I": "input-grad backward", "W": "weight-grad backward"}
_OTHER = "#8C8C8C"  # a kind without a colour of its own
_ROW = 1.2  # height of one device band: compute box, memory strip and a gap
_BOX = (0.55, 0.5)  # (bottom offset, height) of the compute boxes within a band
_MEM = (0.08, 0.42)  # (bottom offset, height) of the memory strip


def _lighter(hex_colour: str, amount: float) -> tuple[float, float, float]:
    """Mix a colour with white; amount 0 keeps it, 1 makes it white."""
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)


def _row_inches(num_devices: int) -> float:
    """Height of one device row: roomy for a few devices, thinner for many (64 rows fit ~22 inches)."""
    return 0.75 if num_devices <= 8 else 0.5 if num_devices <= 24 else 0.32


def _hatch(num_devices: int) -> str:
    """Idle hatching: sparser on thin rows, where dense lines would drown the boxes."""
    return "////" if num_devices <= 16 else "//"


def _font(num_devices: int) -> float:
    return 7.0 if num_devices <= 16 else 6.0 if num_devices <= 32 else 5.0


def device_label(plan, device: int, most: int = 3) -> str:
    """'dev 3  L4-6, L29-31' (the layers each stage of the device holds, in model order), abridged past `most`."""
    ranges = [f"L{st.start}-{st.end - 1}" if st.end - st.start > 1 else f"L{st.start}"
              for st in plan.stages if st.device == device and st.end > st.start]
    shown = ", ".join(ranges[:most]) + (f", +{len(ranges) - most}" if len(ranges) > most else "")
    return f"dev {device}  {shown or 'idle'}"


def draw(ax, plan, result: SimResult, memory_bytes: int, usable_bytes: int | None = None,
         devices_per_node: int | None = None) -> None:
    """Draw the chart of `result` on a matplotlib axis (usable memory and node lines when given)."""
    nd, step = plan.num_devices, result.step_time_ms or 1.0
    chunk = _chunk_of_stage(plan)
    v = max(chunk) + 1 if chunk else 1
    mem_scale = max([memory_bytes] + list(result.peak_memory_bytes)) or 1
    width_pts = ax.figure.get_figwidth() * 72 * 0.85
    for d in range(nd):
        base = (nd - 1 - d) * _ROW
        ax.broken_barh([(0, step)], (base + _BOX[0], _BOX[1]), facecolors="none", edgecolor="#bbbbbb",
                       hatch=_hatch(nd), linewidth=0.0)
        _draw_boxes(ax, result.timeline[d], base, chunk, v, step, width_pts)
        _draw_memory(ax, result, d, base, step, mem_scale, memory_bytes, usable_bytes, _font(nd) - 1)
    if devices_per_node and devices_per_node < nd:
        for d in range(devices_per_node, nd, devices_per_node):  # between device d-1 and d
            y = (nd - d) * _ROW - 0.04
            ax.plot([0, step], [y, y], color="#444444", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, step * 1.001)
    ax.set_ylim(-0.1, nd * _ROW)
    ax.set_yticks([(nd - 1 - d) * _ROW + _BOX[0] + _BOX[1] / 2 for d in range(nd)])
    ax.set_yticklabels([device_label(plan, d) for d in range(nd)], fontsize=_font(nd))
    ax.set_xlabel("time (ms)")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _chunk_of_stage(plan) -> list[int]:
    """Index of each stage among its device's stages (0 for the first, 1 for the second...)."""
    seen: dict[int, int] = {}
    out = []
    for st in plan.stages:
        out.append(seen.get(st.device, 0))
        seen[st.device] = out[-1] + 1
    return out


def _draw_boxes(ax, row, base: float, chunk: list[int], v: int, step: float, width_pts: float) -> None:
    spans, colours = [], []
    for a, start, end in row:
        spans.append((start, end - start))
        colours.append(_lighter(KIND_COLOURS.get(a.kind.value, _OTHER), 0.45 * chunk[a.stage] / max(v - 1, 1)))
    if spans:
        ax.broken_barh(spans, (base + _BOX[0], _BOX[1]), facecolors=colours, edgecolor="white", linewidth=0.4)
    for a, start, end in row:
        box_pts = (end - start) / step * width_pts
        text = str(a.microbatch)
        size = min(8.0, box_pts / (0.65 * len(text) + 0.4))
        if size >= 3.5:
            ax.text((start + end) / 2, base + _BOX[0] + _BOX[1] / 2, text, ha="center", va="center",
                    fontsize=size, color="white", clip_on=True)


def _draw_memory(ax, result: SimResult, d: int, base: float, step: float, scale: int, limit: int,
                 usable: int | None = None, fontsize: float = 6.0) -> None:
    pts = result.memory_curve(d) + [(step, None)]
    xs = [t for t, _ in pts]
    ys = [base + _MEM[0] + _MEM[1] * (b if b is not None else pts[-2][1]) / scale for _, b in pts]
    bottom = base + _MEM[0]
    ax.fill_between(xs, bottom, ys, step="post", color="#8172B3", alpha=0.35, linewidth=0)
    ax.step(xs, ys, where="post", color="#5a4e8c", linewidth=0.7)
    if limit <= scale:
        y_lim = bottom + _MEM[1] * limit / scale
        ax.plot([0, step], [y_lim, y_lim], color="#999999", linewidth=0.5, linestyle="--")
    if usable is not None and usable < limit:
        y_use = bottom + _MEM[1] * usable / scale
        ax.plot([0, step], [y_use, y_use], color="#C44E52", linewidth=0.6, linestyle="--")
    peak = result.peak_memory_bytes[d]
    ax.text(step * 1.003, bottom + _MEM[1] / 2, f"{peak / 2**30:.1f}/{(usable or limit) / 2**30:.0f} GiB",
            fontsize=fontsize, va="center", ha="left",
            color="#C44E52" if usable is not None and peak > usable else "#5a4e8c", clip_on=False)


def _legend(ax, result: SimResult, plan=None, headroom: bool = False) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    used = sorted({a.kind for row in result.timeline for a, _, _ in row}, key=KINDS.index)
    handles = [Patch(facecolor=KIND_COLOURS.get(k.value, _OTHER),
                     label=f"{k.value} {KIND_NAMES.get(k.value, RULES[k].noun)}") for k in used]
    v = max(_chunk_of_stage(plan)) + 1 if plan is not None and plan.stages else 1
    if v > 1:  # the shades: a device's first stage in the full colour, its later ones lighter
        first = KIND_COLOURS.get(used[0].value, _OTHER) if used else KIND_COLOURS["F"]
        later = "2nd stage" if v == 2 else f"later stages (2nd..{v}th)"
        handles.append(Patch(facecolor=_lighter(first, 0.45),
                             label=f"lighter shade: the device's {later}, layers as listed at left"))
    nd = plan.num_devices if plan is not None else 1
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", hatch=_hatch(nd), label="idle"))
    handles.append(Patch(facecolor="#8172B3", alpha=0.35, label="memory (strip top = device memory)"))
    if headroom:
        handles.append(Line2D([0], [0], color="#C44E52", linewidth=0.8, linestyle="--",
                              label="usable memory (device less headroom)"))
    ncol = len(handles) if len(handles) <= 5 else (len(handles) + 1) // 2
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol, fontsize=7,
              frameon=False)


def write_png(model, cluster, plan, path, options: SimOptions | None = None, result: SimResult | None = None,
              title: str | None = None) -> None:
    """Simulate `plan` (unless `result` is given) and write its Gantt chart to `path` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = detailed(model, cluster, plan, options, result)
    nd = plan.num_devices
    fig, ax = plt.subplots(figsize=(min(24.0, 10 + 0.05 * max(len(r) for r in plan.schedule)),
                                    1.4 + _row_inches(nd) * nd))
    usable = getattr(cluster, "usable_memory_bytes", cluster.memory_bytes)
    try:
        draw(ax, plan, res, cluster.memory_bytes, usable if usable < cluster.memory_bytes else None,
             cluster.devices_per_node)
        _legend(ax, res, plan, headroom=usable < cluster.memory_bytes)
        name = plan.meta.get("schedule", "custom schedule")
        ax.set_title(title or f"{plan.model}: {name}, {nd} devices x {plan.num_microbatches} micro-batches, "
                              f"{plan.num_stages} stages - step {res.step_time_ms:.2f} ms, "
                              f"bubble {res.bubble_ratio:.1%}", fontsize=9, pad=30 if len(ax.get_legend().legend_handles) > 5
                                                                       else 18)
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=130)
    finally:
        plt.close(fig)
