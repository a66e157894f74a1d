"""docs/architecture.md documents every architecture field, and each of its example files runs as written."""

import dataclasses
import re
from pathlib import Path

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.costs.arch import Arch

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _examples() -> list[str]:
    return [b for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S) if "name:" in b]


def test_every_arch_field_is_in_the_table():
    documented = set(re.findall(r"^\| `(\w+)` \|", DOC.read_text(), flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(Arch)}


@pytest.mark.parametrize("text", _examples(), ids=lambda t: re.search(r"name: (\S+)", t).group(1))
def test_each_example_builds_a_model(tmp_path, capsys, text):
    path = tmp_path / "arch.yaml"
    path.write_text(text)
    assert main(["model", str(path), "--gpu", "H100"]) == 0, capsys.readouterr().err
    name = re.search(r"name: (\S+)", text).group(1)
    assert name in capsys.readouterr().out
