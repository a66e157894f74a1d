"""Unified pipeline executor: any plan (placement + per-device F/B/I/W list) over torch.distributed."""

from .engine import ExecutorOptions, PipelineExecutor, StepResult
from .errors import ExecutorError
from .interface import StageRunner, TensorMeta
from .program import RankProgram, Step, build_program
from .torch_stage import TorchStages
from .validate import check_runnable

__all__ = [
    "ExecutorOptions", "PipelineExecutor", "StepResult", "ExecutorError", "StageRunner", "TensorMeta",
    "RankProgram", "Step", "build_program", "TorchStages", "check_runnable",
]
