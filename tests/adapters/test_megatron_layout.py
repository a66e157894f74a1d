"""Plan -> Megatron layout strings, checked by megatron-core's own parser, validator and per-rank queries."""

from contextlib import contextmanager

import pytest
from hypothesis import given, settings, strategies as st

from octopipe_plugin.adapters.megatron import (
    hybrid_pattern_to_boundaries,
    layout_to_boundaries,
    megatron_launch_args,
    plan_to_hybrid_pattern,
    plan_to_layout,
)
from octopipe_plugin.adapters.megatron.layout import expand_layout
from octopipe_plugin.costs import resolve_cluster, resolve_model
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import Layer, Model
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.tuner import tune

pytestmark = pytest.mark.framework

DECODER = ("dense", "dense_local", "moe")


@contextmanager
def virtual_size(vp):
    """Megatron's layout queries read the VP world size from parallel_state; set it as a run with VP would."""
    from megatron.core import parallel_state

    old = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(old)


def megatron_view(layout, pp):
    """Per stage i (rank i % pp, virtual stage i // pp): (decoder count, decoder offset, mtp count) per Megatron."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    parsed = PipelineParallelLayerLayout(layout, pp)
    vp = parsed.virtual_pipeline_model_parallel_size
    out = []
    with virtual_size(vp):
        for i in range(pp * vp):
            q = dict(vp_stage=i // pp, pp_rank=i % pp)
            out.append((parsed.get_num_layers_to_build(LayerType.decoder, **q),
                        parsed.get_layer_offset(LayerType.decoder, **q),
                        parsed.get_num_layers_to_build(LayerType.mtp, **q)))
    return parsed, out


def expected_view(plan, model):
    """The same per-stage triples computed from the plan's layer ranges."""
    kinds = [layer.kind for layer in model.layers]
    out, offset = [], 0
    for stage in plan.stages:
        k = kinds[stage.start:stage.end]
        dec = sum(1 for x in k if x in DECODER)
        out.append((dec, offset, k.count("mtp")))
        offset += dec
    return out


def check_against_megatron(plan, model):
    """plan_to_layout's string is valid for Megatron and builds exactly the plan's stages; it round-trips."""
    from megatron.core.transformer.enums import LayerType

    layout = plan_to_layout(plan, model)
    pp = plan.num_devices
    parsed, view = megatron_view(layout, pp)
    kinds = [layer.kind for layer in model.layers]
    mtp = kinds.count("mtp")
    parsed.validate_layer_layout(num_layers=sum(k in DECODER for k in kinds), mtp_num_layers=mtp or None)
    assert view == expected_view(plan, model)
    vp = parsed.virtual_pipeline_model_parallel_size
    # pre_process (rank 0, virtual stage 0) and post_process (rank pp-1, last virtual stage) stages
    assert LayerType.embedding in parsed.layout[0][0] and LayerType.loss in parsed.layout[pp - 1][vp - 1]
    assert layout_to_boundaries(layout, model) == [(s.start, s.end) for s in plan.stages]
    return layout


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3-mini", "gemma3"])
@pytest.mark.parametrize("schedule,devices,v", [("1f1b", 4, 1), ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 2, 3),
                                                ("gpipe", 8, 1), ("zb-h1", 3, 1)])
def test_builtin_plans_megatron_split(name, schedule, devices, v):
    model = resolve_model(name)
    plan = build_plan(model, schedule, devices, 8, stages_per_device=v, split="megatron")
    check_against_megatron(plan, model)


def test_balanced_split_and_mtp_standalone():
    """A balanced split of the MTP model: MTP may sit on another rank's last virtual stage than the loss."""
    model = resolve_model("deepseek-v3-mini")
    n = model.num_layers
    # 2 ranks x 2 virtual stages: MTP alone in stage 2 (rank 0, last virtual stage), loss in stage 3.
    plan = build_plan(model, "interleaved-1f1b", 2, 4, stages_per_device=2, boundaries=[0, 12, n - 2, n - 1, n])
    layout = check_against_megatron(plan, model)
    assert layout.split("|")[2] == "m" and layout.split("|")[3] == "L"
    ok = build_plan(model, "1f1b", 4, 8, split="balanced")
    check_against_megatron(ok, model)


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3-mini"])
def test_tuned_plans_are_expressed_or_refused(name):
    """The tuner's plan: a looped one becomes a layout Megatron accepts, any other placement is refused."""
    model = resolve_model(name)
    for seed in range(3):
        plan = tune(model, resolve_cluster("h100x4"), 8, iterations=20, seed=seed).plan
        looped = all(st.device == i % plan.num_devices for i, st in enumerate(plan.stages))
        if looped and plan.stages[0].end > 0 and plan.stages[-1].num_layers > 0:
            try:
                check_against_megatron(plan, model)
            except OctoPipeError as exc:  # only the MTP placement rule may still refuse a looped plan
                assert "MTP" in str(exc)
        else:
            with pytest.raises(OctoPipeError, match="executor"):
                plan_to_layout(plan, model)


def tiny_model(kinds):
    layer = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    return Model(name="tiny", layers=tuple(Layer(name=f"l{i}", kind=k, **layer) for i, k in enumerate(kinds)))


@st.composite
def plans(draw):
    decoder = draw(st.lists(st.sampled_from(DECODER), min_size=0, max_size=8))
    mtp = draw(st.integers(0, 2))
    model = tiny_model(["embedding", *decoder] + ["mtp"] * mtp + ["lm_head"])
    pp = draw(st.integers(1, 3))
    vp = draw(st.integers(1, 3)) if pp > 1 else 1  # no interleaving on one rank
    cuts = sorted(draw(st.lists(st.integers(0, model.num_layers), min_size=pp * vp - 1, max_size=pp * vp - 1)))
    plan = build_plan(model, "interleaved-1f1b", pp, pp, stages_per_device=vp, boundaries=[0, *cuts, model.num_layers])
    return model, plan


