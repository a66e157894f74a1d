"""`octopipe` command line: one module per sub-command, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from types import MappingProxyType

from ..errors import OctoPipeError

# sub-command name -> module under octopipe_plugin.cli
COMMANDS = MappingProxyType({
    "model": "model_cmd",
    "schedules": "schedules_cmd",
    "simulate": "simulate_cmd",
    "plan": "plan_cmd",
    "dryrun": "dryrun_cmd",
    "profile": "profile_cmd",
    "calibrate": "calibrate_cmd",
    "lower": "lower_cmd",
    "export": "export_cmd",
    "cluster": "cluster_cmd",
})


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one sub-parser per available sub-command."""
    from ._options import Parser

    from .. import __version__

    parser = Parser(prog="octopipe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"octopipe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(f"{__name__}.{module}").add_parser(sub)
    return parser


def _refuse_unknown_options(parser, argv: list[str]) -> None:
    """A mistyped option of a sub-command, named with the closest real one before argparse's own checks
    (which would first complain of a required option the typo was meant to be)."""
    import argparse

    from ._suggest import did_you_mean

    command = next((w for w in argv if not w.startswith("-")), None)
    sub = next((a.choices.get(command) for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
               None)
    if sub is None:
        return
    known = list(sub._option_string_actions) + list(parser._option_string_actions)
    for word in argv:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if " " in word or not name.startswith("--") or name in known or sum(k.startswith(name) for k in known) == 1:
            continue  # a value with spaces (argparse takes it as one), a known option, or an accepted abbreviation
        hint = did_you_mean(name, [k for k in known if k.startswith("--")])
        if hint:
            sub.error(f"unrecognized argument {name}{hint}")


def write_output(write: Callable[[], object], path: str) -> None:
    """Run `write` (which writes `path`); an OSError becomes a one-line OctoPipeError naming the file."""
    try:
        write()
    except OSError as exc:
        raise OctoPipeError(f"cannot write {path}: {exc.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `octopipe` console script; bad input exits 2 with one message, no traceback."""
    parser = build_parser()
    try:
        _refuse_unknown_options(parser, sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
    except SystemExit as exc:  # -h, or a bad option already reported on one line
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.run(args) or 0)
    except OctoPipeError as exc:
        print(f"octopipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout left (`| head`): send the rest to /dev/null so the flush at exit
        # does not raise again, and exit like a command killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
