"""Subprocess helper: import megatron.training from a patched copy and report what the patch changed.

argv[1]: JSON {"argv": [...], "world": N}. Prints one JSON line: the schedule factory's module, the
resolved layout / VP and whether OctoPipe's arguments were parsed.
"""

import contextlib
import json
import os
import sys

from octopipe_plugin.adapters.megatron.compat import allow_megatron_training_import

allow_megatron_training_import()


def main():
    job = json.loads(sys.argv[1])
    os.environ.update(WORLD_SIZE=str(job["world"]), RANK="0")
    sys.argv = ["pretrain_gpt.py", *job["argv"]]
    with contextlib.redirect_stdout(sys.stderr):
        import megatron.training.training as training
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args()
    print(json.dumps({"megatron": training.__file__, "factory": training.get_forward_backward_func.__module__,
                      "schedule": args.pipeline_schedule, "layout": args.pipeline_model_parallel_layout,
                      "vp": args.virtual_pipeline_model_parallel_size}))


if __name__ == "__main__":
    main()
