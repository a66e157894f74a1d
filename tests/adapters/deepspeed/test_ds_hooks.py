"""The DeepSpeed names OctoPipe replaces: two, listed by `installed()`, nothing else touched; the
supported versions stated once (versions.SUPPORTED, setup.py the same) and checked in one line."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.framework
ROOT = Path(__file__).resolve().parents[3]


def test_installed_lists_exactly_the_engine_choosers():
    import deepspeed
    from deepspeed.runtime.pipe.engine import PipelineEngine

    import octopipe_plugin.deepspeed as od

    stock_load = PipelineEngine.__dict__.get("load_checkpoint")
    od.install()  # idempotent
    names = [line.split(":")[0] for line in od.installed()]
    assert names == ["deepspeed.PipelineEngine", "deepspeed.DualPipeVEngine"]
    assert PipelineEngine.__dict__.get("load_checkpoint") is stock_load  # no class-wide patch of the stock engine
    assert issubclass(od.OctoPipeEngine, deepspeed.PipelineEngine)  # the chooser answers as DeepSpeed's class


def test_setup_py_states_the_supported_range():
    from octopipe_plugin.adapters.deepspeed.versions import SUPPORTED

    assert re.search(r'"deepspeed\s*' + re.escape(SUPPORTED) + '"', (ROOT / "setup.py").read_text())


def test_another_version_is_refused_in_one_line():
    from octopipe_plugin.adapters.deepspeed.versions import SUPPORTED, UnsupportedVersion, check_version, supported

    import deepspeed

    assert supported(deepspeed.__version__)
    check_version("0.19.8")
    with pytest.raises(UnsupportedVersion) as err:
        check_version("0.18.2")
    assert "\n" not in str(err.value) and "DeepSpeed 0.18.2 is not supported" in str(err.value)
    assert SUPPORTED in str(err.value) and '"enabled": false' in str(err.value)


def test_block_refused_ends_a_process_with_its_line_alone():
    import subprocess
    import sys

    code = ("from octopipe_plugin.adapters.deepspeed.config import BlockRefused\n"
            "raise BlockRefused('ds_config: field $.octopipe.plan: expected x')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 1 and out.stderr.strip() == "ds_config: field $.octopipe.plan: expected x"
