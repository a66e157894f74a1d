"""`octopipe model`: table, JSON, -o file, --list, overrides, and one-line errors."""

import json

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.costs import ZOO, resolve_model
from octopipe_plugin.formats import model_from_dict, read_model


def test_table_shows_kinds_costs_and_heaviest(capsys):
    assert main(["model", "llama3-8b", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "model llama3-8b: 34 layers on H100-SXM, seq_len 8192" in out
    for kind in ("embedding", "dense", "lm_head"):
        assert any(line.split()[:2] == [kind, "1" if kind != "dense" else "32"] for line in out.splitlines())
    assert "heaviest layer: lm_head" in out and "x the median layer" in out


def test_vlm_table_shows_branches(capsys):
    assert main(["model", "vlm"]) == 0
    assert "layer0 <- ['projector', 'embedding']" in capsys.readouterr().out


def test_json_and_output_file_agree_with_resolve_model(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["model", "deepseek-v3-mini", "--gpu", "B200", "--seq-len", "2048", "--micro-batch-size", "2",
                 "--dp", "4", "--recompute", "--json", "-o", str(path)]) == 0
    printed = model_from_dict(json.loads(capsys.readouterr().out))
    expected = resolve_model("deepseek-v3-mini", "B200", seq_len=2048, micro_batch_size=2, dp=4, recompute=True)
    assert printed == expected == read_model(path)
    assert printed.meta["arch"]["recompute"] is True


def test_list_names_every_zoo_model(capsys):
    assert main(["model", "--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == list(ZOO)


@pytest.mark.parametrize("argv,fragment", [
    (["model"], "--list"),
    (["model", "no-such-model"], "expected a zoo name"),
    (["model", "llama3-8b", "--gpu", "V100"], "unknown GPU"),
    (["model", "llama3-8b", "--tp", "3"], "$.heads: expected a multiple of tp=3"),
    (["model", "llama3-8b", "--seq-len", "0"], "argument --seq-len: expected an integer in 1..16777216, got 0"),
    (["model", "llama3-8b", "-o", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    (["model", "missing-file.yaml"], "missing-file.yaml: field $: expected a readable file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and fragment in err and err.startswith("octopipe model: error:")
    assert captured.out == ""
