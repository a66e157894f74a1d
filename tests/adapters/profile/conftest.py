"""Shared fixtures of the profiler tests: one CPU thread (the machine is shared), a private cache and calibration."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Profile on one intra-op thread, as the fidelity benchmark's ranks do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def private_files(tmp_path, monkeypatch):
    """Every test gets its own profile cache and calibration file (never the user's or the shipped one)."""
    monkeypatch.setenv("OCTOPIPE_PROFILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OCTOPIPE_CALIBRATION", str(tmp_path / "calibration.json"))
