"""Cost models: the analytic default (GPU spec table x architecture), the model zoo and named clusters."""

from .analytic import LayerCost, build_model, layer_cost
from .arch import Arch, arch_from_dict, layer_plan
from .clusters import cost_gpu, named_cluster, resolve_cluster
from ..gpus import GPUS, GpuSpec, get_gpu
from .zoo import ZOO, load_arch, resolve_model, zoo_description

__all__ = [
    "Arch", "GPUS", "GpuSpec", "LayerCost", "ZOO", "arch_from_dict", "build_model", "cost_gpu", "get_gpu",
    "layer_cost", "layer_plan", "load_arch", "named_cluster", "resolve_cluster", "resolve_model", "zoo_description",
]
