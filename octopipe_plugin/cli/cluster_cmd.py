"""`octopipe cluster`: a cluster's figures, measured on this machine's ranks (--measure) or of a name or file."""

from __future__ import annotations

from .. import limits as L
from ..errors import OctoPipeError
from . import write_output
from ._options import check_writable, integer, load_cluster, number


def add_parser(subparsers) -> None:
    """Register `octopipe cluster`."""
    p = subparsers.add_parser(
        "cluster", help="measure this machine's links and memory into an octopipe-cluster/1 file (or show a cluster)",
        description="With --measure: send point-to-point messages of a few sizes between ranks, local processes "
                    "over gloo (--ranks N) or the ranks of the torchrun launch this runs under (NCCL on GPUs), for "
                    "pairs inside a node and across nodes, fit each link class's bandwidth and latency, time each "
                    "rank's device<->host copies (host_link_gb_per_s, what offloads are priced with), and write "
                    "an octopipe-cluster/1 file with them and the device's memory (a GPU's total memory; on CPU the "
                    "host memory available, shared by its ranks), which `plan`, `simulate` and `dryrun` take as "
                    "--cluster. Without --measure: print (or write with -o) the figures of a named cluster or file.")
    p.add_argument("cluster", nargs="?", help="cluster name (e.g. h100x8) or file to show; not with --measure")
    p.add_argument("--measure", action="store_true", help="measure the links between ranks")
    p.add_argument("--ranks", type=integer(2, L.MAX_DRYRUN_DEVICES),
                   help="local processes to measure (default: the ranks of this torchrun launch)")
    p.add_argument("--ranks-per-node", type=integer(1, L.MAX_DRYRUN_DEVICES),
                   help="with --ranks: count this many consecutive local processes as one node (default: all), "
                        "to try the inter-node path on one host")
    p.add_argument("--repeats", type=integer(1, 1000), default=5,
                   help="timed round trips per size and pair (the fastest is kept; default 5)")
    p.add_argument("--max-mib", type=integer(1, 4096), default=32,
                   help="largest message in MiB (default 32); sizes run from 4 KiB up to it")
    p.add_argument("--timeout", type=number(L.MIN_TIMEOUT_S, L.MAX_TIMEOUT_S, unit="s"), default=120.0,
                   help="seconds a rank waits for one message (default 120)")
    p.add_argument("--name", help="the cluster's name in the file (default: host, backend and rank count)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the octopipe-cluster/1 JSON here")
    p.set_defaults(run=run)


def message_sizes(max_mib: int) -> tuple[int, ...]:
    """4 KiB, then x16 steps, ending at `max_mib` MiB: a few sizes from latency- to bandwidth-bound."""
    top = max_mib << 20
    sizes = [n for n in (1 << 12, 1 << 16, 1 << 20, 1 << 23) if n < top]
    return tuple(sizes + [top])


def run(args) -> int:
    """Measure (or resolve) the cluster, print its figures, write it with -o."""
    from ..formats import write_cluster

    check_writable(args.output, "-o")
    if args.measure:
        if args.cluster:
            raise OctoPipeError(f"cluster {args.cluster}: --measure measures this machine; give no cluster name")
        cluster = _measure(args)
        if cluster is None:  # a rank other than 0 of a launch: rank 0 reports and writes
            return 0
    else:
        if args.ranks or args.ranks_per_node:
            raise OctoPipeError("--ranks and --ranks-per-node go with --measure")
        if not args.cluster:
            raise OctoPipeError("give a cluster name or file to show, or --measure to measure this machine")
        cluster = load_cluster(args.cluster)
    _print(cluster, measured=args.measure)
    if args.output:
        write_output(lambda: write_cluster(cluster, args.output), args.output)
        print(f"wrote {args.output}")
    return 0


def _measure(args):
    from ..profile.links import launched, measure_launched, measure_local

    sizes = message_sizes(args.max_mib)
    if args.ranks:
        return measure_local(args.ranks, per_node=args.ranks_per_node, sizes=sizes, repeats=args.repeats,
                             timeout_s=args.timeout, name=args.name)
    if args.ranks_per_node:
        raise OctoPipeError("--ranks-per-node goes with --ranks (under torchrun, LOCAL_WORLD_SIZE says it)")
    if not launched():
        raise OctoPipeError("--measure: give --ranks N for local processes, or run under torchrun "
                            "(RANK and WORLD_SIZE are not set)")
    return measure_launched(sizes=sizes, repeats=args.repeats, timeout_s=args.timeout, name=args.name)


def _print(cluster, *, measured: bool) -> None:
    nodes = cluster.num_devices // cluster.devices_per_node
    print(f"cluster {cluster.name}: {cluster.num_devices} devices, {cluster.devices_per_node} per node "
          f"({nodes} node{'s' if nodes != 1 else ''}), {cluster.memory_bytes / 2**30:.1f} GiB each"
          f"{', GPU ' + cluster.gpu if cluster.gpu else ''}")
    for label, link, real in (("intra-node", cluster.intra_node, True), ("inter-node", cluster.inter_node, nodes > 1)):
        note = "" if real or not measured else "  (one node: not measured, the intra-node figures)"
        print(f"{label:>10}: {link.bandwidth_gb_per_s:10.3f} GB/s  {link.latency_us:9.1f} us{note}")
    if cluster.host_link_gb_per_s is not None:  # what offloads are priced with (device<->host, each way)
        print(f"{'host link':>10}: {cluster.host_link_gb_per_s:10.3f} GB/s  (device<->host copies)")