def megatron_accepts(plan, model):
    """Megatron's verdict on the stages as they are: its validator plus where pre/post_process build E and L."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    sym = {"embedding": "E", "lm_head": "L", "mtp": "m", **{k: "t" for k in DECODER}}
    text = "|".join("".join(sym[layer.kind] for layer in model.layers[s.start:s.end]) for s in plan.stages)
    kinds = [layer.kind for layer in model.layers]
    parsed = PipelineParallelLayerLayout(text, plan.num_devices)
    try:
        parsed.validate_layer_layout(num_layers=sum(k in DECODER for k in kinds),
                                     mtp_num_layers=kinds.count("mtp") or None)
    except AssertionError:
        return False
    return LayerType.embedding in parsed.layout[0][0] and LayerType.loss in parsed.layout[-1][-1]


@settings(max_examples=150, deadline=None)
@given(plans())
def test_refuses_exactly_what_megatron_refuses(case):
    model, plan = case
    if megatron_accepts(plan, model):
        check_against_megatron(plan, model)
    else:
        with pytest.raises(OctoPipeError, match="executor"):
            plan_to_layout(plan, model)


@pytest.mark.parametrize("text", ["Ettt|(tt|)*3,m|L", "E,t*3|t*2||tL", "(Et|)*1,(t|)*2,tmL", "E|t|t|tL"])
def test_expand_matches_megatron_parser(text):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    sym = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    ours = [list(stage) for stage in expand_layout(text).split("|")]
    theirs = [[sym[t.name] for t in stage] for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
    assert ours == theirs


def test_refusals_name_the_reason():
    llama = resolve_model("llama3-8b")
    with pytest.raises(OctoPipeError, match="V-shape.*executor"):
        plan_to_layout(build_plan(llama, "zb-v", 4, 8), llama)
    with pytest.raises(OctoPipeError, match="vision.*encoder"):
        plan_to_layout(build_plan(resolve_model("vlm"), "1f1b", 4, 8), resolve_model("vlm"))
    n = llama.num_layers
    empty_first = build_plan(llama, "1f1b", 2, 4, boundaries=[0, 0, n])
    with pytest.raises(OctoPipeError, match=r"embedding.*first stage \(0, where pre_process"):
        plan_to_layout(empty_first, llama)
    empty_last = build_plan(llama, "1f1b", 2, 4, boundaries=[0, n, n])
    with pytest.raises(OctoPipeError, match="lm_head.*post_process"):
        plan_to_layout(empty_last, llama)
    nemo = resolve_model("nemotron-h")
    with pytest.raises(OctoPipeError, match="hybrid-layer-pattern"):
        plan_to_layout(build_plan(nemo, "1f1b", 4, 8), nemo)
    with pytest.raises(OctoPipeError, match="first stage"):
        layout_to_boundaries("|E" + "t" * 32 + "L", llama)
    with pytest.raises(OctoPipeError, match="stage 1 position 0"):
        layout_to_boundaries("E" + "t" * 31 + "|mL", llama)
    with pytest.raises(OctoPipeError, match="unknown character"):
        layout_to_boundaries("Ex|L", llama)


def test_launch_args_gpt():
    model = resolve_model("deepseek-v3-mini")
    plan = build_plan(model, "interleaved-1f1b", 4, 8, stages_per_device=2)
    args = megatron_launch_args(plan, model)
    layout = plan_to_layout(plan, model)
    # no --num-virtual-stages-per-pipeline-rank: Megatron refuses it next to a layout (arguments.py)
    assert args == ["--pipeline-model-parallel-size", "4", "--num-layers", "24",
                    "--pipeline-model-parallel-layout", layout, "--mtp-num-layers", "1"]


@pytest.fixture
def one_process_group(tmp_path):
    """select_pipeline_segment logs through torch.distributed: give it a real one-rank gloo group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("devices,v", [(4, 1), (4, 2), (2, 3)])
def test_hybrid_pattern_segments_per_megatron(devices, v, one_process_group):
    """Nemotron-H: each '|' segment Megatron selects for (rank, virtual stage) holds the plan's stage layers."""
    import torch.distributed as dist
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern, select_pipeline_segment

    model = resolve_model("nemotron-h")
    plan = build_plan(model, "interleaved-1f1b", devices, 8, stages_per_device=v, split="balanced")
    pattern = plan_to_hybrid_pattern(plan, model)
    assert parse_hybrid_pattern(pattern).main_pattern == pattern
    sym = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
    decoder = [sym[layer.kind] for layer in model.layers[1:-1]]
    offset = 0
    for i, stage in enumerate(plan.stages):
        # pp_group=None makes Megatron read segment vp_stage * 1 + 0 = i: the segment stage i's rank selects.
        layers, got_offset = select_pipeline_segment(pattern, None, i, tp_group=dist.group.WORLD,
                                                     dp_cp_group=dist.group.WORLD)
        want = decoder[max(stage.start - 1, 0):min(stage.end - 1, len(decoder))]
        assert ("".join(layers), got_offset) == ("".join(want), offset)
        offset += len(want)
    assert hybrid_pattern_to_boundaries(pattern, model) == [(s.start, s.end) for s in plan.stages]
    args = megatron_launch_args(plan, model)
    assert args == ["--pipeline-model-parallel-size", str(devices), "--hybrid-layer-pattern", pattern]
