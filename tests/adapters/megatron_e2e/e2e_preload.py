"""Imported once by the forkserver the pretrain() end-to-end launches fork from (e2e_runs.launch).

What examples/megatron/cpu_run.py's parent does before it forks its ranks (`_prepare`: the CPU shims,
which import Megatron, and launch.py), plus the Megatron training modules every launch imports: each
launch's cpu_run then starts from these imports instead of paying about 7 CPU seconds for them again.
Nothing runs here but imports and the shims' installation, which cpu_run repeats (idempotent).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "megatron"))

import cpu_shims  # noqa: E402

cpu_shims.install_for_pretrain()

import cpu_run  # noqa: E402,F401
import launch  # noqa: E402,F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401
import megatron.core.models.mamba  # noqa: E402,F401
import megatron.training.training  # noqa: E402,F401
import octopipe_plugin.adapters.megatron  # noqa: E402,F401
