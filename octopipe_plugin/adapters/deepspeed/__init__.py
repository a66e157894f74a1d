"""DeepSpeed adapter: a plan's stage boundaries as a PipelineModule's partition.

`plan_parts` and `octopipe_config` are plain Python; `OctoPipePipelineModule` imports
DeepSpeed on first access.
"""

from .partition import layer_starts, load_parts, octopipe_config, plan_parts


def __getattr__(name):
    if name == "OctoPipePipelineModule":
        from .module import OctoPipePipelineModule

        return OctoPipePipelineModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OctoPipePipelineModule", "layer_starts", "load_parts", "octopipe_config", "plan_parts"]
