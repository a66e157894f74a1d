"""Both adapters' tune settings take the memory headroom: Megatron's launch argument, DeepSpeed's config field."""

from __future__ import annotations

import os
import sys

import pytest

from octopipe_plugin.adapters.deepspeed.config import parse_block
from octopipe_plugin.errors import FormatError, OctoPipeError

GIB = 2**30


def test_deepspeed_block_takes_memory_headroom():
    block = parse_block({"octopipe": {"tune": {"cluster": "h100x4", "memory_headroom": "6GiB"}}})
    assert block.tune.memory_headroom == "6GiB"
    assert parse_block({"octopipe": {"tune": {"cluster": "h100x4"}}}).tune.memory_headroom == "8%"
    assert parse_block({"octopipe": {"tune": {"cluster": "h100x4", "memory_headroom": 0.1}}}).tune.memory_headroom \
        == "0.1"
    with pytest.raises(FormatError, match=r"\$\.octopipe\.tune\.memory_headroom: expected GiB .* got 'lots'"):
        parse_block({"octopipe": {"tune": {"cluster": "h100x4", "memory_headroom": "lots"}}})


@pytest.mark.framework
def test_megatron_launch_argument_sets_the_tuning_clusters_headroom():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "megatron_launch"))
    from launch_helpers import TINY_GPT, parse

    from octopipe_plugin.adapters.megatron.startup import tuning_cluster

    args = parse(TINY_GPT + ["--octopipe-cluster", "h100x1", "--octopipe-memory-headroom", "10GiB"])
    cl = tuning_cluster(args)
    assert cl.memory_headroom_bytes == 10 * GIB and cl.usable_memory_bytes == cl.memory_bytes - 10 * GIB
    default = tuning_cluster(parse(TINY_GPT + ["--octopipe-cluster", "h100x1"]))
    assert default.memory_headroom_bytes == int(default.memory_bytes * 0.08)
    with pytest.raises(OctoPipeError, match="--octopipe-memory-headroom 'x'"):
        tuning_cluster(parse(TINY_GPT + ["--octopipe-cluster", "h100x1", "--octopipe-memory-headroom", "x"]))
