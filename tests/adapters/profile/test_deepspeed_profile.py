"""A DeepSpeed pipeline's layer list (LayerSpecs, modules, callables) through the profiler."""

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from deepspeed.pipe import LayerSpec  # noqa: E402

from octopipe_plugin.adapters.deepspeed.profile import profile_layer_list  # noqa: E402
from octopipe_plugin.profile import ProfileSettings  # noqa: E402

FAST = ProfileSettings(device="cpu", warmup=0, repeats=2)
BUILDS = []


class Block(nn.Module):
    """A residual MLP block that counts how often it is built."""

    def __init__(self, h: int):
        super().__init__()
        BUILDS.append(h)
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def pipeline(h: int):
    return [LayerSpec(nn.Linear, 16, h), *[LayerSpec(Block, h) for _ in range(4)], lambda x: x.float().sum(-1).mean()]


def test_layer_specs_profile_once_and_from_the_cache_build_nothing():
    BUILDS.clear()
    first = profile_layer_list(pipeline(32), lambda d: torch.randn(4, 8, 16), settings=FAST)
    kinds = [l.kind for l in first.model.layers]
    assert kinds == ["Linear", "Block", "Block", "Block", "Block", "<lambda>"]
    assert first.stats.distinct == 3 and first.stats.measured == 3 and BUILDS == [32]
    assert first.model.layers[-1].wgrad_ms == 0.0 and first.model.layers[-1].output_bytes == 4
    assert first.model.meta["impl"] == "deepspeed" and first.model.meta["profile"]["versions"]["deepspeed"] != "absent"
    BUILDS.clear()
    again = profile_layer_list(pipeline(32), lambda d: torch.randn(4, 8, 16), settings=FAST)
    # the LayerSpecs are named by their arguments: nothing is built; the lambda is rebuilt (cheap) and hit
    assert again.stats.measured == 0 and again.stats.cache_hits == 3 and BUILDS == []
    wider = profile_layer_list(pipeline(48), lambda d: torch.randn(4, 8, 16), settings=FAST)
    assert wider.stats.measured == 3  # new arguments, new shapes: measured again


def test_bad_entry_is_refused():
    with pytest.raises(TypeError, match="layer 1: expected a LayerSpec"):
        profile_layer_list([nn.Linear(4, 4), 3], lambda d: torch.randn(2, 4), settings=FAST)
