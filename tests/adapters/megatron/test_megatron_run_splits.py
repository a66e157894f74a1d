"""What `--splits auto` tunes for a Megatron launch (startup.run_splits) follows the rule the run refuses by
(mapping.embedding_split_blocker): no split embedding where the run would refuse one, the head's split kept."""

from argparse import Namespace

import pytest

pytest.importorskip("megatron.core")

from octopipe_plugin.adapters.megatron.mapping import embedding_split_blocker  # noqa: E402
from octopipe_plugin.adapters.megatron.startup import run_splits  # noqa: E402


@pytest.mark.parametrize("untie,tp,mtp,expect", [
    (True, 1, 0, True),
    (False, 1, 0, False),  # Megatron's default: the embedding tied to the head
    (True, 2, 0, False),
    (True, 1, 1, False),
])
def test_run_splits_drops_the_embedding_split_the_run_refuses(untie, tp, mtp, expect):
    args = Namespace(untie_embeddings_and_output_weights=untie, tensor_model_parallel_size=tp, mtp_num_layers=mtp)
    fields = run_splits(args)
    assert fields["split_embedding"] is expect
    assert fields["owner_shard"] is True
    assert (embedding_split_blocker(mtp_layers=mtp, tp_size=tp, tied=not untie) is None) is expect


def test_blocker_names_the_flag_to_change():
    assert "--untie-embeddings-and-output-weights" in embedding_split_blocker(tied=True)
    assert "--tensor-model-parallel-size 1" in embedding_split_blocker(tp_size=4)
    assert "--mtp-num-layers 2" in embedding_split_blocker(mtp_layers=2)


def test_run_splits_and_the_start_up_refusal_are_one_rule():
    """For every setting of the three flags, the embedding split `--splits auto` may tune is exactly the one the
    launch's start-up takes (startup.split_refusal on a plan splitting the embedding), and the refusal's message is
    the rule's own, naming the plan field."""
    import itertools
    import random
    from dataclasses import replace

    from octopipe_plugin.adapters.megatron.mapping import side_split_blocker
    from octopipe_plugin.adapters.megatron.startup import split_refusal
    from octopipe_plugin.formats.splits import SplitLayer
    from octopipe_plugin.testing.plans import make_plan, sample_schedule

    plain = make_plan(stage_devices=[0, 1], bounds=[(0, 3), (3, 6)], num_devices=2, num_microbatches=2,
                      schedule=sample_schedule([0, 1], 2, 2, random.Random(0)))
    embedding = replace(plain, splits=(SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5)),))
    for untie, tp, mtp in itertools.product((True, False), (1, 2), (0, 1)):
        args = Namespace(untie_embeddings_and_output_weights=untie, tensor_model_parallel_size=tp, mtp_num_layers=mtp,
                         hybrid_layer_pattern=None, hybrid_override_pattern=None)
        refusal = split_refusal(args, embedding)
        assert run_splits(args)["split_embedding"] is (refusal is None), (untie, tp, mtp, refusal)
        blocker = side_split_blocker("input", mtp_layers=mtp, tp_size=tp, tied=not untie)
        assert refusal == (None if blocker is None else f"plan splits[0] (layer 0): {blocker}")
