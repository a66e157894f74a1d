"""The disk cache: a second profile measures nothing, a changed shape or layer is measured again."""

import json

import torch
from torch import nn

from octopipe_plugin.profile import ProfileCache, ProfileLayer, ProfileSettings, profile_layers

FAST = ProfileSettings(device="cpu", warmup=0, repeats=2)


class Counting:
    """A module factory that counts how often it is built."""

    def __init__(self, h: int):
        self.h, self.builds = h, 0

    def __call__(self) -> nn.Module:
        self.builds += 1
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(self.h, 2 * self.h), nn.GELU(), nn.Linear(2 * self.h, self.h))


def stack(factory, seq: int, n: int = 4) -> list[ProfileLayer]:
    """n identical layers; only the first has an explicit input (the rest take the previous output's shape)."""
    first = ProfileLayer(name="l0", kind="mlp", build=factory, example_input=lambda d: torch.randn(2, seq, factory.h))
    return [first] + [ProfileLayer(name=f"l{i}", kind="mlp", build=factory) for i in range(1, n)]


def test_identical_layers_are_measured_once():
    r = profile_layers(stack(Counting(32), seq=16), settings=FAST)
    assert (r.stats.layers, r.stats.distinct, r.stats.measured, r.stats.cache_hits) == (4, 1, 1, 0)
    assert len({(l.fwd_ms, l.bwd_ms, l.wgrad_ms) for l in r.model.layers}) == 1
    assert [rec["cache"] for rec in r.model.meta["profile"]["layers"]] == ["miss", "repeat", "repeat", "repeat"]


def test_second_call_hits_the_cache_and_measures_nothing():
    first = profile_layers(stack(Counting(32), seq=16), settings=FAST)
    again = profile_layers(stack(Counting(32), seq=16), settings=FAST)
    assert again.stats.measured == 0 and again.stats.cache_hits == 1
    assert again.model.layers == first.model.layers


def test_cache_hit_with_a_known_signature_builds_nothing():
    def layers(f):
        return [ProfileLayer(name="a", kind="mlp", build=f, signature="mlp-32",
                             example_input=lambda d: torch.randn(2, 16, 32))]

    profile_layers(layers(Counting(32)), settings=FAST)
    f = Counting(32)
    r = profile_layers(layers(f), settings=FAST)
    assert r.stats.cache_hits == 1 and f.builds == 0


def test_shape_change_misses_the_cache():
    profile_layers(stack(Counting(32), seq=16), settings=FAST)
    r = profile_layers(stack(Counting(32), seq=24), settings=FAST)
    assert r.stats.measured == 1 and r.stats.cache_hits == 0
    assert r.model.meta["profile"]["layers"][0]["input"]["shape"] == [2, 24, 32]


def test_changed_layer_misses_the_cache():
    profile_layers(stack(Counting(32), seq=16), settings=FAST)
    changed = Counting(32)
    changed_layers = stack(changed, seq=16)
    changed_layers[2] = ProfileLayer(name="l2", kind="mlp", build=lambda: nn.Sequential(nn.Linear(32, 32)))
    r = profile_layers(changed_layers, settings=FAST)
    assert r.stats.distinct == 2 and r.stats.measured == 1 and r.stats.cache_hits == 1


def test_parallel_sizes_and_device_are_part_of_the_key():
    profile_layers(stack(Counting(32), seq=16), settings=FAST)
    other = ProfileSettings(device="cpu", warmup=0, repeats=2, parallel=(("tp", 1), ("pp", 1), ("dp", 4), ("ep", 1)))
    r = profile_layers(stack(Counting(32), seq=16), settings=other)
    assert r.stats.measured == 1
    # dp shards the optimizer: fp32 weights keep 4 + 4 + 8/4 bytes per parameter
    params = sum(p.numel() for p in Counting(32)().parameters())
    assert r.model.layers[0].state_bytes == params * 10


def test_unreadable_record_is_a_miss(tmp_path):
    cache_dir = tmp_path / "c"
    # host_link=False: the host-link rate is a record of its own in the cache; this one is the layer's
    settings = ProfileSettings(device="cpu", warmup=0, repeats=2, cache_dir=str(cache_dir), host_link=False)
    profile_layers(stack(Counting(32), seq=16), settings=settings)
    (record,) = cache_dir.glob("*.json")
    record.write_text("{not json")
    r = profile_layers(stack(Counting(32), seq=16), settings=settings)
    assert r.stats.measured == 1
    assert "record" in json.loads(record.read_text())


def test_no_cache_measures_every_time(tmp_path):
    settings = ProfileSettings(device="cpu", warmup=0, repeats=2, use_cache=False)
    profile_layers(stack(Counting(32), seq=16), settings=settings)
    r = profile_layers(stack(Counting(32), seq=16), settings=settings)
    assert r.stats.measured == 1 and not list(ProfileCache().directory.glob("*.json"))
