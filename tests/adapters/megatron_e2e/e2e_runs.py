"""Shared by the pretrain() end-to-end tests: the tiny GPT's Megatron arguments, one launch, its logged losses.

A launch is `examples/megatron/cpu_run.py --nproc N SCRIPT ARGS...` (the documented CPU way: gloo
ranks, the CPU shims, examples/megatron/launch.py); Megatron's own log lines are the oracle.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRAIN_GPT = ROOT / "examples" / "megatron" / "train_gpt.py"
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
RESUME = ["--ckpt-step", "3", "--no-load-rng"]  # the shimmed CUDA RNG state saved on CPU is empty

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def launch(log: Path, *args: str, nproc: int = 2, script: Path = TRAIN_GPT, env: dict | None = None,
           timeout: float = 900) -> dict:
    """One cpu_run.py launch; its logged losses {"train": {it: loss}, "valid": {it: loss}, "log": text}."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "examples/megatron/cpu_run.py"), "--nproc", str(nproc), str(script), *args]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log.read_text()
    extra = " ".join(a for a in args if a.startswith("--pipeline") or a.startswith("--octopipe") or a == "--load")
    assert proc.returncode == 0, f"launch failed ({proc.returncode}): {extra}\n{text[-4000:]}"
    return {"train": {int(i): float(v) for i, v in LINE.findall(text)},
            "valid": {int(i): float(v) for i, v in VALID.findall(text)}, "log": text}


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
