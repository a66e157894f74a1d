"""Plan -> chunks for any stage->rank map, checked through Megatron's own layout queries and validator."""

import random
from contextlib import contextmanager

import pytest

from octopipe_plugin.adapters.megatron import chunk_specs, mapped_layout
from octopipe_plugin.adapters.megatron.mapping import copy_ranks, embedding_ranks_fn
from octopipe_plugin.adapters.megatron.schedule import make_forward_backward_func
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.testing.plans import make_plan, placement, random_bounds, sample_schedule
from octopipe_plugin.formats import Layer, Model

pytestmark = [pytest.mark.framework]


def gpt(decoder: int, mtp: int = 0) -> Model:
    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    kinds = ["embedding"] + ["dense"] * decoder + ["mtp"] * mtp + ["lm_head"]
    return Model(name="gpt", layers=tuple(Layer(name=f"l{i}", kind=k, **cost) for i, k in enumerate(kinds)))


def plan_for(model, devices, num_devices, seed):
    rng = random.Random(seed)
    bounds = random_bounds(model.num_layers, len(devices), rng)
    return make_plan(stage_devices=devices, bounds=bounds, num_devices=num_devices, num_microbatches=4,
                     schedule=sample_schedule(devices, num_devices, 4, rng))


@contextmanager
def virtual_size(vp):
    """Megatron's layout queries read the VP world size from parallel_state."""
    from megatron.core import parallel_state

    old = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(old)


CASES = [("looped", 8, 4), ("v", 8, 4), ("v", 4, 2), ("looped", 6, 3)]


@pytest.mark.parametrize("kind,stages,devices", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_follow_the_plan(kind, stages, devices, seed):
    """Each (rank, vp_stage) builds the plan's stage: decoder count and global offset per Megatron's own queries."""
    from megatron.core.transformer.enums import LayerType

    model = gpt(decoder=10)
    plan = plan_for(model, placement(kind, stages, devices), devices, seed)
    layout = mapped_layout(plan, model)
    layout.validate_layer_layout(num_layers=10, mtp_num_layers=None)  # Megatron's validator
    kinds = [layer.kind for layer in model.layers]
    decoder_before = 0
    expected = {}
    for s, st in enumerate(plan.stages):
        n = sum(k == "dense" for k in kinds[st.start:st.end])
        expected[s] = (n, decoder_before)
        decoder_before += n
    vp = stages // devices
    with virtual_size(vp):
        for rank in range(devices):
            specs = chunk_specs(plan, model, rank)
            assert [c.stage for c in specs] == plan.stages_of(rank)
            for c in specs:
                q = dict(vp_stage=c.vp_stage, pp_rank=rank)
                got = (layout.get_num_layers_to_build(LayerType.decoder, **q),
                       layout.get_layer_offset(LayerType.decoder, **q))
                assert got == expected[c.stage] == (c.num_decoder_layers, c.decoder[0])
                assert c.pre_process == (c.stage == 0) and c.post_process == (c.stage == stages - 1)


def test_mtp_sits_with_the_loss_under_a_v_shape():
    from megatron.core.transformer.enums import LayerType

    model = gpt(decoder=6, mtp=1)
    plan = make_plan(stage_devices=placement("v", 4, 2), bounds=[(0, 3), (3, 5), (5, 7), (7, 9)], num_devices=2,
                     num_microbatches=2, schedule=sample_schedule(placement("v", 4, 2), 2, 2, random.Random(0)))
    layout = mapped_layout(plan, model)
    layout.validate_layer_layout(num_layers=6, mtp_num_layers=1)
    with virtual_size(2):
        assert layout.get_num_layers_to_build(LayerType.mtp, vp_stage=1, pp_rank=0) == 1  # stage 3 on rank 0
        assert layout.get_num_layers_to_build(LayerType.mtp, vp_stage=1, pp_rank=1) == 0
    assert copy_ranks(plan, model, tied=False) == [0]
    assert embedding_ranks_fn(plan, model, tied=True)([10, 11]) == [10]


def test_a_split_tied_head_holds_no_copy_of_the_embedding():
    """Megatron's embedding group holds the ranks with whole copies: a tied head the plan splits is rows of the
    embedding tied by executor.tied_rows, so its rank stays out (unless it holds the embedding itself)."""
    from dataclasses import replace

    from octopipe_plugin.formats.splits import SplitLayer

    model = gpt(decoder=4)
    plan = make_plan(stage_devices=[0, 1], bounds=[(0, 3), (3, 6)], num_devices=2, num_microbatches=2,
                     schedule=sample_schedule([0, 1], 2, 2, random.Random(0)))
    split = replace(plan, splits=(SplitLayer(layer=5, devices=(1, 0), shares=(0.5, 0.5)),))
    assert copy_ranks(plan, model, tied=True) == [0, 1]
    assert copy_ranks(split, model, tied=True) == [0] == copy_ranks(split, model, tied=False)
    assert embedding_ranks_fn(split, model, tied=True)([10, 11]) == [10]


def test_refusals_name_what_is_wrong():
    model = gpt(decoder=4)
    empty_first = make_plan(stage_devices=[0, 1], bounds=[(0, 0), (0, 6)], num_devices=2, num_microbatches=2,
                            schedule=sample_schedule([0, 1], 2, 2, random.Random(0)))
    with pytest.raises(OctoPipeError, match="embedding must sit in stage 0"):
        chunk_specs(empty_first, model, 0)
    uneven = plan_for(model, [0, 1, 0], 2, 0)
    with pytest.raises(OctoPipeError, match="same number of model chunks"):
        mapped_layout(uneven, model)
    fb = make_forward_backward_func(plan_for(model, [0, 1], 2, 0))
    with pytest.raises(OctoPipeError, match="made for 4 micro-batches, this step has 8"):
        fb(forward_step_func=None, data_iterator=None, model=[object()], num_microbatches=8, seq_length=16,
           micro_batch_size=2)
