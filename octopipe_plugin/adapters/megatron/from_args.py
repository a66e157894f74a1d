"""A Megatron launch's own arguments, before the launch: the model it builds and the pipeline it runs now.

`octopipe plan --megatron-args "<the launch's arguments>"` comes here. The arguments go through
Megatron's own `parse_args` (with OctoPipe's arguments, as the launch parses them) and
`validate_args`, so a bad argument gets Megatron's own message; the model is built by the code
the start-up tunes with (`graph.model_from_megatron` on the parsed arguments, costed for the
same GPU, with the launch's `--octopipe-costs`); the current setup is Megatron's own schedule on
the launch's `--pipeline-model-parallel-layout` (or hybrid pattern), or its even split, at the
launch's virtual stage count.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from dataclasses import dataclass

from ...errors import OctoPipeError
from ...partition import megatron_split
from .arguments import RunFacts, add_octopipe_args, load_measured_costs, run_facts
from .compat import allow_megatron_training_import
from .graph import hybrid_pattern, model_from_megatron
from .layout import hybrid_pattern_to_boundaries, layout_to_boundaries
from .startup import run_constraints  # noqa: F401 - the planning CLI applies the start-up's constraints

# Megatron arguments that set the current stages; the plan replaces them (start-up refuses them next to a plan)
STAGE_OPTIONS = ("--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
                 "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split")


@dataclass(frozen=True, kw_only=True)
class LaunchView:
    """What a launch's arguments say: Megatron's parsed arguments, the run's sizes, the model and current stages."""

    argv: tuple[str, ...]
    args: object  # Megatron's argparse Namespace, validated
    facts: RunFacts
    model: object  # octopipe Model, as the start-up builds it
    gpu: str
    current: tuple[tuple[int, int], ...]  # the launch's stage layer ranges (virtual stages in order)
    current_source: str  # where they come from, in words
    # the launch's uniform recompute/offload words, left out of `argv` (and the model's costs) when the plan's
    # per-layer choices replace them (view_launch(per_layer_memory=True)); () otherwise
    uniform_memory: tuple[str, ...] = ()

    @property
    def stages_per_rank(self) -> int:
        """The launch's virtual stages per pipeline rank."""
        return len(self.current) // self.facts.pipeline_size


def launch_argv(text: str) -> list[str]:
    """The arguments of a launch given inline or as @file (shell words; a leading `... script.py` is dropped)."""
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise OctoPipeError(f"--megatron-args @{path}: cannot read it ({exc.strerror})") from None
    text = text.replace("\\\n", " ")
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise OctoPipeError(f"--megatron-args: cannot split the arguments into words ({exc})") from None
    scripts = [i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")]
    if scripts:  # "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers ...": the script's own arguments
        words = words[scripts[0] + 1:]
    return words


def parse_launch(argv: list[str], world_size: int | None = None, *, cluster=None, gpu: str | None = None):
    """Megatron's parse_args (OctoPipe's arguments included) and validate_args on `argv`; Megatron's error, one line.

    `world_size`: the launch's GPU count (default TP x PP x CP: one data-parallel replica). `cluster`, `gpu`: what the
    plan is for (as launch_model costs it), the GPU whose architecture validation is told where this machine has no
    CUDA (`_validate_args`).
    """
    import warnings

    allow_megatron_training_import()
    with warnings.catch_warnings():  # "Apex / Transformer Engine not installed" at import: not about the launch
        warnings.simplefilter("ignore")
        from megatron.training import arguments

    saved = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world_size or 1), RANK="0")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            args = arguments.parse_args(extra_args_provider=add_octopipe_args)
            if world_size is None:
                args.world_size = (int(args.pipeline_model_parallel_size) * int(args.tensor_model_parallel_size)
                                   * int(getattr(args, "context_parallel_size", 1) or 1))
            raw = {"layout": args.pipeline_model_parallel_layout}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _validate_args(arguments, args, cluster, gpu or getattr(args, "octopipe_gpu", None))
    except SystemExit:  # argparse: its message is the last line it printed
        lines = [ln for ln in said.getvalue().splitlines() if ln.strip()]
        raise OctoPipeError(f"--megatron-args: Megatron's parser: {lines[-1] if lines else 'refused them'}") from None
    except (AssertionError, ValueError, TypeError, RuntimeError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise OctoPipeError(f"--megatron-args: Megatron's validate_args: {text}{_no_gpu_hint(exc)}") from None
    finally:
        sys.argv = saved[0]
        for k, v in saved[1].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    args.octopipe_raw_layout = raw["layout"]
    return args


def _validate_args(arguments, args, cluster, gpu: str | None) -> None:
    """Megatron's validate_args on `args`; on a machine without CUDA, called so that its question of the GPU's
    architecture is answered with the launch's GPU (the one the plan is for: `gpu`, else the cluster's).

    Why: at TP or CP > 1 megatron-core 0.19's validate_args calls megatron.training.utils.get_device_arch_version
    (`torch.cuda.get_device_properties("cuda:0").major`; arguments.py: `(tp > 1 or cp > 1) and
    get_device_arch_version() < 10`, also under Megatron-FSDP and GTP weight shards), and no argument skips that
    call where TP > 1. It asks which architecture the *launch* runs on, to require the launch's
    CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell (and to add Blackwell's high-priority stream groups): settings
    of the launch's environment, not of its model or pipeline. Planning on a CPU machine, the answer is the target
    GPU's compute capability (gpus.GpuSpec.arch_major), and the launch's required CUDA_DEVICE_MAX_CONNECTIONS=1 is
    taken as set where this process leaves it unset (the launch's own start-up checks its environment). Nothing is
    patched, of torch.cuda or of Megatron: this call of validate_args runs Megatron's own code with that one
    name of its module resolved to the target's answer (every other name is the module's)."""
    import inspect
    import types

    import torch

    validate = arguments.validate_args
    if torch.cuda.is_available():  # Megatron asks this machine's GPU, as the launch's start-up does
        validate(args)
        return
    from ...costs import cost_gpu
    from ...gpus import get_gpu

    major = get_gpu(cost_gpu(cluster, gpu)).arch_major
    own = inspect.unwrap(validate)
    validate = types.FunctionType(own.__code__, {**own.__globals__, "get_device_arch_version": lambda: major},
                                  own.__name__, own.__defaults__, own.__closure__)
    validate.__kwdefaults__ = own.__kwdefaults__
    env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if env is None and major < 10:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        validate(args)
    finally:
        if env is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def _no_gpu_hint(exc: BaseException) -> str:
    """Where validate_args asked this machine's GPU and there is none (e.g. --moe-grouped-gemm reads its compute
    capability; the architecture question at TP or CP > 1 is answered by `_validate_args`), the Megatron function
    that asked and the fix; else nothing."""
    import traceback

    import torch

    if torch.cuda.is_available() or "CUDA" not in str(exc):
        return ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}megatron{os.sep}" in f.filename]
    where = f" ({frames[-1].name}, {frames[-1].filename.rsplit(os.sep + 'megatron' + os.sep, 1)[-1]}:" \
            f"{frames[-1].lineno})" if frames else ""
    return (f"; Megatron's validation asks this machine's GPU{where} and this machine has none: run `octopipe plan` "
            f"on a node that sees a GPU, in the launch's environment (CUDA_DEVICE_MAX_CONNECTIONS as it sets it)")


