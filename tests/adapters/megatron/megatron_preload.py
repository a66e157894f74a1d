"""Imported once per test session by the forkserver the Megatron harness spawns fork from (megatron_harness.spawn).

The CPU shims first (megatron_cpu_shims.install, as every worker's init_process does before importing Megatron),
then the Megatron and plugin modules the workers import: each spawned rank inherits them instead of paying about
7 CPU seconds of imports itself.
"""

import megatron_cpu_shims

megatron_cpu_shims.install()

import megatron.core.distributed  # noqa: E402
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402
import megatron.core.optimizer  # noqa: E402
import megatron.core.parallel_state  # noqa: E402
import megatron.core.pipeline_parallel  # noqa: E402
import megatron.training.arguments  # noqa: E402
import megatron.training.training  # noqa: E402

import megatron_scenarios  # noqa: E402,F401  (megatron_harness, hybrid_scenarios' imports)
import octopipe_plugin.adapters.megatron  # noqa: E402,F401
