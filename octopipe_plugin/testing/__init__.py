"""Test scaffolding: toy models, references, multi-process checks, random plans and stand-ins.

Used by tests/, benchmarks/, examples/ and scripts/gpu_check.sh; never by a runtime package
(`tests/test_layering.py` fails on an import of `octopipe_plugin.testing` from executor,
simulator, tuner, schedules, adapters, formats, costs, profile, cli or a top-level module).
Nothing here runs in a training run, and importing a module here patches nothing.

- `toy`, `toy_branched`: small torch models with single-process references;
- `plans`: placements and random valid plans (sampled topological orders);
- `checks`, `seam_checks`: multi-process gradient / seam checks against those references;
- `torch_interop`: the same plan run by torch.distributed.pipelining (benchmark);
- `sleep_layer`, `megatron_standin`, `deepspeed_standin`: sleeping stand-in layers on a
  DeviceClock and the Megatron / DeepSpeed chunks the framework benchmarks build from them;
- `megatron_wgrad`: Megatron MLP stacks for the I/W split checks and the GEMM counter;
- `gpu_check`: the device self-check `scripts/gpu_check.sh` runs;
- `process_groups`: which process groups a harness destroys after each scenario of a spawn.
"""
