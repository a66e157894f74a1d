"""`octopipe model`: cost-annotate a zoo model or architecture file, print its per-kind table or JSON."""

from __future__ import annotations

import json
import logging
import os

from ..costs import ZOO, resolve_model, zoo_description
from ..costs.zoo import is_model_file
from ..errors import FormatError, OctoPipeError
from ..formats.model import Model, model_to_dict, write_model
from ..graph import ModelGraph
from .. import limits as L
from ._suggest import did_you_mean
from . import write_output
from ._options import DEFAULT_GPU, check_writable, gpu_option, integer, warn

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    """Register `octopipe model`."""
    p = subparsers.add_parser("model", help="per-layer costs of a zoo model or architecture/model file",
                              description=__doc__)
    p.add_argument("name", nargs="?", help="zoo name (see --list) or a .json/.yaml architecture or model file")
    p.add_argument("--list", action="store_true", help="list the built-in model zoo")
    p.add_argument("--gpu", default=None, help="GPU of the analytic cost model (A100, H100, H200, B200; default H100)")
    p.add_argument("--seq-len", type=integer(1, L.MAX_SEQ_LEN), help="override the sequence length")
    p.add_argument("--micro-batch-size", type=integer(1, L.MAX_MICRO_BATCH_SIZE), help="override the micro-batch size")
    p.add_argument("--tp", type=integer(1, L.MAX_TP), help="override the tensor-parallel size")
    p.add_argument("--dp", type=integer(1, L.MAX_DP),
                   help="data-parallel size sharding the optimizer (distributed optimizer)")
    p.add_argument("--recompute", action="store_true", default=None, help="full activation recomputation")
    p.add_argument("--ep", type=integer(1, L.MAX_ARCH_INT),
                   help="expert-parallel size: a MoE layer's dispatch and combine all-to-alls become phases of their own")
    p.add_argument("--ep-nodes", type=integer(1, L.MAX_ARCH_INT),
                   help="nodes the expert-parallel group spans (its all-to-alls cross the inter-node link when > 1)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the cost-annotated octopipe-model/1 JSON here")
    p.add_argument("--json", action="store_true", help="print the octopipe-model/1 JSON instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    """Resolve the model, write it if asked, print the table (or JSON)."""
    if args.list:
        for name in ZOO:
            print(f"{name:18s} {zoo_description(name)}")
        return 0
    if not args.name:
        raise OctoPipeError("give a zoo model name or an architecture/model file (or --list to see the zoo)")
    check_writable(args.output, "-o")
    if args.gpu is not None and is_model_file(args.name):
        warn(args, f"--gpu {args.gpu} does not apply to model file {args.name}: its costs are printed as written")
    gpu = gpu_option(args.gpu or DEFAULT_GPU)
    try:
        model = resolve_model(args.name, gpu, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                              tp=args.tp, dp=args.dp, recompute=args.recompute, ep=args.ep, ep_nodes=args.ep_nodes)
    except FormatError:
        raise
    except OctoPipeError as exc:
        hint = did_you_mean(args.name, ZOO) if not os.path.exists(args.name) else ""
        raise OctoPipeError(f"{exc}{hint}") from None
    if args.output:
        write_output(lambda: write_model(model, args.output), args.output)
        log.info("wrote %s", args.output)
    if args.json:
        print(json.dumps(model_to_dict(model), indent=1))
    else:
        print(format_table(model))
    return 0


def human_bytes(n: float) -> str:
    """Bytes as B / KiB / MiB / GiB with three significant figures."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _header(model: Model) -> str:
    arch, gpu = model.meta.get("arch"), model.meta.get("gpu")
    head = f"model {model.name}: {model.num_layers} layers"
    if arch:
        head += (f" on {gpu}, seq_len {arch['seq_len']}, micro-batch {arch['micro_batch_size']}, tp {arch['tp']}, "
                 f"dp {arch['dp']}, recompute {'on' if arch['recompute'] else 'off'}")
    return head


def format_table(model: Model) -> str:
    """Readable per-kind table: counts, per-layer F/I/W ms, state/activation/output bytes, heaviest layer."""
    graph = ModelGraph(model)
    cols = f"{'kind':<12}{'count':>6}{'F ms':>9}{'I ms':>9}{'W ms':>9}{'state':>11}{'activation':>12}{'output':>11}" \
           f"{'F+I+W all':>11}"
    lines = [_header(model), "per layer of each kind (one micro-batch):", cols]
    for k in graph.kind_summaries():
        lines.append(f"{k.kind:<12}{k.count:>6}{k.fwd_ms:>9.3f}{k.bwd_ms:>9.3f}{k.wgrad_ms:>9.3f}"
                     f"{human_bytes(k.state_bytes):>11}{human_bytes(k.activation_bytes):>12}"
                     f"{human_bytes(k.output_bytes):>11}{k.total_ms:>11.2f}")
    t = graph.totals()
    lines.append(f"{'total':<12}{model.num_layers:>6}{t['fwd_ms']:>9.2f}{t['bwd_ms']:>9.2f}{t['wgrad_ms']:>9.2f}"
                 f"{human_bytes(t['state_bytes']):>11}{human_bytes(t['activation_bytes']):>12}")
    comm = [(layer.kind, layer.comm_ms) for layer in model.layers if layer.phases]
    if comm:
        total = sum(f + i for _, (f, i) in comm)
        kinds = ", ".join(dict.fromkeys(k for k, _ in comm))
        lines.append(f"communication phases ({kinds}): {total:.2f} ms of F + I per micro-batch, "
                     f"{total / (t['fwd_ms'] + t['bwd_ms'] + t['wgrad_ms']):.1%} of F + I + W; an overlapped pair can hide it")
    h = graph.heaviest()
    lines.append(f"heaviest layer: {h.layer.name} ({h.layer.kind}, index {h.index}), F+I+W {h.layer.total_ms:.2f} ms "
                 f"= {h.ratio_to_median:.2f}x the median layer")
    if not graph.is_chain:
        lines.append("branches: " + ", ".join(
            f"{model.layers[c].name} <- {[model.layers[p].name for p in ps] or 'input'}"
            for c, ps in sorted(model.inputs.items())))
    return "\n".join(lines)
