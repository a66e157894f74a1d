"""hooks.py: the one place Megatron names are replaced, listed by installed() and restored by uninstall()."""

import ast
from pathlib import Path

import pytest

from octopipe_plugin.adapters.megatron import hooks
from octopipe_plugin.formats import Plan, Stage

pytestmark = [pytest.mark.framework]
PACKAGE = Path(__file__).resolve().parents[3] / "octopipe_plugin" / "adapters" / "megatron"


def _v_plan() -> Plan:
    # V-shape over 2 ranks: stages 0 and 3 on rank 0, 1 and 2 on rank 1
    stages = tuple(Stage(start=i, end=i + 1, device=d) for i, d in enumerate((0, 1, 1, 0)))
    return Plan(model="v", stages=stages, schedule=((), ()), num_microbatches=1, num_devices=2)


def test_pipeline_view_answers_for_the_plan_inside_and_megatron_outside():
    import megatron.core.parallel_state as ps

    megatron_first, megatron_last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    try:
        with hooks.pipeline_view(_v_plan(), 0):
            assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()  # rank 0 holds stages 0 and 3
            assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)
            assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
            assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
            with hooks.pipeline_view(_v_plan(), 1):
                assert not ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
            assert ps.is_pipeline_first_stage()
        assert [line.split(":")[0] for line in hooks.installed()] == [
            "megatron.core.parallel_state.is_pipeline_first_stage", "megatron.core.parallel_state.is_pipeline_last_stage",
            "megatron.core.models.hybrid.hybrid_layer_allocation.select_pipeline_segment"]
    finally:
        hooks.uninstall()
    assert hooks.installed() == []
    assert ps.is_pipeline_first_stage is megatron_first and ps.is_pipeline_last_stage is megatron_last


def test_a_hybrid_chunk_built_in_the_view_takes_the_plans_segment():
    """HybridModel asks select_pipeline_segment for (its layers, their global offset): under the V-shape, chunk 1
    of rank 0 is stage 3 (Megatron's round-robin would give segment 1 * 2 + 0 = 2); uninstalled, Megatron's own."""
    import megatron.core.models.hybrid.hybrid_layer_allocation as alloc

    megatron_select = alloc.select_pipeline_segment

    pattern = "M*|-|*M-|-"  # the plan's stages in stage order, as start-up writes them
    try:
        with hooks.pipeline_view(_v_plan(), 0):
            assert alloc.select_pipeline_segment(pattern, None, 0) == (["M", "*"], 0)
            assert alloc.select_pipeline_segment(pattern, None, 1) == (["-"], 6)
        with hooks.pipeline_view(_v_plan(), 1):
            assert alloc.select_pipeline_segment(pattern, None, 0) == (["-"], 2)
            assert alloc.select_pipeline_segment(pattern, None, 1) == (["*", "M", "-"], 3)
            with pytest.raises(Exception, match="has 2 '\\|' segments but the plan has 4 stages"):
                alloc.select_pipeline_segment("M*|-", None, 0)
    finally:
        hooks.uninstall()
    assert alloc.select_pipeline_segment is megatron_select


def test_only_hooks_assigns_attributes_of_other_modules():
    """No module of the adapter but hooks.py sets a module-level or class attribute (setattr / `x.y = ...`)."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "hooks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                target = ast.unparse(node.args[0])
                if target not in ("args",):  # the run's argument namespace (startup applies the plan's layout)
                    offenders.append(f"{path.name}:{node.lineno} setattr({target}, ...)")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                            t.value.id in ("training", "arguments", "parallel_state", "ps", "builder_cls"):
                        offenders.append(f"{path.name}:{node.lineno} {ast.unparse(t)} = ...")
    assert offenders == []


def test_another_megatron_core_version_is_refused_before_any_patch(monkeypatch):
    from octopipe_plugin.adapters.megatron import compat, launch
    from octopipe_plugin.errors import OctoPipeError

    assert compat.check_megatron_version().startswith("0.19.")  # the installed one
    for ok in ("0.19.0", "0.19.1", "0.19.2+0febf26", "0.19.3rc0"):
        compat.check_megatron_version(ok)
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.16.1")
    compat.require_supported_megatron.cache_clear()
    try:
        with pytest.raises(OctoPipeError) as exc:
            launch.prepare_launch(["--num-layers", "2", "--pipeline-schedule", "octopipe", "--octopipe-plan", "p.json"])
        assert str(exc.value).startswith("megatron-core 0.16.1: OctoPipe's Megatron adapter supports megatron-core "
                                         f"{compat.SUPPORTED_MEGATRON_CORE} ")
        assert "\n" not in str(exc.value) and hooks.installed() == []
        with pytest.raises(OctoPipeError, match="megatron-core 0.20.0: "):
            compat.check_megatron_version("0.20.0")
    finally:
        compat.require_supported_megatron.cache_clear()


def test_setup_states_the_supported_range():
    from octopipe_plugin.adapters.megatron.compat import SUPPORTED_MEGATRON_CORE

    setup = (PACKAGE.parents[2] / "setup.py").read_text()
    assert f'"megatron-core{SUPPORTED_MEGATRON_CORE}"' in setup
