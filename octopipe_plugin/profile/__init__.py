"""Measured costs: per-layer profiler, on-disk cache and calibration of the analytic model.

Core code: imports torch only; Megatron and DeepSpeed layers reach it through
`octopipe_plugin.adapters.*.profile`, which build `ProfileLayer`s from their specs.
"""

from .cache import ProfileCache, default_cache_dir
from .layer import ProfileLayer, module_signature
from .measure import LayerProfile, measure_layer
from .profiler import ProfileResult, ProfileSettings, ProfileStats, profile_layers
from .timing import Timing

__all__ = [
    "LayerProfile", "ProfileCache", "ProfileLayer", "ProfileResult", "ProfileSettings", "ProfileStats", "Timing",
    "default_cache_dir", "measure_layer", "module_signature", "profile_layers",
]
