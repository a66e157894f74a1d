"""Manual check (not collected: four-rank launches cost minutes): a split LM head through pretrain() at TP2 x PP2.

    PYTHONPATH=$PWD python tests/adapters/megatron_e2e/tp_split_check.py [--sequence-parallel]

Two cpu_run.py launches of examples/megatron/train_gpt.py (4 gloo ranks, --tensor-model-parallel-size 2,
pipeline size 2), the tiny GPT of test_pretrain_split_e2e.py without its MoE layers (Megatron refuses MoE
with tensor parallelism but without sequence parallelism), same seeds: Megatron's own schedule on the
layout "Et|t|t|tL", and the OctoPipe plan of test_pretrain_split_e2e.py on the same stages with the LM head
split over both pipeline ranks. Prints the logged losses side by side, and checks every iteration's
training and validation loss (relative 1e-5) and every TP rank's main_grad before the first step (each
shard's rows against the same rows of its TP rank's slice of Megatron's head; a 1% scale error fails).
Exit status 0 when everything matches.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_pretrain_split_e2e as E  # noqa: E402
from e2e_runs import MEGATRON_LAYOUT, launch, loss_table, split_head_plans  # noqa: E402
from megatron_harness import grad_mismatches  # noqa: E402  (on sys.path through e2e_runs)

MOE = {"--num-experts", "--moe-layer-freq", "--moe-router-topk", "--moe-router-load-balancing-type",
       "--moe-aux-loss-coeff", "--moe-token-dispatcher-type"}  # each takes one value


def dense(args: list[str]) -> list[str]:
    """The e2e arguments without the MoE flags (and their values)."""
    out, i = [], 0
    while i < len(args):
        if args[i] in MOE:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def shard_want(got: dict, want: dict) -> dict:
    """Megatron's gradients in the split run's keys: "output_layer.weight[lo:hi]@tp<r>" (global padded rows) cut
    from TP rank r's head slice "output_layer.weight@tp<r>"."""
    per_tp = want["output_layer.weight@tp0"].shape[0]
    out = {k: v for k, v in want.items() if not k.startswith("output_layer.weight@")}
    for k in got:
        if k.startswith("output_layer.weight["):
            rows, tp = k[len("output_layer.weight["):].split("]@tp")
            lo, hi = map(int, rows.split(":"))
            r = int(tp)
            out[k] = want[f"output_layer.weight@tp{r}"][lo - r * per_tp:hi - r * per_tp]
    return out


def main() -> int:
    """Both launches, the table, the checks; 0 when the split run matches Megatron's."""
    sp = "--sequence-parallel" in sys.argv[1:]
    d = Path(tempfile.mkdtemp(prefix="octopipe-tp-split-"))
    # the plans' layer kinds without the MoE layers
    _, split = split_head_plans(d, kinds=["embedding"] + ["dense"] * 4 + ["lm_head"])
    args = dense(E.ARGS) + ["--tensor-model-parallel-size", "2"] + (["--sequence-parallel"] if sp else [])
    out = {}
    for name, extra in (("megatron", ["--pipeline-model-parallel-layout", MEGATRON_LAYOUT]),
                        ("split", ["--pipeline-schedule", "octopipe", "--octopipe-plan", split])):
        out[name] = launch(d / f"{name}.log", *args, *extra, nproc=4, script=E.PROBE,
                           env={"OCTOPIPE_E2E_GRADS": str(d / f"grads_{name}.pt")})
    print(loss_table(out))
    problems = []
    for kind in ("train", "valid"):
        meg, got = out["megatron"][kind], out["split"][kind]
        if sorted(meg) != sorted(got) or not meg:
            problems.append(f"{kind}: iterations {sorted(got)} vs Megatron's {sorted(meg)}")
        problems += [f"{kind} {it}: {got[it]} vs {meg[it]}" for it in meg
                     if it in got and abs(got[it] - meg[it]) > 1e-5 * abs(meg[it])]
    grads = {name: torch.load(d / f"grads_{name}.pt") for name in out}
    want = shard_want(grads["split"], grads["megatron"])
    if set(want) != set(grads["split"]):
        problems.append(f"parameters differ: {sorted(set(want) ^ set(grads['split']))[:5]}")
    problems += grad_mismatches(grads["split"], want)
    scaled = grad_mismatches({k: 1.01 * v for k, v in grads["split"].items()}, want)
    print(f"main_grads: {len(want)} parameters, {len(want) - len(problems)} within rel 1e-3; x1.01: "
          f"{len(scaled)} off")
    print("\n".join(problems) if problems else f"OK: TP2 x PP2{' + SP' if sp else ''} split head = Megatron's run")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
