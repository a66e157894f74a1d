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
