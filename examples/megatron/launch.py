"""Run a Megatron-LM pretrain script (pretrain_gpt.py, pretrain_mamba.py, ...) with OctoPipe's schedule available.

    torchrun --nproc-per-node 8 examples/megatron/launch.py /path/to/Megatron-LM/pretrain_gpt.py \
        <your usual Megatron arguments> --pipeline-schedule octopipe --octopipe-cluster h100x8
    torchrun ... examples/megatron/launch.py --megatron-lm /path/to/Megatron-LM pretrain_mamba.py ... \
        --pipeline-schedule octopipe --octopipe-plan plan.json

No Megatron file is changed: the launcher puts the checkout on sys.path (as `python
pretrain_gpt.py` would), installs OctoPipe's hooks into megatron.training for a
`--pipeline-schedule octopipe` run (octopipe_plugin.adapters.megatron.launch.prepare_launch;
`hooks.installed()` lists them) and runs the script as __main__ with the remaining arguments.
`--pipeline-schedule default` (the default) runs Megatron untouched: nothing is installed.
"""

from __future__ import annotations

import os
import runpy
import sys


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(script path, its arguments) from `[--megatron-lm DIR] SCRIPT ARGS...` (DIR also from $MEGATRON_LM)."""
    checkout = os.environ.get("MEGATRON_LM")
    if argv[:1] == ["--megatron-lm"]:
        if len(argv) < 2:
            raise SystemExit("launch.py: --megatron-lm needs the path of your Megatron-LM checkout")
        checkout, argv = argv[1], argv[2:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: launch.py [--megatron-lm DIR] SCRIPT [Megatron arguments...]  "
                         "(SCRIPT: pretrain_gpt.py, pretrain_mamba.py, ... of your Megatron-LM checkout)")
    script = argv[0]
    if not os.path.exists(script) and checkout:
        script = os.path.join(checkout, script)
    if not os.path.isfile(script):
        raise SystemExit(f"launch.py: no script {script!r}; pass its path, or --megatron-lm DIR with its name")
    return os.path.abspath(script), argv[1:]


def main(argv: list[str] | None = None) -> None:
    """Install OctoPipe's hooks (octopipe runs only), then run the Megatron script as __main__."""
    script, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    sys.path.insert(0, os.path.dirname(script))  # the script's own imports (gpt_builders, model_provider, megatron)
    from octopipe_plugin.adapters.megatron.compat import allow_megatron_training_import, reach_child_processes
    from octopipe_plugin.adapters.megatron.launch import prepare_launch
    from octopipe_plugin.errors import OctoPipeError

    # Python 3.11: typing.override (not a Megatron name) here and in every process the run starts
    allow_megatron_training_import()
    reach_child_processes()
    try:
        sys.argv = [script, *prepare_launch(rest)]
        runpy.run_path(script, run_name="__main__")
    except OctoPipeError as exc:  # a plan that does not fit the run: one message, no traceback
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
