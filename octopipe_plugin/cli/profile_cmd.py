"""`octopipe profile MODEL`: measure each distinct layer on this device and write the cost-annotated model."""

from __future__ import annotations

import argparse
import json
import logging

from ..errors import OctoPipeError
from ..formats.model import model_to_dict, write_model
from .. import limits as L
from . import write_output
from ._options import check_writable, integer

log = logging.getLogger(__name__)

DTYPES = ("fp32", "bf16", "fp16")


def add_parser(subparsers) -> None:
    """Register `octopipe profile`."""
    p = subparsers.add_parser(
        "profile", help="measure F/I/W time, activation and state of each distinct layer on this device",
        description="Build each distinct layer kind of a zoo model or architecture file (plain torch or Megatron's "
                    "layers), time its forward (F), input-gradient (I) and weight-gradient (W) passes with the "
                    "executor's split backward on this device (median of --repeats after --warmup), measure its "
                    "saved activations and state, and write an octopipe-model/1 file that plans and simulates like "
                    "any other. Results are cached on disk: a second run measures nothing.")
    p.add_argument("name", nargs="?", help="zoo name or .json/.yaml architecture file (not with --overheads)")
    p.add_argument("--overheads", action="store_true",
                   help="measure the executor's own host cost per action kind (F, B, I, W) and per message (by size, "
                        "gloo) on 2 local ranks with tiny stages, and write an octopipe-overheads/1 file (-o) that "
                        "`simulate --overheads` and `plan --overheads` charge; cached like the layer profiles")
    p.add_argument("--impl", choices=("torch", "megatron"), default="torch",
                   help="layers to measure: plain torch reference layers, or Megatron-core's (local spec)")
    p.add_argument("--megatron-spec", choices=("auto", "local", "te"), default="auto",
                   help="Megatron layer spec: local (plain torch modules), te (Transformer Engine), auto (te on a GPU "
                        "where it imports)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, help="parameter and activation dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seq-len", type=integer(1, L.MAX_SEQ_LEN), help="override the sequence length")
    p.add_argument("--micro-batch-size", type=integer(1, L.MAX_MICRO_BATCH_SIZE), help="override the micro-batch size")
    p.add_argument("--tp", type=integer(1, L.MAX_TP), help="override the tensor-parallel size")
    p.add_argument("--dp", type=integer(1, L.MAX_DP), help="data-parallel size sharding the optimizer state")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any architecture field, e.g. --set hidden=512 --set num_experts=4")
    p.add_argument("--threads", type=integer(1, 1024),
                   help="torch intra-op threads on CPU (default: torch's; part of the cache key, as it changes the "
                        "timings)")
    p.add_argument("--repeats", type=integer(1, 10_000), default=10, help="timed runs per layer (the median is kept)")
    p.add_argument("--statistic", choices=("median", "p25"), default="median",
                   help="figure kept of the timed runs: median, or p25 (the lower quartile, for a shared machine: "
                        "other processes only add time to a run; the cache keeps both)")
    p.add_argument("--warmup", type=integer(0, 1000), default=2, help="untimed runs per layer first")
    p.add_argument("--cache-dir", help="profile cache directory (default: $OCTOPIPE_PROFILE_CACHE or "
                                       "~/.cache/octopipe/profiles)")
    p.add_argument("--no-cache", action="store_true", help="measure everything, read and write no cache")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: on a tty)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the cost-annotated octopipe-model/1 JSON here")
    p.add_argument("--json", action="store_true", help="print the model JSON instead of the table")
    p.set_defaults(run=run)


