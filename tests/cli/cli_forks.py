"""Run many `octopipe` command lines, each in its own process forked from one interpreter that imported the CLI.

Used by test_bad_inputs.py: `python cli_forks.py CASES.json TIMEOUT_S` reads {case: argv}, runs
`octopipe_plugin.cli.main(argv)` for each in a child forked after the imports (the imports, numba's
and torch's among them, are paid once instead of once per case; two children at a time), and prints {case: [returncode, stdout, stderr]} as
JSON. Each child starts from the same state (nothing a case does reaches the next), has its stdout and
stderr on files of its own, and is killed by SIGALRM after TIMEOUT_S (a hang fails its case, returncode
-14). Whatever escapes main() is printed as the traceback an interpreter would print, returncode 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile


def _child(argv: list[str], out_fd: int, err_fd: int, timeout: int) -> None:
    """In the forked child: main(argv) with fd 1 and 2 on the case's files; never returns."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    rc = 1
    try:
        signal.alarm(timeout)
        from octopipe_plugin.cli import main

        sys.argv = ["octopipe", *argv]
        rc = int(main(argv) or 0)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what the interpreter would print and exit with
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def run_all(cases: dict[str, list[str]], timeout: int, jobs: int = 2) -> dict[str, list]:
    """{case: [returncode, stdout, stderr]}, one forked child per case, `jobs` of them at a time."""
    import octopipe_plugin.cli  # noqa: F401 - the imports the children share
    import octopipe_plugin.simulator  # noqa: F401
    import octopipe_plugin.tuner  # noqa: F401
    try:  # dryrun and profile import torch before they check their arguments: 4-8 s a case, paid once here
        import torch  # noqa: F401

        import octopipe_plugin.executor.dryrun  # noqa: F401
    except ImportError:  # an install without torch: those cases import it (and fail) in their own child
        pass

    running: dict[int, tuple[str, list[str]]] = {}
    results = {}

    def reap() -> None:
        pid, status = os.wait()
        name, paths = running.pop(pid)
        out, err = (open(p, encoding="utf-8", errors="replace").read() for p in paths)
        results[name] = [os.waitstatus_to_exitcode(status), out, err]

    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, argv) in enumerate(cases.items()):
            if len(running) >= jobs:
                reap()
            paths = [os.path.join(tmp, f"{i}.{k}") for k in ("out", "err")]
            fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(argv, *fds, timeout)
            for fd in fds:
                os.close(fd)
            running[pid] = (name, paths)
        while running:
            reap()
    return {name: results[name] for name in cases}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as fh:
        todo = json.load(fh)
    print(json.dumps(run_all(todo, int(sys.argv[2]))))
