"""What every sub-command shares before any work: checked numeric options, writable outputs, and inputs
(model, cluster, the GPU whose costs are used) resolved with a line saying where the costs came from."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

from .. import limits as L
from ..errors import FormatError, OctoPipeError

DEFAULT_GPU = "H100-SXM"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `octopipe simulate: error: argument --devices: ... (see -h)`."""

    def error(self, message: str):
        """Print one line naming the option and what was expected (and the closest valid name), exit 2."""
        from ._suggest import explain_argparse_error

        message = explain_argparse_error(message, self.all_option_strings())
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} -h`)\n")

    def all_option_strings(self) -> list[str]:
        """This parser's option strings and, for the top-level parser, those of every sub-command."""
        out = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    out += list(sub._option_string_actions)
        return out


def integer(lo: int, hi: int, hint: str = ""):
    """argparse type: an integer in lo..hi (`hint` says why the range, or what to do instead)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {value}{hint}")
        return value

    parse.__name__ = "integer"
    return parse


def number(lo: float, hi: float, *, open_low: bool = False, unit: str = ""):
    """argparse type: a finite number in [lo, hi] (or (lo, hi] with open_low)."""
    rng = f"{'(' if open_low else '['}{lo:g}, {hi:g}]{' ' + unit if unit else ''}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {rng}, got {text!r}") from None
        if not math.isfinite(value) or value > hi or value < lo or (open_low and value == lo):
            raise argparse.ArgumentTypeError(f"expected a finite number in {rng}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def check_writable(path: str | None, option: str) -> None:
    """Refuse, before any work, an output path whose folder is missing or read-only, or that is a folder."""
    if not path:
        return
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise OctoPipeError(f"{option} {path}: is a folder; expected a file name (e.g. {os.path.join(path, 'out')})")
    if not os.path.isdir(folder):
        raise OctoPipeError(f"{option} {path}: folder {folder} does not exist; create it or write elsewhere")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise OctoPipeError(f"{option} {path}: the file is read-only; choose another name")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OctoPipeError(f"{option} {path}: folder {folder} is not writable; write elsewhere")


def warn(args, text: str) -> None:
    """One warning line on stderr, prefixed like the errors."""
    print(f"octopipe {args.command}: warning: {text}", file=sys.stderr)


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Which GPU's costs a command uses and where they come from (printed by every command)."""

    gpu: str | None
    source: str  # "analytic" (zoo or architecture file) or "model file"
    why: str

    def line(self) -> str:
        """'analytic, A100-80G (the GPU of cluster a100x8)' and the like."""
        return f"{self.source}, {self.gpu or 'GPU not recorded'} ({self.why})"

    def as_dict(self) -> dict:
        """JSON form."""
        return {"gpu": self.gpu, "source": self.source, "why": self.why}


def load_model(args, cluster=None, option: str = "--model"):
    """The model of `args.model`, costed for --gpu, else the cluster's GPU, else H100; warnings for mismatches."""
    from ..costs.zoo import load_model as zoo_load

    wanted = gpu_option(args.gpu) if getattr(args, "gpu", None) else None
    cl_gpu = getattr(cluster, "gpu", None) if cluster is not None else None
    if wanted:
        why = "--gpu" + (f"; cluster {cluster.name} has {cl_gpu}" if cl_gpu and cl_gpu != wanted else "")
    elif cl_gpu:
        why = f"the GPU of cluster {cluster.name}"
    elif cluster is not None:
        why = f"default: cluster {cluster.name} does not name its GPU; pass --gpu or add \"gpu\" to the cluster file"
    else:
        why = "default; pass --gpu for another"
    try:
        model, from_file = zoo_load(args.model, wanted or cl_gpu or DEFAULT_GPU)
    except FormatError:
        raise  # names the file and field already
    except OctoPipeError as exc:
        from ..costs.zoo import ZOO
        from ._suggest import did_you_mean

        hint = did_you_mean(args.model, ZOO) if not os.path.exists(args.model) else ""
        raise OctoPipeError(f"{option} {args.model}: {exc}{hint}") from None
    if not from_file:
        return model, Costs(gpu=model.meta.get("gpu"), source="analytic", why=why)
    meta = model.meta if isinstance(model.meta, dict) else {}
    recorded = meta.get("gpu") if isinstance(meta.get("gpu"), str) else None
    costs = Costs(gpu=recorded, source="model file", why=f"{option} {args.model}, costs as written")
    if wanted and wanted != recorded:
        warn(args, f"--gpu {args.gpu} does not apply to model file {args.model}: its costs are "
                   f"{recorded or 'for an unrecorded GPU'}'s as written (rebuild it from its architecture with "
                   f"`octopipe model ARCH --gpu {args.gpu} -o {args.model}`)")
    elif cl_gpu and recorded and cl_gpu != recorded:
        warn(args, f"model file {args.model} was costed for {recorded} but cluster {cluster.name} is {cl_gpu}: its "
                   f"times are {recorded}'s (rebuild it with `octopipe model ARCH --gpu {cl_gpu} -o {args.model}`)")
    return model, costs


def gpu_option(name: str) -> str:
    """The canonical GPU name of --gpu, refused with the option named."""
    from ..costs import get_gpu

    try:
        return get_gpu(name).name
    except OctoPipeError as exc:
        from ..gpus import GPUS
        from ._suggest import did_you_mean

        raise OctoPipeError(f"--gpu {name}: {exc}{did_you_mean(name, [*GPUS, 'A100', 'H100'])}") from None


def load_cluster(name: str):
    """The cluster of a name like h100x8 or a cluster file."""
    from ..costs import resolve_cluster

    try:
        return resolve_cluster(name)
    except FormatError:
        raise
    except OctoPipeError as exc:  # said once, as the option: "--cluster v100x8: unknown GPU ..."
        text = str(exc).removeprefix(f"cluster {name.strip().lower()}: ")
        raise OctoPipeError(f"--cluster {name}: {text}") from None


def keep_on_failure(write, path: str, plan=None) -> list[str]:
    """Run `write`; on an OSError return the message (the caller prints its report first, then fails).

    A plan that cannot be written where asked is kept in a temporary file, named in the message,
    so a long search is never lost to a full disk or a folder removed meanwhile.
    """
    try:
        write()
        return []
    except OSError as exc:
        msg = f"cannot write {path}: {exc.strerror or exc}"
    if plan is not None:
        import tempfile

        from ..formats import write_plan

        try:
            fd, kept = tempfile.mkstemp(prefix="octopipe-plan-", suffix=".json")
            os.close(fd)
            write_plan(plan, kept)
            msg += f"; the plan was kept in {kept}"
        except OSError as exc:
            msg += f"; keeping it in a temporary file failed too ({exc.strerror or exc})"
    return [msg]


def add_overheads_option(p) -> None:
    """--overheads: the executor's measured host costs (`octopipe profile --overheads`), charged by the simulator."""
    p.add_argument("--overheads", metavar="FILE",
                   help="octopipe-overheads/1 file of the executor's host cost per action kind and per message "
                        "(written by `octopipe profile --overheads`); plans are simulated and tuned paying them")


def load_overheads(args):
    """The --overheads file's Overheads, or None when the option is unset."""
    path = getattr(args, "overheads", None)
    if path is None:
        return None
    from ..formats.overheads import read_overheads

    return read_overheads(path)


def add_headroom_option(p) -> None:
    """--memory-headroom: memory left free on every device (headroom.py says why the default)."""
    from ..headroom import DEFAULT, HELP

    p.add_argument("--memory-headroom", type=_headroom_type, default=None, metavar="GIB|FRACTION", help=HELP)


def _headroom_type(text: str):
    from ..headroom import parse_headroom

    try:
        return parse_headroom(text, "")
    except OctoPipeError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


_headroom_type.__name__ = "headroom"


def apply_headroom(args, cluster, launch_value=None, launch_where: str = ""):
    """The cluster with --memory-headroom kept free on every device; unset, the launch's own setting
    (`launch_value`, e.g. its --octopipe-memory-headroom) or the default."""
    from ..headroom import DEFAULT, parse_headroom, with_headroom

    if args.memory_headroom is not None:
        return with_headroom(cluster, args.memory_headroom)
    if launch_value is not None:
        return with_headroom(cluster, parse_headroom(launch_value, launch_where), launch_where)
    return with_headroom(cluster, parse_headroom(DEFAULT))


def add_constraint_options(p) -> None:
    """The options that restrict plans to what the user's runtime accepts (tuner/constraints.py)."""
    from ..tuner.constraints import PLACEMENTS

    g = p.add_argument_group("constraints", "restrict plans to what the runtime you will run them on accepts")
    g.add_argument("--placement", choices=PLACEMENTS, default="any",
                   help="stage -> device map: looped (stage s on device s %% P: Megatron's own builders and "
                        "schedule), v (down the devices and back: ZB-V, DualPipeV) or any (OctoPipe's executor; "
                        "default)")
    g.add_argument("--max-stages-per-device", type=integer(1, L.MAX_STAGES_PER_DEVICE), default=None, metavar="N",
                   help="at most N stages (model chunks) on any device")
    g.add_argument("--uniform-stages-per-device", action="store_true",
                   help="the same number of stages on every device (torch.pipelining / torchtitan schedules, "
                        "Megatron's virtual pipeline)")
    g.add_argument("--no-split-backward", action="store_true",
                   help="fused backwards only, no separate input-gradient (I) and weight-gradient (W) actions "
                        "(for runtimes without split backward)")


def constraints_of(args):
    """The Constraints the options ask for."""
    from ..tuner.constraints import Constraints

    return Constraints(placement=args.placement, max_stages_per_device=args.max_stages_per_device,
                       uniform_stages_per_device=args.uniform_stages_per_device,
                       split_backward=not args.no_split_backward)
