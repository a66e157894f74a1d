"""The best plan each framework runs unmodified, found among the built-in runs of a tuning result.

The headline gain over Megatron's interleaved 1F1B on its even split flatters a tuner: a balanced
split alone buys much of it. These are the honest references, the fastest fitting plan a user
gets without OctoPipe's executor:

- Megatron: its own schedule (interleaved 1F1B, or 1F1B at v = 1) on a looped placement with the
  same number of virtual stages per rank, on any boundaries a `--pipeline-model-parallel-layout`
  string can express (the even split and the balanced split are both such strings).
- DeepSpeed: its PipelineEngine's 1F1B, one stage per rank, on the better of the two splits.
"""

from __future__ import annotations

from dataclasses import dataclass

# framework -> (built-in schedules it runs as they are, stages per device it takes: None for any)
NATIVE = {
    "megatron": (("interleaved-1f1b", "1f1b"), None),
    "deepspeed": (("1f1b",), 1),
}
WHAT = {
    "megatron": "stock Megatron",
    "deepspeed": "stock DeepSpeed",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class NativeBest:
    """The fastest fitting built-in run a framework runs unmodified."""

    framework: str
    schedule: str
    split: str
    stages_per_device: int
    step_ms: float
    peak_bytes: int

    def describe(self) -> str:
        """'interleaved-1f1b, balanced layout, v=2' (DeepSpeed: 'balanced partition')."""
        where = "partition" if self.framework == "deepspeed" else "layout"
        return f"{self.schedule}, {self.split} {where}, v={self.stages_per_device}"


def native_best(baselines, framework: str) -> NativeBest | None:
    """The fastest fitting run among `baselines` that `framework` runs unmodified; None when none fits."""
    names, v = NATIVE[framework]
    runs = [b for b in baselines if b.name in names and b.outcome is not None and b.outcome.fits
            and (v is None or b.stages_per_device == v)]
    if not runs:
        return None
    b = min(runs, key=lambda r: r.outcome.step_ms)
    return NativeBest(framework=framework, schedule=b.name, split=b.split, stages_per_device=b.stages_per_device,
                      step_ms=b.outcome.step_ms, peak_bytes=b.outcome.max_peak)
