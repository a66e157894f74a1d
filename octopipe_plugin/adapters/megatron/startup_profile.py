"""`--octopipe-profile`: measure a Megatron run's distinct layer kinds on this device before tuning at start-up.

Rank 0 builds one real Megatron layer per kind (profile.py's builders, the profiler's on-disk
cache; I and W timed as the stage runner splits them, and the fused B where Transformer Engine layers
run fused, te.py) and hands the measured costs, by kind, to the model graph's `measured=` seam, so the
tuner plans on this device's times instead of the analytic model's. It runs before the run's
process group is opened: the profiler opens a one-rank group and Megatron's parallel state of
its own, and both are torn down afterwards so Megatron's initialisation starts from nothing.
"""

from __future__ import annotations

import logging

from ...errors import OctoPipeError
from .graph import COST_FIELDS, WALK_FIELDS, arch_from_megatron, layer_specs
from .te import TE_KINDS, te_backward

log = logging.getLogger("octopipe.megatron")


def profiled_costs(args, *, name: str = "megatron") -> dict[str, dict[str, float]]:
    """kind -> measured cost fields of this run's layer kinds on this device (kinds the profiler measured)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ...profile import ProfileSettings
    from ...profile.arch_profile import profile_arch
    from .profile import megatron_builders, megatron_inputs

    if dist.is_initialized():
        # the profiler's one-rank model-parallel state would stand in for the run's on this rank only
        raise OctoPipeError("--octopipe-profile: the process group is already open; profiling runs on rank 0 before "
                            "it is, so start the run without opening torch.distributed first")
    if int(getattr(args, "tensor_model_parallel_size", 1) or 1) != 1:
        raise OctoPipeError(f"--octopipe-profile: layers are measured on one rank with tp = 1, but "
                            f"--tensor-model-parallel-size is {args.tensor_model_parallel_size}; give measured "
                            "costs with --octopipe-costs instead")
    if args.octopipe_profile_repeats < 1:
        raise OctoPipeError(f"--octopipe-profile-repeats: expected >= 1, got {args.octopipe_profile_repeats}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    arch = arch_from_megatron(args, name=name)
    settings = ProfileSettings(device=device, warmup=max(1, args.octopipe_profile_repeats // 5),
                               repeats=args.octopipe_profile_repeats, cache_dir=args.octopipe_profile_cache,
                               versions_extra=("megatron-core",), progress=False)
    try:
        result = profile_arch(arch, megatron_builders(arch, device, dtype), impl="megatron", dtype=dtype,
                              inputs=megatron_inputs(arch, dtype), settings=settings)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    kinds = {s.kind for s in layer_specs(args)}
    fused = te_backward(args)
    fused = fused.te and not fused.split  # TE layers run fused B: their cost is the measured B, not I and W
    out: dict[str, dict[str, float]] = {}
    for layer, record in zip(result.model.layers, result.model.meta["profile"]["layers"]):
        if layer.source == "measured" and layer.kind in kinds:
            out.setdefault(layer.kind, kind_costs(layer, record, fused=fused))
    log.info("octopipe: measured layer kinds %s on %s (%d measured, %d from the cache); analytic for %s",
             sorted(out), result.model.meta["gpu"], result.stats.measured, result.stats.cache_hits,
             sorted(kinds - set(out)) or "none")
    return out


def kind_costs(layer, record: dict | None, *, fused: bool) -> dict[str, float]:
    """The cost fields a profiled Layer hands the graph for its kind, its measured fused_ratio and W's graph walk
    (graph_nodes, walk_ms_per_node) with them.

    `fused` (TE layers running fused B): a TE kind's B is its measured fused backward itself (wgrad 0), so
    no ratio is carried on top of it, nor a W walk (a fused B is one walk).
    """
    fields = {f: getattr(layer, f) for f in COST_FIELDS}
    if fused and layer.kind in TE_KINDS and (record or {}).get("fused_bwd_ms") is not None:
        return {**fields, "bwd_ms": float(record["fused_bwd_ms"]), "wgrad_ms": 0.0}
    if layer.fused_ratio is not None:  # B = (I + W) x ratio in the simulator (simulator/costs.py)
        fields["fused_ratio"] = layer.fused_ratio
    fields.update({f: getattr(layer, f) for f in WALK_FIELDS if getattr(layer, f) is not None})
    return fields


def merge_costs(profiled: dict, given: dict) -> dict:
    """Profiled costs with the --octopipe-costs file's fields on top (the file is the user's word)."""
    out = {k: dict(v) for k, v in profiled.items()}
    for key, fields in given.items():
        out[key] = {**out.get(key, {}), **fields}
    return out
