"""Unified pipeline executor: any plan (placement + per-device F/B/I/W list) over torch.distributed.

API (what the Megatron and DeepSpeed adapters build on):

- `PipelineExecutor(plan, runner, *, group=None, device="cpu", options=ExecutorOptions(),
  cache=None, on_last_backward=None)`: one rank's share of `plan` over the ranks of
  `group`. The plan is validated and checked for deadlock before anything is sent.
  `on_last_backward(stage)` runs right after a stage's last B or W of a training step (its
  weight gradients are final: start its gradient reduction there); a runner method that
  accepts `last_backward=` is told so *before* that call. The runner's interface is checked
  here (`check_runner`: one `RunnerInterfaceError` naming class, method and what is missing).
- `run_step(data=None, *, forward_only=False, num_microbatches=None) -> StepResult`: `data`
  is this step's data source: one iterable of micro-batches shared by the rank's stages, a
  mapping stage -> iterable (Megatron's per-chunk iterators), or None (the runner loads its
  own); each forward gets micro-batch mb as `batch`. `forward_only` (evaluation) runs only
  the plan's forwards in the plan's order (`forward_plan`; with another `num_microbatches`,
  in (micro-batch, stage) order), keeps no activations and sends no gradients.
- `lowered_plan(plan, rank) -> LoweredPlan`: everything derived from the plan for one rank,
  built once (messages, programs, pairs, `last_backward`, `first_rank`, `loss_rank`);
  `format_lowered` prints its program; `check_nccl_rules(plan)` replays a step under NCCL's
  rules.
  `StepResult.outputs[mb]` is the last stage's `LossOutput` (scaled loss, `num_tokens`,
  the loss function's dict in `logs`, its own return value in `raw`); `loss`,
  `losses`, `logs` and `num_tokens` summarise them (empty / None off the last stage).
- `StageRunner` (interface.py): the per-stage protocol the executor drives. Boundary
  values are a tensor or a tuple / list / dict of tensors; `boundary_meta(stage)` declares
  them as `TensorMeta` (shape, dtype, `requires_grad`; gradients travel back only for
  leaves that need them), or returns None to have the meta sent once per step ahead of
  the boundary's first activation (shapes may change between steps, not within one).
- `TorchStages` / `ForwardStepStages`: runners over plain modules and over a Megatron-style
  `forward_step_func`; `grad_sink='autograd'` (default) accumulates weight gradients
  through autograd's AccumulateGrad, so grad-accumulator hooks fire once per parameter and
  micro-batch also under split I/W; `'direct'` adds them into `p.grad` itself. Both, and the
  adapters' `MegatronStages` / `DeepSpeedStages`, fill the hooks of one life cycle,
  `stage_core.StageCore` (typed per-(stage, micro-batch) states, the first stage's "W does it all").
- Plans with split layers (docs/formats.md, "Split layers"): shard actions call the runner's
  optional shard methods (`interface.SHARD_METHODS`); their hand-overs travel with the stage
  messages in one per-pair order (`split_program.py`); with a split head every head shard's rank
  reports the loss (its J). The head's owner hands every shard a `HeadInput(hidden, targets,
  coef)` (head_input.py; `loss_coefficients(rule, ...)` gives coef from a loss rule). `VocabShards`
  (vocab_shard.py) is a rank's shard math in plain torch, run by any StageCore runner built with
  `shards=`; `SplitTorchStages` is the plain-module runner. Evaluation steps of split plans run
  F, H, J (the loss only) and E.
- `CommCache` (`default_cache()` unless given): per-direction process groups (NCCL, or
  gloo with `ExecutorOptions(pair_groups=True)`), made once per rank pair for every
  pipeline of the world (collective over the default group: every rank constructs its
  executors at the same point), and receive buffers kept per (plan, group), so later
  steps and further executors on the same plan open no communicator; each direction group
  is warmed when made, all ranks in the world's sorted pair order (`eager_comms`). Received
  tensors are valid until the next step.
"""

from .comm_cache import CommCache, default_cache
from .engine import ExecutorOptions, PipelineExecutor, StepResult, forward_plan
from .errors import ExecutorError
from .head_input import HeadInput, NonLinearLossRule, loss_coefficients
from .interface import LossOutput, RunnerInterfaceError, StageRunner, TensorMeta, check_runner
from .lowered import LoweredPlan, first_rank, loss_rank, lowered_plan
from .nccl_rules import check_nccl_rules
from .posting import format_lowered
from .program import RankProgram, Step, build_program
from .torch_stage import TorchStages
from .validate import check_runnable
from .vocab_shard import SplitTorchStages, TensorParallel, VocabShards

__all__ = [
    "CommCache", "default_cache", "ExecutorOptions", "PipelineExecutor", "StepResult", "forward_plan",
    "ExecutorError", "LossOutput", "StageRunner", "TensorMeta", "RankProgram", "Step", "build_program",
    "TorchStages", "check_runnable", "RunnerInterfaceError", "check_runner", "LoweredPlan", "lowered_plan",
    "loss_rank", "first_rank", "check_nccl_rules", "format_lowered", "SplitTorchStages", "VocabShards",
    "TensorParallel", "HeadInput", "NonLinearLossRule", "loss_coefficients",
]
