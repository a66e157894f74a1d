"""What the runtime a plan is made for accepts: placement, stages per device, split backward.

One frozen `Constraints` value travels from the front end (the CLI's options, an adapter's
start-up) into `tune`, which keeps to it everywhere: seeds, moves, built-ins taken as its plan,
and the returned plan (checked once more before it is returned). Runtimes that need them:

- `placement="looped"`: Megatron's own model builders (stage s on rank s % P); `"v"`: the
  V-shape of ZB-V / DualPipeV; `"any"`: OctoPipe's executor.
- `uniform_stages_per_device`: the same number of stages on every rank (torch.pipelining and
  torchtitan schedules, Megatron's virtual pipeline).
- `max_stages_per_device`: at most N model chunks on a rank.
- `split_backward=False`: runtimes without a separate input-gradient (I) / weight-gradient (W).
- `owner_shard`: a split LM head's owner (the last stage's device) holds a shard of it: the
  Megatron and DeepSpeed runners report the loss through the framework's own loss function on
  the owner, from its shard's J (docs: /work/wt/SHARD_API.md's framework-side rules). Off for
  OctoPipe's executor (`SplitTorchStages` lets any shard report the loss).
- `split_embedding=False`: runners that split the LM head only (the Megatron stand-in benchmark's
  chunks, and DeepSpeed's on a layer list whose first entry is no plain untied nn.Embedding): the split
  search tries no embedding split.

`FRAMEWORK_SPLITS[framework]` is what each framework runner runs of a split plan, the one place
that says it (`framework_splits(name)`, then `replace(c, **...)`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType

from ..actions import Kind
from ..errors import OctoPipeError
from ..schedules.placement import Placement, place_stages

PLACEMENTS = ("looped", "v", "any")
# what each framework runner runs of a split plan (`replace(c, **framework_splits(name))`): the LM head's owner
# holds a shard (it reports the loss through the framework's own loss function); Megatron's and DeepSpeed's runners
# also split the embedding (adapters/megatron/split_embedding.py, adapters/deepspeed/head_split.py), the benchmarks'
# stand-ins not (testing/megatron_standin.py takes no fed embedding; the DeepSpeed engine's stand-in `shards=` sleep
# a split LM head only, adapters/deepspeed/module.py refuses an embedding split beside them)
FRAMEWORK_SPLITS = MappingProxyType({
    "megatron": MappingProxyType({"owner_shard": True, "split_embedding": True}),
    "megatron-stand-in": MappingProxyType({"owner_shard": True, "split_embedding": False}),
    "deepspeed": MappingProxyType({"owner_shard": True, "split_embedding": True}),
    "deepspeed-stand-in": MappingProxyType({"owner_shard": True, "split_embedding": False}),
})


def framework_splits(framework: str):
    """The Constraints fields of what `framework`'s runner runs of a split plan (FRAMEWORK_SPLITS)."""
    if framework not in FRAMEWORK_SPLITS:
        raise OctoPipeError(f"framework {framework!r}: expected one of {', '.join(FRAMEWORK_SPLITS)}")
    return FRAMEWORK_SPLITS[framework]
