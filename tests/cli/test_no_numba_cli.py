"""Every `octopipe` command that does not tune starts without importing numba (0.6-0.9 s of start-up).

numba is the tuner's compiled list scheduler only (tuner/listsched_kernel.py, imported at the first job large
enough for it). One fresh interpreter runs the commands one after another through the console script's
`main` and reports whether numba was imported; then it imports the kernel, to show that the check would see it.
"""

import json
import subprocess
import sys

CHILD = r"""
import json, os, sys
from octopipe_plugin.cli import main

os.chdir(sys.argv[1])
commands = [
    ["--help"],
    ["model", "llama3-8b"],
    ["model", "--list"],
    ["schedules"],
    ["simulate", "--model", "llama2-7b", "--cluster", "h100x4", "--schedule", "interleaved-zb", "--microbatches", "8",
     "--save-plan", "p.json"],
    ["simulate", "--model", "llama2-7b", "--cluster", "h100x4", "--plan", "p.json"],
    ["lower", "p.json"],
    ["export", "--torch-csv", "p.csv", "p.json"],
    ["cluster", "h100x8"],
    ["calibrate", "--show"],
]
seen = {}
for argv in commands:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    seen[" ".join(argv)] = [code, "numba" in sys.modules]
try:
    from octopipe_plugin.tuner import listsched_kernel
    kernel = listsched_kernel.AVAILABLE
except ImportError:
    kernel = False
print("RESULT " + json.dumps({"commands": seen, "kernel_imports_numba": kernel and "numba" in sys.modules}))
"""


def test_commands_that_do_not_tune_leave_numba_unimported(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert {cmd: code for cmd, (code, _) in got["commands"].items()} == {cmd: 0 for cmd in got["commands"]}
    assert [cmd for cmd, (_, numba) in got["commands"].items() if numba] == []
    try:
        import numba  # noqa: F401
    except ImportError:
        return
    assert got["kernel_imports_numba"]  # the check sees numba when something does import it
