"""`octopipe --version` and 'did you mean' for mistyped zoo names, GPUs, schedules, sub-commands and options."""

from __future__ import annotations

import pytest

from octopipe_plugin import __version__
from octopipe_plugin.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"octopipe {__version__}"


@pytest.mark.parametrize("argv, hint", [
    (["plna"], "did you mean 'plan'?"),
    (["simulate", "--model", "llama2-7b", "--cluster", "h100x8", "--schedule", "zbv", "--microbatches", "8"],
     "did you mean 'zb-v'?"),
    (["simulate", "--model", "llama2-7b", "--cluster", "h100x8", "--schedule", "interleaved-1fb1",
      "--microbatches", "8"], "did you mean 'interleaved-1f1b'?"),
    (["plan", "--model", "nemotron", "--cluster", "h100x8", "--microbatches", "8", "--no-progress"],
     "did you mean 'nemotron-h'?"),
    (["model", "llama3-8", "--gpu", "H100"], "did you mean 'llama3-8b'?"),
    (["model", "gemma3", "--gpu", "h10"], "did you mean 'H100'?"),
    (["plan", "--model", "nemotron-h", "--cluster", "h100x8", "--micro-batches", "8"],
     "unrecognized argument --micro-batches; did you mean '--microbatches'?"),
    (["plan", "--model", "nemotron-h", "--cluster", "h100x8", "--microbatches", "8", "--placment", "v"],
     "did you mean '--placement'?"),
    (["simulate", "--model", "llama2-7b", "--cluster", "h100x8", "--schedule", "1f1b", "--microbatches", "8",
      "--memory-headrom", "4"], "did you mean '--memory-headroom'?"),
])
def test_did_you_mean(capsys, argv, hint):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_no_suggestion_when_nothing_is_close(capsys):
    assert main(["simulate", "--model", "llama2-7b", "--cluster", "h100x8", "--schedule", "qqqq",
                 "--microbatches", "8"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_a_value_that_looks_like_options_is_left_to_argparse(capsys):
    """--megatron-args '--num-layer 6 ...' is one value (it has spaces), not a mistyped option of `plan`."""
    assert main(["plan", "--cluster", "h100x8", "--megatron-args", "--num-layer 6 --hidden-size 64"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "--megatron-args" in err
