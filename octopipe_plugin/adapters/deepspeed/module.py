"""`OctoPipePipelineModule`: a DeepSpeed PipelineModule partitioned at an OctoPipe plan's boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from deepspeed.runtime.pipe.module import PipelineModule

from ...errors import OctoPipeError


class OctoPipePipelineModule(PipelineModule):
    """A PipelineModule whose stage s builds exactly LayerSpecs parts[s]:parts[s+1].

    PipelineModule.__init__ partitions (via `_partition_layers`) before it builds any layer,
    so the boundaries are fixed before that call and every rank builds only its own layers.
    """

    def __init__(self, layers, *, parts: Sequence[int], **kwargs):
        if "num_stages" in kwargs or "partition_method" in kwargs:
            raise OctoPipeError("OctoPipePipelineModule: num_stages and partition_method come from `parts`")
        # Plain attribute set before nn.Module.__init__: read by _partition_layers during super().__init__.
        self._octopipe_parts = tuple(int(p) for p in parts)
        if kwargs.get("topology") is None:
            kwargs["num_stages"] = len(self._octopipe_parts) - 1
        super().__init__(layers=layers, partition_method="octopipe", **kwargs)

    def _partition_layers(self, method: str = "octopipe") -> None:
        """Take the plan's boundaries instead of DeepSpeed's uniform/parameters/type split."""
        parts = list(self._octopipe_parts)
        if len(parts) != self.num_stages + 1:
            raise OctoPipeError(f"parts {parts} describe {len(parts) - 1} stages, the pipeline has {self.num_stages}")
        if parts[0] != 0 or parts[-1] != len(self._layer_specs) or parts != sorted(parts):
            raise OctoPipeError(f"parts {parts}: expected non-decreasing indices from 0 to the layer count "
                                f"{len(self._layer_specs)}")
        self.parts = parts
        self._set_bounds(start=parts[self.stage_id], stop=parts[self.stage_id + 1])
