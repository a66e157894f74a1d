"""Session-wide test hygiene shared by every test directory."""

from __future__ import annotations

import glob
import os

import pytest

# DeepSpeed's CPU accelerator maps a 66 MiB shared-memory all-reduce buffer per rank and never
# unlinks it: without this, every multi-rank DeepSpeed test leaves its buffers in /dev/shm
# (RAM) until the machine reboots.
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