_SPLIT_KINDS = frozenset({Kind.I, Kind.W})


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraints:
    """Limits a plan must keep to; the default admits every plan."""

    placement: str = "any"  # "looped" | "v" | "any"
    max_stages_per_device: int | None = None
    # at least N model chunks on every rank: megatron-core's combined step at PP > 1 (it asks for a virtual pipeline)
    min_stages_per_device: int | None = None
    uniform_stages_per_device: bool = False
    split_backward: bool = True
    owner_shard: bool = False  # a split head's owner device holds one of its shards
    split_embedding: bool = True  # the runner runs a split input embedding

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise OctoPipeError(f"placement {self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if self.max_stages_per_device is not None and self.max_stages_per_device < 1:
            raise OctoPipeError(f"max stages per device {self.max_stages_per_device}: expected 1 or more")
        if self.min_stages_per_device is not None and self.min_stages_per_device < 1:
            raise OctoPipeError(f"min stages per device {self.min_stages_per_device}: expected 1 or more")

    @property
    def active(self) -> bool:
        """Whether any plan could be refused."""
        return self != Constraints()

    def placement_problem(self, devices, num_devices: int) -> str | None:
        """Why a stage -> device list breaks the constraints, or None."""
        if self.placement != "any" and list(devices) != place_stages(Placement(self.placement), num_devices,
                                                                      len(devices)):
            return f"stages are not placed {self.placement} (stage -> device {list(devices)[:12]}...)"
        if self.max_stages_per_device is None and self.min_stages_per_device is None and \
                not self.uniform_stages_per_device:
            return None
        counts = Counter(devices)
        per = [counts.get(d, 0) for d in range(num_devices)]
        if self.max_stages_per_device is not None and max(per) > self.max_stages_per_device:
            return f"a device holds {max(per)} stages, more than {self.max_stages_per_device}"
        if self.min_stages_per_device is not None and min(per) < self.min_stages_per_device:
            return f"a device holds {min(per)} stages, fewer than {self.min_stages_per_device}"
        if self.uniform_stages_per_device and len(set(per)) > 1:
            return f"devices hold different numbers of stages ({min(per)} to {max(per)})"
        return None

    def allows_devices(self, devices, num_devices: int) -> bool:
        """Whether a stage -> device list keeps to the constraints."""
        return self.placement_problem(devices, num_devices) is None

    def admits(self, layout, spec, num_devices: int) -> bool:
        """Whether a search candidate (a layout and a list-scheduling Policy or an explicit order) keeps to them."""
        if not self.active:
            return True
        if not self.allows_devices(layout.devices, num_devices):
            return False
        if self.split_backward:
            return True
        from .listsched import Policy, Split

        if isinstance(spec, Policy):
            return all(s is Split.FUSED for s in spec.split)
        return not any(a.kind in _SPLIT_KINDS for row in spec for a in row)

    def plan_problems(self, plan) -> list[str]:
        """Every way a plan breaks the constraints (empty when it keeps to them)."""
        out = []
        problem = self.placement_problem([st.device for st in plan.stages], plan.num_devices)
        if problem:
            out.append(problem)
        if not self.split_backward and any(a.kind in _SPLIT_KINDS for row in plan.schedule for a in row):
            out.append("the schedule splits backwards into I and W")
        problem = self.owner_shard_problem(plan)
        if problem:
            out.append(problem)
        if not self.split_embedding and any(sp.layer != plan.stages[-1].end - 1 for sp in plan.splits):
            out.append("the plan splits the input embedding (the runner splits the LM head only)")
        return out

    def owner_shard_problem(self, plan) -> str | None:
        """Why a plan's split LM head breaks `owner_shard` (its owner device holds no shard), or None."""
        if not self.owner_shard or not plan.splits:
            return None
        last, owner = plan.stages[-1].end - 1, plan.stages[-1].device
        for sp in plan.splits:
            if sp.layer == last and owner not in sp.devices:
                return (f"the split LM head (layer {last}) has no shard on its owner's device {owner} "
                        f"(shards on {list(sp.devices)[:12]})")
        return None

    def allows_plan(self, plan) -> bool:
        """Whether a plan keeps to the constraints (cheap when none is set)."""
        return not self.active or not self.plan_problems(plan)

    def excludes_builtin(self, spec, num_devices: int, stages_per_device: int) -> str:
        """Why a built-in schedule at v stages per device is excluded ('' when it is not), as the options."""
        why = []
        devices = place_stages(spec.placement, num_devices, num_devices * stages_per_device)
        if self.placement != "any" and devices != place_stages(Placement(self.placement), num_devices, len(devices)):
            why.append(f"--placement {self.placement}")
        if self.max_stages_per_device is not None and stages_per_device > self.max_stages_per_device:
            why.append(f"--max-stages-per-device {self.max_stages_per_device}")
        if not self.split_backward and spec.uses_split_backward:
            why.append("--no-split-backward")
        return ", ".join(why)

    def describe(self) -> str:
        """The constraints as the CLI options that set them ('none' when inactive)."""
        parts = []
        if self.placement != "any":
            parts.append(f"--placement {self.placement}")
        if self.max_stages_per_device is not None:
            parts.append(f"--max-stages-per-device {self.max_stages_per_device}")
        if self.uniform_stages_per_device:
            parts.append("--uniform-stages-per-device")
        if not self.split_backward:
            parts.append("--no-split-backward")
        if self.owner_shard:
            parts.append("owner-shard (a split head's owner holds a shard: framework runners)")
        if not self.split_embedding:
            parts.append("no-split-embedding (the runner splits the LM head only)")
        return " ".join(parts) or "none"

    def as_dict(self) -> dict:
        """JSON form."""
        return {"placement": self.placement, "max_stages_per_device": self.max_stages_per_device,
                "uniform_stages_per_device": self.uniform_stages_per_device, "split_backward": self.split_backward,
                "owner_shard": self.owner_shard, "split_embedding": self.split_embedding}
