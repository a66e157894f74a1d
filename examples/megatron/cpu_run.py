"""Run a Megatron launch on CPU processes over gloo: check a command and its plan on a laptop before GPU hours.

    python examples/megatron/cpu_run.py --nproc 2 examples/megatron/train_gpt.py \
        <the Megatron arguments of your run, shrunk to a tiny model> --mock-data \
        --pipeline-schedule octopipe --octopipe-plan plan.json
    python examples/megatron/cpu_run.py --nproc 2 --megatron-lm /path/to/Megatron-LM pretrain_gpt.py ...

It installs the CPU shims (cpu_shims.py: Megatron's hard-coded CUDA calls redirected to the CPU,
never part of the plugin), imports Megatron once, then forks `--nproc` processes with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); each runs `launch.py` with the
rest of the command line, exactly as a GPU launch would. Forked, not started afresh: the ranks share
the parent's imports (about 7 CPU seconds a rank otherwise); nothing distributed exists before the fork. `--distributed-backend gloo` is added
unless given. Switch off what needs CUDA in the Megatron arguments: `--transformer-impl local
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion`, and on resumed runs
`--no-load-rng` (the shimmed CUDA RNG state saved is empty). `--tensor-model-parallel-size` > 1
runs (validate_args' GPU-architecture question is shimmed), and `--sequence-parallel` with
LayerNorm (apex's layer-norm kernel shimmed by torch's). On Python 3.11 the
`typing.override` that megatron.training imports reaches every child process (the
distributed-checkpoint writer's too) through the plugin's sitecustomize.py on PYTHONPATH
(`reach_child_processes`, as launch.py does; the shim itself is octopipe_plugin/compat.py's).
Exit status: the first non-zero exit status of a rank, else 0.
"""

from __future__ import annotations

import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split(argv: list[str]) -> tuple[int, list[str]]:
    if len(argv) < 2 or argv[0] != "--nproc":
        raise SystemExit("usage: cpu_run.py --nproc N [--megatron-lm DIR] SCRIPT [Megatron arguments...]")
    try:
        n = int(argv[1])
    except ValueError:
        raise SystemExit(f"cpu_run.py: --nproc expects a number of processes, got {argv[1]!r}") from None
    rest = argv[2:]
    if "--distributed-backend" not in rest:
        rest += ["--distributed-backend", "gloo"]
    return n, rest


def main(argv: list[str] | None = None) -> int:
    """Start the ranks, wait for all of them; the exit status of the run."""
    import multiprocessing

    n, rest = _split(list(sys.argv[1:] if argv is None else argv))
    from octopipe_plugin.adapters.megatron.compat import reach_child_processes

    os.environ.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()), CUDA_DEVICE_MAX_CONNECTIONS="1")
    reach_child_processes()  # Python 3.11: typing.override in every process the ranks start
    _prepare(rest)
    fork = multiprocessing.get_context("fork")  # the ranks inherit the shims and the imports
    procs = [fork.Process(target=_rank, args=(rank, rest), name=f"rank{rank}") for rank in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode != 0), 0)


def _prepare(rest: list[str]) -> None:
    """What every rank needs before its launch: the CPU shims, and with them Megatron, imported."""
    sys.path.insert(0, HERE)
    import cpu_shims
    import launch

    # the shims import megatron: from the checkout the launch runs (its script's folder first, as launch.py
    # and `python pretrain_gpt.py` put it), not from an installed package that would then shadow it
    script, _ = launch.split_argv(rest)
    sys.path.insert(0, os.path.dirname(script))
    cpu_shims.install_for_pretrain()
    if "--sequence-parallel" in rest and "RMSNorm" not in rest:  # the local spec's LayerNorm refuses SP on CPU
        cpu_shims.shim_sequence_parallel_norm()


def _rank(rank: int, rest: list[str]) -> None:
    """One rank (a forked child of main): the launcher with the run's command line."""
    import launch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    launch.main(rest)


if __name__ == "__main__":
    sys.exit(main())
