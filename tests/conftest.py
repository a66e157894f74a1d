"""Session-wide test hygiene shared by every test directory."""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile

import pytest

# The analytic model applies the shipped calibration (octopipe_plugin/costs/calibration.json) once a
# GPU run has filled it: tests of the cost formulas must see the GPU table's efficiencies, and no
# test may write the user's profile cache. Subprocesses inherit both.
_SCRATCH = tempfile.mkdtemp(prefix="octopipe-tests-")
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
os.environ.setdefault("OCTOPIPE_CALIBRATION", os.path.join(_SCRATCH, "no-calibration.json"))
os.environ.setdefault("OCTOPIPE_PROFILE_CACHE", os.path.join(_SCRATCH, "profile-cache"))

# DeepSpeed's CPU accelerator maps a 66 MiB shared-memory all-reduce buffer per rank and never
# unlinks it. OctoPipe runs unlink theirs (adapters/deepspeed/shm.py, also called by ds_harness's
# worker); this catches a DeepSpeed-only run's, which would stay in /dev/shm (RAM) until reboot.
_DS_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(autouse=True)
def _drop_deepspeed_shm_buffers():
    """Unlink the DeepSpeed shared-memory buffers a test's (finished) ranks left behind."""
    before = set(glob.glob(_DS_SHM))
    yield
    for path in set(glob.glob(_DS_SHM)) - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