def parse_sets(items: list[str]) -> dict:
    """FIELD=VALUE strings -> overrides (integers, true/false, or strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OctoPipeError(f"--set {item!r}: expected FIELD=VALUE")
        low = value.lower()
        out[key.strip()] = int(value) if value.lstrip("-").isdigit() else (low == "true") if low in ("true", "false") \
            else value
    return out


def run(args) -> int:
    """Profile the model, write it if asked, print the table (or JSON) and where the figures came from."""
    import torch

    from ..costs import load_arch
    from ..profile import ProfileSettings
    from ..profile.arch_profile import profile_arch
    from ..profile.device import resolve_device
    from .model_cmd import format_table

    check_writable(args.output, "-o")
    if args.overheads:
        return _run_overheads(args)
    if args.name is None:
        raise OctoPipeError("profile: give a zoo name or architecture file to profile, or --overheads to measure the "
                            "executor's own costs")
    for flag in ("seq_len", "micro_batch_size", "tp", "dp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise OctoPipeError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.repeats < 1 or args.warmup < 0:
        raise OctoPipeError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threads is not None:
        if args.threads < 1:
            raise OctoPipeError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    overrides = {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size, "tp": args.tp, "dp": args.dp,
                 **parse_sets(args.set)}
    arch = load_arch(args.name, **overrides)
    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:
        raise OctoPipeError(f"--device {args.device!r}: {exc}") from None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.impl == "megatron":
        from ..adapters.megatron import profile as megatron_profile  # the adapter is where megatron is imported

        builders = megatron_profile.megatron_builders(arch, device, dtype, spec=args.megatron_spec)
        te = megatron_profile.use_transformer_engine(args.megatron_spec, device)
        impl = "megatron-te" if te else "megatron-local"  # part of each layer's signature, hence the cache key
        inputs = megatron_profile.megatron_inputs(arch, dtype)
        extra = ("megatron-core",) + (("transformer-engine",) if te else ())
    else:
        from ..profile.torch_layers import builders as torch_builders

        builders, inputs, extra, impl = torch_builders(arch), None, (), "torch"
    settings = ProfileSettings(device=device, warmup=args.warmup, repeats=args.repeats, cache_dir=args.cache_dir,
                               use_cache=not args.no_cache, progress=args.progress, versions_extra=extra,
                               statistic=args.statistic)
    result = profile_arch(arch, builders, impl=impl, dtype=dtype, settings=settings, inputs=inputs)
    model = result.model
    if args.output:
        write_output(lambda: write_model(model, args.output), args.output)
        log.info("wrote %s", args.output)
    if args.json:
        print(json.dumps(model_to_dict(model), indent=1))
        return 0
    info = model.meta["profile"]
    stat = "lower quartile" if args.statistic == "p25" else "median"
    print(f"profiled on {info['device']} ({impl} layers, {model.meta['dtype']}), {stat} of {info['repeats']} "
          f"runs after {info['warmup']} warm-up")
    print(format_table(model))
    st = result.stats
    print(f"distinct layers {st.distinct}: measured {st.measured}, from cache {st.cache_hits}")
    measured = sorted({l.kind for l in model.layers if l.source == "measured"})
    print(f"measured kinds: {', '.join(measured)}")
    if info["analytic_kinds"]:
        print(f"analytic kinds: {', '.join(info['analytic_kinds'])} (x {info['analytic_scale']:.3g})")
    for kind, why in info["failed_kinds"].items():
        print(f"  {kind}: {why}")
    return 0


def _run_overheads(args) -> int:
    """`profile --overheads`: measure (or read from the cache) the executor's overheads, write and print them."""
    from ..formats.overheads import overheads_to_dict, write_overheads
    from ..profile.overheads import OverheadSettings, format_overheads, profile_overheads

    if args.name is not None:
        raise OctoPipeError(f"profile --overheads measures the executor, not a model: drop {args.name!r}")
    settings = OverheadSettings(steps=max(1, args.repeats // 2), warmup=args.warmup, cache_dir=args.cache_dir,
                                use_cache=not args.no_cache)
    ov = profile_overheads(settings)
    if args.output:
        write_output(lambda: write_overheads(ov, args.output), args.output)
        log.info("wrote %s", args.output)
    if args.json:
        print(json.dumps(overheads_to_dict(ov), indent=1))
        return 0
    print(format_overheads(ov))
    return 0
