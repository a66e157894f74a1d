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
