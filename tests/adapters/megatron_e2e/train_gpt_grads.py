"""examples/megatron/train_gpt.py with one probe: the gradients the first optimizer step reads, saved to a file.

A test helper, launched like the example (`cpu_run.py --nproc N tests/.../train_gpt_grads.py ARGS`):
the training is train_gpt.py's own, through `megatron.training.pretrain`. The probe wraps the
optimizer that Megatron's `setup_model_and_optimizer` returns: just before its first `step()`,
after Megatron's schedule and `finalize_model_grads` have reduced the gradients (the distributed
optimizer's reduce-scatter included), every parameter's main_grad is gathered by global name
(megatron_harness.reduced_main_grads) and rank 0 saves {name: float64 tensor} with torch.save
to $OCTOPIPE_E2E_GRADS. Nothing else changes: the step then runs as Megatron called it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples" / "megatron"), str(ROOT / "tests" / "adapters" / "megatron")]


def _probe_first_step(setup, path: str):
    """`setup_model_and_optimizer` whose optimizer saves the reduced main_grads before its first step."""
    def wrapped(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        step = optimizer.step

        def first_step(*a, **k):
            import torch
            import torch.distributed as dist

            import megatron_harness

            optimizer.step = step  # later steps: Megatron's own, untouched
            grads = megatron_harness.reduced_main_grads(model)
            if dist.get_rank() == 0:
                torch.save(grads, path)
            return step(*a, **k)

        optimizer.step = first_step
        return model, optimizer, scheduler

    return wrapped


def main() -> None:
    """train_gpt.main() with the probe installed when $OCTOPIPE_E2E_GRADS names a file."""
    import megatron.training.training as training

    import train_gpt

    path = os.environ.get("OCTOPIPE_E2E_GRADS")
    if path:
        training.setup_model_and_optimizer = _probe_first_step(training.setup_model_and_optimizer, path)
    train_gpt.main()


if __name__ == "__main__":
    main()
