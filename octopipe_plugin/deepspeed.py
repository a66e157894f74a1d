"""`import octopipe_plugin.deepspeed`: the one import a DeepSpeed user adds.

After it, `deepspeed.initialize(model=pipeline_module, config=ds_config, ...)` returns an
`OctoPipeEngine` running the plan of the config's `"octopipe"` block (see
octopipe_plugin/adapters/deepspeed/config.py for its fields); without the block, or with
`"enabled": false`, DeepSpeed behaves exactly as before. Which DeepSpeed names are replaced, and
why: `octopipe_plugin.deepspeed.installed()` (adapters/deepspeed/hooks.py).
"""

from .adapters.deepspeed.config import OctoPipeBlock, TuneSpec, parse_block
from .adapters.deepspeed.engine import OctoPipeEngine
from .adapters.deepspeed.hooks import install, installed
from .adapters.deepspeed.module import OctoPipePipelineModule

install()

__all__ = ["OctoPipeBlock", "OctoPipeEngine", "OctoPipePipelineModule", "TuneSpec", "install", "installed",
           "parse_block"]
