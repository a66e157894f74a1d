"""`octopipe export --torch-csv`: torch's own loader runs the CSV on gloo with the executor's losses and gradients."""

from __future__ import annotations

import json
import os

import pytest

from octopipe_plugin.actions import Action, Kind
from octopipe_plugin.cli import main
from octopipe_plugin.formats import Layer, Model, plan_from_dict, plan_to_dict, write_plan
from octopipe_plugin.schedules.registry import build_plan

LAYERS = ("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head")


def _model() -> Model:
    return Model(name="toy", layers=tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0,
                                                state_bytes=1, activation_bytes=1, output_bytes=1)
                                          for i in range(len(LAYERS))))


def _export(capsys, plan, tmp_path, *extra, expect=0):
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    rc = main(["export", str(path), "--torch-csv", str(tmp_path / "plan.csv"), *extra])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if expect == 0 else err


@pytest.mark.parametrize("name, v, style, why", [
    ("zb-v", 2, "loop", "torchtitan's 'loop' assignment puts stage s on rank s % 2"),
    ("interleaved-1f1b", 2, "v", "exactly two stages per rank, r and 3 - r"),
])
def test_plans_torchtitan_cannot_assign_are_refused(capsys, tmp_path, name, v, style, why):
    err = _export(capsys, build_plan(_model(), name, 2, 4, stages_per_device=v), tmp_path, "--style", style,
                  expect=2)
    assert why in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "plan.csv").exists()


def test_uneven_stage_counts_and_out_of_order_losses_are_refused(capsys, tmp_path):
    plan = build_plan(_model(), "1f1b", 2, 4)
    mbs = range(4)
    uneven = plan_from_dict({  # three stages, rank 0 holds two of them (GPipe order)
        **plan_to_dict(plan),
        "stages": [{"layers": [0, 3], "device": 0}, {"layers": [3, 6], "device": 1}, {"layers": [6, 8], "device": 0}],
        "schedule": [[f"0F{i}" for i in mbs] + [f"2F{i}" for i in mbs] + [f"2B{i}" for i in mbs]
                     + [f"0B{i}" for i in mbs], [f"1F{i}" for i in mbs] + [f"1B{i}" for i in mbs]]})
    err = _export(capsys, uneven, tmp_path, expect=2)
    assert "3 stages on 2 ranks" in err
    rows = [list(r) for r in plan.schedule]
    last = rows[1]
    i0, i1 = last.index(Action(1, Kind.F, 0)), last.index(Action(1, Kind.F, 1))
    last[i0], last[i1] = last[i1], last[i0]
    swapped = plan_from_dict({**plan_to_dict(plan), "schedule": [[str(a) for a in r] for r in rows]})
    err = _export(capsys, swapped, tmp_path, expect=2)
    assert "out of micro-batch order" in err


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, v, style", [("interleaved-zb", 2, "loop"), ("zb-v", 2, "v"), ("1f1b", 1, "loop")])
def test_torch_runtime_runs_the_exported_csv_with_the_executors_losses(capsys, tmp_path, name, v, style):
    from octopipe_plugin.executor.launch import spawn

    plan = build_plan(_model(), name, 2, 4, stages_per_device=v)
    out = _export(capsys, plan, tmp_path, "--style", style)
    assert f"wrote {tmp_path / 'plan.csv'}: 2 ranks x {2 * v} stages" in out
    spawn(_worker, 2, json.dumps(plan_to_dict(plan)), str(tmp_path / "plan.csv"), str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    last = next(g for g in got if g["ours"])
    assert len(last["ours"]) == 4 and last["torch"] == pytest.approx(last["ours"], rel=1e-9)
    assert all(g["grads_equal"] for g in got), got


def _worker(rank, world, port, doc, csv_path, out):
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from octopipe_plugin.executor import PipelineExecutor
    from octopipe_plugin.testing.checks import toy_runner
    from octopipe_plugin.executor.launch import init_gloo
    from octopipe_plugin.testing.toy import ToySpec, build_layers, microbatch, stage_modules

    init_gloo(rank, world, port, timeout_s=120)
    plan = plan_from_dict(json.loads(doc))
    spec = ToySpec(layers=LAYERS)
    m, ns = plan.num_microbatches, plan.num_stages
    ours_layers, their_layers = build_layers(spec), build_layers(spec)
    result = PipelineExecutor(plan, toy_runner(spec, ours_layers, plan, rank)).run_step()
    bounds = [(st.start, st.end) for st in plan.stages]
    modules = stage_modules(their_layers, bounds, plan.stages_of(rank))
    stages = [PipelineStage(modules[s], s, ns, torch.device("cpu")) for s in plan.stages_of(rank)]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=lambda y, t: nn.functional.mse_loss(y, t),
                                       scale_grads=True)
    runtime._load_csv(csv_path, format="compute_only")  # torch's own loader, on the file `export` wrote
    args, kwargs, losses = (), {}, []
    if 0 in plan.stages_of(rank):
        args = (torch.cat([microbatch(spec, mb)[0] for mb in range(m)]),)
    if ns - 1 in plan.stages_of(rank):
        kwargs = {"target": torch.cat([microbatch(spec, mb)[1] for mb in range(m)]), "losses": losses}
    runtime.step(*args, **kwargs)
    equal = all(torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
                for s in plan.stages_of(rank) for i in range(*bounds[s])
                for a, b in zip(ours_layers[i].parameters(), their_layers[i].parameters()))
    ours = [float(v) * m for _, v in sorted(result.losses.items())]  # the executor's losses are scaled by 1/m
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"ours": ours, "torch": [float(x) for x in losses], "grads_equal": equal}, fh)
    torch.distributed.destroy_process_group()
