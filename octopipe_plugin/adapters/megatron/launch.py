"""Hooking OctoPipe into megatron.training without changing a Megatron file (what the launcher installs).

Megatron-LM's pretrain scripts call `megatron.training.arguments.parse_args` (through
`parse_and_validate_args`) and `megatron/training/training.py` calls the module-level name
`get_forward_backward_func` in train() and evaluate(). `install()` replaces those two names:
the parser also takes OctoPipe's arguments and resolves the plan before Megatron validates
them (startup.py), and the schedule factory returns OctoPipe's schedule when the run says
`--pipeline-schedule octopipe` (Megatron's own otherwise). patches/ does the same by editing
the two files; both routes call the functions below.
"""

from __future__ import annotations

import functools

from .arguments import add_octopipe_args, chain_providers
from .compat import allow_megatron_training_import
from .mapping import plan_of_args
from .startup import resolve_octopipe_plan


def parse_args_with_octopipe(original):
    """Megatron's parse_args taking OctoPipe's arguments too and resolving the plan (main parse only)."""
    if getattr(original, "octopipe", False):
        return original

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(chain_providers(extra_args_provider, add_octopipe_args), ignore_unknown_args)
        # fault-tolerance and in-process-restart helpers re-parse with ignore_unknown_args=True to read a few
        # flags; the plan is resolved once, by the script's own parse
        return args if ignore_unknown_args else resolve_octopipe_plan(args)

    parse_args.octopipe = True
    return parse_args


def get_forward_backward_func(*args, **kwargs):
    """Megatron's schedule factory, returning OctoPipe's schedule under `--pipeline-schedule octopipe`."""
    from megatron.training import get_args

    run = get_args()
    if getattr(run, "pipeline_schedule", "default") == "octopipe":
        from .schedule import get_octopipe_forward_backward_func

        return get_octopipe_forward_backward_func(plan_of_args(run), *args, **kwargs)
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_factory

    return megatron_factory(*args, **kwargs)


def install() -> None:
    """Make megatron.training take OctoPipe's arguments and schedule (idempotent)."""
    allow_megatron_training_import()
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    arguments.parse_args = parse_args_with_octopipe(arguments.parse_args)
    training.get_forward_backward_func = get_forward_backward_func
    install_model_hooks()


def install_model_hooks() -> None:
    """Model construction under plans with any stage->rank map (pretrain_hooks; looped plans pass through)."""
    import megatron.core.parallel_state as parallel_state
    import megatron.training.training as training
    from megatron.training.models.gpt import GPTModelBuilder

    from .pretrain_hooks import wrap_get_model, wrap_gpt_builder, wrap_initialize_model_parallel

    parallel_state.initialize_model_parallel = wrap_initialize_model_parallel(parallel_state.initialize_model_parallel)
    training.get_model = wrap_get_model(training.get_model)
    wrap_gpt_builder(GPTModelBuilder)
