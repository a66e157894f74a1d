"""Shared by the pretrain() end-to-end tests: the tiny GPT's Megatron arguments, one launch, its logged losses,
the split-head tests' plans.

A launch is `examples/megatron/cpu_run.py --nproc N SCRIPT ARGS...` (the documented CPU way: gloo
ranks, the CPU shims, examples/megatron/launch.py); Megatron's own log lines are the oracle. Its
cpu_run.main runs in a process forked from a forkserver that imported what cpu_run imports before
it forks its ranks (e2e_preload.py), with the launch's own environment, argv and log file: the
command line's run without ~7 CPU seconds of imports a launch.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path

from octopipe_plugin.executor.dryrun import zero_cost_cluster
from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.testing.plans import make_plan, sample_schedule
from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards

ROOT = Path(__file__).resolve().parents[3]
TRAIN_GPT = ROOT / "examples" / "megatron" / "train_gpt.py"
PROBE = Path(__file__).with_name("train_gpt_grads.py")  # train_gpt.py saving its first step's reduced gradients
# the Megatron tests' harness (gradient gathering and comparison by global parameter name)
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "megatron"))
# a tiny GPT with tied embeddings and MoE layers (aux loss); batch sizes are each test's own
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--position-embedding-type", "rope",
         "--num-experts", "2", "--moe-layer-freq", "[0,1,0,1]", "--moe-router-topk", "2",
         "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
         "--moe-token-dispatcher-type", "alltoall",
         "--disable-bias-linear",  # Megatron's local MoE experts with biases fail (in-place add on a view)
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--seed", "1234", "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--eval-interval", "3",
         "--eval-iters", "1", "--train-iters", "6", "--save-interval", "3", "--ckpt-format", "torch_dist",
         "--dist-ckpt-optim-fully-reshardable",
         # need CUDA: Transformer Engine, fused kernels, GPU initialisation
         "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
         "--use-cpu-initialization",
         # the oracle: no dropout draws (the schedules run forwards in different orders)
         "--hidden-dropout", "0", "--attention-dropout", "0"]
# 4 micro-batches per step, evaluation on 2: test_pretrain_e2e.py's runs and the tied split-head runs (the
# reference launch both read is conftest.py's tied_megatron)
TIED_ARGS = [*MODEL, "--global-batch-size", "4", "--eval-global-batch-size", "2"]
RESUME = ["--ckpt-step", "3", "--no-load-rng"]  # the shimmed CUDA RNG state saved on CPU is empty

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def launch(log: Path, *args: str, nproc: int = 2, script: Path = TRAIN_GPT, env: dict | None = None,
           timeout: float = 900) -> dict:
    """One cpu_run.py launch; its logged losses {"train": {it: loss}, "valid": {it: loss}, "log": text}."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    returncode = _cpu_run(["--nproc", str(nproc), str(script), *args], env, log, timeout)
    text = log.read_text()
    extra = " ".join(a for a in args if a.startswith("--pipeline") or a.startswith("--octopipe") or a == "--load")
    assert returncode == 0, f"launch failed ({returncode}): {extra}\n{text[-4000:]}"
    return {"train": {int(i): float(v) for i, v in LINE.findall(text)},
            "valid": {int(i): float(v) for i, v in VALID.findall(text)}, "log": text}


PRELOAD = ["e2e_preload"]


def _cpu_run(argv: list[str], env: dict, log: Path, timeout: float) -> int:
    """`python cpu_run.py ARGV` with `env`, stdout and stderr into `log`: its exit status (the launch's processes
    killed after `timeout` seconds, then -9)."""
    import multiprocessing

    from octopipe_plugin.executor.launch import use_forkserver

    # the server finds its preload on the PYTHONPATH it starts with (as megatron_harness.spawn's)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [old])])
    try:
        use_forkserver(PRELOAD)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    proc = multiprocessing.get_context("forkserver").Process(target=_cpu_run_main, args=(argv, env, str(log)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:  # its ranks are in its session: end them all
        os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
        return -9
    return proc.exitcode


def _cpu_run_main(argv: list[str], env: dict, log: str) -> None:
    """cpu_run.main(argv) in this forked process, as its command line would run it."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    import cpu_run

    sys.argv = [cpu_run.__file__, *argv]
    code = cpu_run.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def loss_table(out: dict, iterations: int = 6) -> str:
    """The logged losses of several launches side by side (what the reports show)."""
    names = list(out)
    rows = ["iteration " + " ".join(f"{n:>17}" for n in names)]
    for kind in ("train", "valid"):
        for it in range(1, iterations + 1):
            vals = [out[n][kind].get(it) for n in names]
            if any(v is not None for v in vals):
                rows.append(f"{kind} {it:>3}  " + " ".join(f"{v:17.6E}" if v is not None else " " * 17 for v in vals))
    return "\n".join(rows)


# The split-head runs (test_pretrain_split_e2e.py): embeddings untied (tied: TIED_ARGS),
# M micro-batches per step, Megatron's stages "Et|t|t|tL" looped over the 2 ranks (the same initial weights).
SPLIT_M = 4
SPLIT_BOUNDS = [(0, 2), (2, 3), (3, 4), (4, 6)]  # graph layers: embedding, 4 decoder layers, LM head
SPLIT_KINDS = ["embedding", "dense", "moe", "dense", "moe", "lm_head"]  # --moe-layer-freq [0,1,0,1]
MEGATRON_LAYOUT = "Et|t|t|tL"


def split_head_plans(d: Path, *, kinds: list[str] = SPLIT_KINDS,
                     splits: tuple[SplitLayer, ...] | None = None) -> tuple[str, str]:
    """(the looped plan's file, the same plan with `splits`, by default its LM head split over both ranks with
    uneven shares), written in `d`; `kinds`: the graph's layer kinds (another run's, e.g. without MoE)."""
    graph = Model(name="train_gpt", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1,
              output_bytes=1) for i, k in enumerate(kinds)))
    devices = [0, 1, 0, 1]
    splits = splits if splits is not None else (SplitLayer(layer=len(kinds) - 1, devices=(1, 0), shares=(0.35, 0.65)),)
    cluster = replace(zero_cost_cluster(2), memory_bytes=1 << 40)
    for seed in range(21, 71):  # the first random order (I/W split at random) that takes the shard actions
        plan = make_plan(stage_devices=devices, bounds=SPLIT_BOUNDS, num_devices=2, num_microbatches=SPLIT_M,
                         schedule=sample_schedule(devices, 2, SPLIT_M, random.Random(seed)), model="train_gpt")
        with_split = insert_shards(graph, cluster, replace(plan, splits=splits), ShardPolicy())
        if with_split is not None:
            break
    assert with_split is not None, "no order takes the shard actions"
    write_plan(plan, d / "plan.json")
    write_plan(with_split, d / "split.json")
    return str(d / "plan.json"), str(d / "split.json")
