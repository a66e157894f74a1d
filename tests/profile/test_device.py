"""Device names map to the GPU table the analytic model and the calibration use."""

import pytest

from octopipe_plugin.profile.device import gpu_spec_for


@pytest.mark.parametrize("name, spec", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA A100-SXM4-80GB", "A100-80G"),
    ("NVIDIA B200", "B200"), ("NVIDIA GeForce RTX 4090", None), ("cpu AMD EPYC x1 threads", None),
])
def test_device_names_map_to_table_entries(name, spec):
    found = gpu_spec_for(name)
    assert (found.name if found else None) == spec
