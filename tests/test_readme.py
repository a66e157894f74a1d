"""The README opens with the two commands CI and users rely on."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_opens_with_main_job_and_test_commands():
    blocks = _bash_blocks()
    assert len(blocks) >= 2
    main_job, tests = blocks[0], blocks[1]
    assert "octopipe plan" in main_job and "scripts/install.sh" in main_job
    assert "pytest" in tests and "scripts/install.sh" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _bash_blocks()[1] in ci_lines


def test_torch_pin_in_setup_and_install_script():
    assert "torch==2.13.0" in (ROOT / "setup.py").read_text()
    assert "torch==2.13.0" in (ROOT / "scripts" / "install.sh").read_text()


def _octopipe_commands() -> list[list[str]]:
    """Every `octopipe ...` command of the README's bash blocks, continuation lines joined, comments dropped."""
    import shlex

    cmds = []
    for block in _bash_blocks():
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0] in ("octopipe", ".venv/bin/octopipe"):
                    cmds.append(words[1:])
    return cmds


def test_readme_commands_parse_and_read_only_files_written_before(tmp_path, monkeypatch):
    """In a fresh shell after install: the venv is activated first, each command parses as written,
    every file one reads was written by an earlier one; the quick ones (model, schedules, simulate of a
    built-in schedule) run and exit 0; `plan` and what reads its plan are left to the CLI tests."""
    from octopipe_plugin.cli import build_parser, main

    block = next(b for b in _bash_blocks() if "octopipe model --list" in b)
    assert block.splitlines()[0].startswith("source .venv/bin/activate")
    cmds = _octopipe_commands()
    assert len(cmds) >= 9
    parser = build_parser()
    written: set[str] = set()
    monkeypatch.chdir(tmp_path)
    for argv in cmds:
        args = parser.parse_args(argv)  # exits (fails the test) on any option not as the parser knows it
        reads = [getattr(args, "plan", None)] if args.command in ("simulate", "dryrun") else []
        for path in filter(None, reads):
            assert path in written, f"`octopipe {' '.join(argv)}` reads {path} before any command writes it"
        for key in ("output", "png", "trace", "save_plan"):
            if getattr(args, key, None):
                written.add(getattr(args, key))
        if args.command in ("model", "schedules") or (args.command == "simulate" and not args.plan):
            assert main(argv) == 0, argv
