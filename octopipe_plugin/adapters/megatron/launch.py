"""Hooking OctoPipe into megatron.training without changing a Megatron file (what the launcher installs).

Megatron-LM's pretrain scripts call `megatron.training.arguments.parse_args` (through
`parse_and_validate_args`) and `megatron/training/training.py` calls the module-level name
`get_forward_backward_func` in train() and evaluate(). For a `--pipeline-schedule octopipe` run,
`install()` has hooks.py replace those two names: the parser also takes OctoPipe's arguments and
resolves the plan before Megatron validates them (startup.py), and the schedule factory returns
OctoPipe's schedule. `prepare_launch(argv)` decides from the command line: any other run is left
to Megatron untouched (nothing installed). patches/ does the same by editing the two files; both
routes call the functions below.
"""

from __future__ import annotations

import functools

from ...errors import OctoPipeError
from .hooks import install_entry_points
from .arguments import add_octopipe_args, chain_providers
from .mapping import plan_of_args
from .startup import resolve_octopipe_plan
from .te import te_chunk_problem


def parse_args_with_octopipe(original):
    """Megatron's parse_args taking OctoPipe's arguments too and resolving the plan (main parse only)."""

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(chain_providers(extra_args_provider, add_octopipe_args), ignore_unknown_args)
        # fault-tolerance and in-process-restart helpers re-parse with ignore_unknown_args=True to read a few
        # flags; the plan is resolved once, by the script's own parse
        return args if ignore_unknown_args else resolve_octopipe_plan(args)

    return parse_args


def get_forward_backward_func(*args, **kwargs):
    """Megatron's schedule factory, returning OctoPipe's schedule under `--pipeline-schedule octopipe`."""
    from megatron.training import get_args

    run = get_args()
    if getattr(run, "pipeline_schedule", "default") == "octopipe":
        from .schedule import get_octopipe_forward_backward_func

        plan = plan_of_args(run)
        return te_checked(plan, get_octopipe_forward_backward_func(plan, *args, **kwargs),
                          bool(getattr(run, "octopipe_te_split", False)))
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_factory

    return megatron_factory(*args, **kwargs)


def te_checked(plan, forward_backward_func, te_split: bool):
    """The schedule, refusing at its first call a chunk of Transformer Engine linears that the plan gives an
    unverified I/W split (start-up rewrites such plans to B; this catches a model built otherwise), and, with
    the split on, a W order TE's FIFO wgrad queue cannot follow."""
    checked: set[int] = set()

    @functools.wraps(forward_backward_func)
    def run(*args, model=None, **kwargs):
        if model is not None and id(model) not in checked:
            from megatron.core import parallel_state

            from .wgrad import check_te_order

            rank = parallel_state.get_pipeline_model_parallel_rank()
            chunks = model if isinstance(model, (list, tuple)) else [model]
            problem = te_chunk_problem(plan, rank, chunks, te_split)
            if problem is not None:
                raise OctoPipeError(problem)
            if te_split:
                check_te_order(plan, rank)
            checked.add(id(model))
        return forward_backward_func(*args, model=model, **kwargs)

    return run


def install() -> None:
    """Make megatron.training take OctoPipe's arguments and schedule (idempotent; hooks.installed() lists them)."""
    install_entry_points(parse_args=parse_args_with_octopipe, get_forward_backward_func=get_forward_backward_func)


def schedule_of(argv: list[str]) -> str:
    """The `--pipeline-schedule` a command line asks for ('default' when absent; the last one given wins)."""
    value = "default"
    for i, tok in enumerate(argv):
        if tok == "--pipeline-schedule":
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif tok.startswith("--pipeline-schedule="):
            value = tok.split("=", 1)[1]
    return value


def prepare_launch(argv: list[str]) -> list[str]:
    """The script's argv after installing OctoPipe for an octopipe run; any other run touches nothing of Megatron.

    Under `--pipeline-schedule default` the option is dropped (Megatron's parser does not know it) and
    OctoPipe's own options are refused, since nothing would read them.
    """
    schedule = schedule_of(argv)
    if schedule == "octopipe":
        install()
        return list(argv)
    if schedule != "default":
        raise OctoPipeError(f"--pipeline-schedule {schedule!r}: expected 'default' (Megatron's own) or 'octopipe'")
    ours = [t.split("=", 1)[0] for t in argv if t.startswith("--octopipe-")]
    if ours:
        raise OctoPipeError(f"{', '.join(sorted(set(ours)))} configure OctoPipe's schedule; add --pipeline-schedule "
                            "octopipe, or drop them to run Megatron's own schedule")
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == "--pipeline-schedule":
            skip = True
        elif not tok.startswith("--pipeline-schedule="):
            out.append(tok)
    return out
