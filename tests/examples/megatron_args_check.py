"""Run Megatron-LM's own argument parser and validator on launch arguments (a subprocess helper).

argv[1]: JSON list of {"args": [...], "world": N}. Prints one JSON list of results:
{"ok": true, "vp": ..., "num_layers": ..., "layout": ..., "hybrid": ...} or {"ok": false, "error": ...}.
"""

import contextlib
import json
import os
import sys

from octopipe_plugin.compat import allow_megatron_training_import

allow_megatron_training_import()  # megatron.training 0.19.2 imports typing.override (Python >= 3.12)

# Model-size arguments Megatron needs before it looks at the pipeline ones.
BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "64", "--position-embedding-type", "rope"]


def check(args, world):
    from megatron.training.arguments import parse_args, validate_args

    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    sys.argv = ["pretrain_gpt.py", *BASE, *args]
    try:
        parsed = parse_args()
        validate_args(parsed)
    except (AssertionError, ValueError) as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "vp": parsed.virtual_pipeline_model_parallel_size, "num_layers": parsed.num_layers,
            "pp": parsed.pipeline_model_parallel_size, "layout": parsed.pipeline_model_parallel_layout,
            "hybrid": parsed.hybrid_layer_pattern}


def main():
    cases = json.loads(sys.argv[1])
    with contextlib.redirect_stdout(sys.stderr):  # validate_args prints every argument
        results = [check(c["args"], c["world"]) for c in cases]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
