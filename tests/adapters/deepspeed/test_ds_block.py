"""The "octopipe" block of a DeepSpeed config: every refusal names the field."""

import pytest

from octopipe_plugin.adapters.deepspeed.config import OctoPipeBlock, TuneSpec, check_microbatches, parse_block
from octopipe_plugin.errors import FormatError


def test_absent_or_disabled_block_changes_nothing():
    assert parse_block({"train_batch_size": 8}) is None
    assert parse_block({"octopipe": {"enabled": False, "plan": 3}}) is None


def test_valid_blocks():
    assert parse_block({"octopipe": {"plan": "p.json"}}) == OctoPipeBlock(plan="p.json")
    block = parse_block({"octopipe": {"tune": {"cluster": "h100x4", "gpu": "h200", "time_budget_s": 5},
                                      "save_plan": "out/plan.json", "timeout_s": 30}})
    assert block.tune == TuneSpec(cluster="h100x4", gpu="h200", time_budget_s=5.0)
    assert block.plan is None and block.save_plan == "out/plan.json" and block.timeout_s == 30.0


@pytest.mark.parametrize("block, field", [
    ([], r"\$\.octopipe: expected an object"),
    ({"plan": "p.json", "plans": 1}, r"\$\.octopipe\.plans: expected one of the known fields"),
    ({"enabled": "yes", "plan": "p.json"}, r"\$\.octopipe\.enabled: expected true or false"),
    ({}, r"\$\.octopipe\.plan: expected the path of an octopipe-plan/1 file .*or a \"tune\" object"),
    ({"plan": "p.json", "tune": {"cluster": "h100x4"}}, r"\$\.octopipe\.plan: expected either"),
    ({"plan": 7}, r"\$\.octopipe\.plan: expected the path"),
    ({"tune": "h100x4"}, r"\$\.octopipe\.tune: expected an object"),
    ({"tune": {"gpu": "H100"}}, r"\$\.octopipe\.tune\.cluster: expected a named cluster"),
    ({"tune": {"cluster": "h100x4", "gpu": "Z9"}}, r"\$\.octopipe\.tune\.gpu: expected .*H100"),
    ({"tune": {"cluster": "h100x4", "time_budget_s": -1}}, r"\$\.octopipe\.tune\.time_budget_s: expected a positive"),
    ({"tune": {"cluster": "h100x4", "budget": 1}}, r"\$\.octopipe\.tune\.budget: expected one of the known fields"),
    ({"plan": "p.json", "layer_of_spec": "0,1"}, r"\$\.octopipe\.layer_of_spec: expected a list"),
    ({"tune": {"cluster": "h100x4", "seq_len": 0}}, r"\$\.octopipe\.tune\.seq_len: expected a positive integer"),
    ({"plan": "p.json", "timeout_s": 0}, r"\$\.octopipe\.timeout_s: expected a positive"),
    ({"plan": "p.json", "save_plan": ""}, r"\$\.octopipe\.save_plan: expected a file path"),
])
def test_bad_block_refused_naming_the_key(block, field):
    with pytest.raises(FormatError, match=r"ds_config: field " + field):
        parse_block({"octopipe": block})


def test_microbatch_count_must_be_gradient_accumulation_steps():
    check_microbatches(8, 8)
    with pytest.raises(FormatError, match=r"gradient_accumulation_steps: expected the plan's micro-batch count 8.*got 4"):
        check_microbatches(8, 4)


def test_missing_plan_file_is_named_by_the_field_that_gave_it(tmp_path):
    from octopipe_plugin.plan_startup import PlanSteps, obtain_plan

    missing = str(tmp_path / "nowhere.json")
    with pytest.raises(FormatError, match=r"^ds_config: field \$\.octopipe\.plan: expected an existing "
                                          r"octopipe-plan/1 file, got '.*nowhere\.json'$"):
        obtain_plan(PlanSteps(plan_file=missing, plan_field=("ds_config", "$.octopipe.plan")))


def test_plan_checked_against_the_run():
    from octopipe_plugin.adapters.deepspeed.plan_check import RunShape, check_plan
    from octopipe_plugin.formats import Layer, Model
    from octopipe_plugin.schedules.registry import build_plan

    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    plan = build_plan(Model(name="m", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(6))),
                      "1f1b", 2, 4)
    check_plan(plan, RunShape(6, None, 2, 4, 4))
    check_plan(plan, RunShape(8, (0, 1, 1, 2, 3, 4, 5, 5), 2, 2, 4))  # two layers split over two list entries
    cases = [
        (RunShape(14, None, 2, 2, 4), r"\$\.octopipe\.plan: expected a plan for the PipelineModule's 14 list "
                                      r"entries; the plan has 6 layers"),
        (RunShape(4, None, 2, 2, 4), r"the PipelineModule's 4 list entries; the plan has 6 layers"),  # more layers
        (RunShape(7, (0, 1, 2, 3, 4, 5, 6), 2, 2, 4), r"the 7 layers layer_of_spec maps .* has 6 layers"),
        (RunShape(6, (0, 1), 2, 2, 4), r"\$\.octopipe\.layer_of_spec: expected one OctoPipe layer index per"),
        (RunShape(6, None, 4, 4, 4), r"a plan for the pipeline's 4 ranks; the plan has 2 devices"),
        (RunShape(6, None, None, 3, 4), r"a pipeline size that divides the world of 3 ranks"),
        (RunShape(6, None, 2, 2, 8), r"\$\.gradient_accumulation_steps: expected the plan's micro-batch count 4"),
    ]
    for run, message in cases:
        with pytest.raises(FormatError, match=message):
            check_plan(plan, run)


def test_overlapped_pairs_need_a_moe_entry_on_a_paired_stage():
    # a pair of stages without a deepspeed.moe.layer.MoE entry has no all-to-all to hide: it would run half after
    # half, priced as overlapped; with one (RunShape.moe_entries, read from the LayerSpecs) the plan passes
    from dataclasses import replace

    from octopipe_plugin.actions import Kind
    from octopipe_plugin.adapters.deepspeed.plan_check import RunShape, check_plan
    from octopipe_plugin.formats import Layer, Model
    from octopipe_plugin.schedules.registry import build_plan

    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    plan = build_plan(Model(name="m", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(6))),
                      "1f1b", 2, 4)
    row = plan.schedule[0]
    f = next(a for a in row if a.kind is Kind.F and a.microbatch == 2)
    b = next(a for a in row if a.kind is Kind.B and a.microbatch == 0)
    paired = replace(plan, pairs=((f, b),))
    with pytest.raises(FormatError, match=r"\$\.octopipe\.plan: expected overlapped pairs whose stages hold a "
                                          r"deepspeed\.moe\.layer\.MoE list entry .* pairs 0F2\+0B0 on stages 0, "
                                          r"whose list entries 0-2 hold none .*; give each MoE layer its own "
                                          r"LayerSpec\(MoE, \.\.\.\) entry"):
        check_plan(paired, RunShape(6, None, 2, 4, 4))
    with pytest.raises(FormatError, match=r"list entries 0-3 hold none"):  # entry 4 is stage 1's
        check_plan(paired, RunShape(8, (0, 0, 1, 2, 3, 3, 4, 5), 2, 4, 4, frozenset({6})))
    check_plan(paired, RunShape(6, None, 2, 4, 4, frozenset({1})))
    check_plan(paired, RunShape(8, (0, 0, 1, 2, 3, 3, 4, 5), 2, 4, 4, frozenset({1})))
