"""Graph-based pipeline simulator: step time, bubbles, critical path and memory of any plan."""

from .core import SimOptions, SimResult, Transfer, simulate
from .costs import StageCosts, stage_costs

__all__ = ["SimOptions", "SimResult", "Transfer", "simulate", "StageCosts", "stage_costs"]
