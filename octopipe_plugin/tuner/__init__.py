"""Iterative bubble-aware tuner: co-optimises partition, placement and per-device schedules."""

from .bounds import Bound, lower_bound
from .listsched import Order, Policy, Split, WFill, build_schedule
from .search import Progress, TuneResult, tune

__all__ = ["Bound", "lower_bound", "Order", "Policy", "Split", "WFill", "build_schedule", "Progress",
           "TuneResult", "tune"]
