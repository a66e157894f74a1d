"""Timer's cache flush: written over afresh before every timed call; none unless asked for."""

import torch

from octopipe_plugin.profile.measure import measure_layer
from octopipe_plugin.profile.timing import Timer


def test_flush_is_written_afresh_before_each_timed_call():
    timer = Timer(torch.device("cpu"), flush_bytes=4096)
    seen = []

    def call():
        seen.append(int(timer._flush.sum()))  # what the flush left when the timed call began
        timer._flush.zero_()
        return 7

    for _ in range(3):
        out, ms = timer.timed(call)
        assert out == 7 and ms >= 0.0
    assert seen == [4096, 4096, 4096]  # written afresh before each call


def test_no_flush_by_default():
    assert Timer(torch.device("cpu"))._flush is None


def test_measure_layer_with_a_flush_profiles_every_phase():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    prof = measure_layer(layer, torch.randn(4, 16), torch.device("cpu"), warmup=0, repeats=2, walk_nodes=0,
                         flush_bytes=1 << 16)
    assert all(getattr(prof, f).samples == 2 and getattr(prof, f).median_ms > 0 for f in ("fwd", "bwd", "wgrad", "fused"))