def model_name(args) -> str:
    """The model name the start-up gives a run's model."""
    from .startup import _model_name

    return _model_name(args)


def launch_model(args, facts: RunFacts, cluster, gpu: str | None = None):
    """(model, gpu): the model the start-up tunes for this launch on `cluster` (its cost GPU, its --octopipe-costs)."""
    from ...costs import cost_gpu

    gpu = cost_gpu(cluster, gpu or getattr(args, "octopipe_gpu", None))
    model = model_from_megatron(args, gpu=gpu, name=model_name(args),
                                measured=load_measured_costs(getattr(args, "octopipe_costs", None)),
                                data_parallel_size=facts.data_parallel_size)
    return model, gpu


def current_stages(args, model, pipeline_size: int) -> tuple[list[tuple[int, int]], str]:
    """The launch's own stage ranges and where they come from: its layout, its '|' hybrid pattern, or the even split."""
    layout = getattr(args, "octopipe_raw_layout", None)
    if layout:
        return layout_to_boundaries(layout, model), f"--pipeline-model-parallel-layout {layout}"
    pattern = hybrid_pattern(args)
    if pattern and "|" in pattern:
        return hybrid_pattern_to_boundaries(pattern.split("/", 1)[0], model), "its '|' --hybrid-layer-pattern"
    v = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    where = "Megatron's even split" + (f" (first stage {first}, last {last} decoder layers)" if first or last else "")
    return megatron_split(model, pipeline_size * v, first, last), where


def view_launch(text: str, cluster, *, world_size: int | None = None, gpu: str | None = None,
                per_layer_memory: bool = False) -> LaunchView:
    """Parse a launch's arguments with Megatron and build what the start-up would: model, run sizes, current stages.

    `per_layer_memory`: the plan's memory choices replace the launch's uniform --recompute-* / offload arguments,
    so those are left out (the model costed without them) and kept in `uniform_memory`, for the user to drop."""
    from .memory import split_uniform_memory

    argv, uniform = split_uniform_memory(launch_argv(text)) if per_layer_memory else (launch_argv(text), [])
    args = parse_launch(argv, world_size, cluster=cluster, gpu=gpu)
    facts = run_facts(args)
    if cluster.num_devices != facts.pipeline_size:
        raise OctoPipeError(f"--cluster {cluster.name} has {cluster.num_devices} devices but the launch's pipeline has "
                            f"{facts.pipeline_size} ranks (--pipeline-model-parallel-size); give one device per "
                            f"pipeline rank (e.g. {(cluster.gpu or 'h100').split('-')[0].lower()}x{facts.pipeline_size})")
    model, gpu = launch_model(args, facts, cluster, gpu)
    current, where = current_stages(args, model, facts.pipeline_size)
    return LaunchView(argv=tuple(argv), args=args, facts=facts, model=model, gpu=gpu, current=tuple(current),
                      current_source=where, uniform_memory=tuple(uniform))


def args_to_add(plan_path: str, argv) -> tuple[list[str], list[str]]:
    """(arguments to add to the launch, its stage arguments to drop) to run the plan under Megatron."""
    drop = [w for w in argv if w.split("=", 1)[0] in STAGE_OPTIONS]
    pattern_words = [w for i, w in enumerate(argv) if i and argv[i - 1] in ("--hybrid-layer-pattern",
                                                                              "--hybrid-override-pattern")]
    if any("|" in w for w in pattern_words):
        drop.append("the '|' in --hybrid-layer-pattern")
    return ["--pipeline-schedule", "octopipe", "--octopipe-plan", plan_path], drop


def stamp(plan, view: LaunchView, cluster_name: str):
    """The plan with what the start-up checks and records: the layer kinds and what it was tuned for."""
    from dataclasses import replace

    meta = {**(plan.meta or {}), "layer_kinds": [layer.kind for layer in view.model.layers],
            "tuned_for": {"cluster": cluster_name, "gpu": view.gpu, "megatron_args": " ".join(view.argv)}}
    return replace(plan, meta=meta)
