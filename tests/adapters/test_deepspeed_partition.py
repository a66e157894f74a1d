"""A plan's boundaries as DeepSpeed `parts`: 2 gloo ranks each build exactly their own LayerSpecs,
and the stock PipelineEngine trains the result with the single-process loss.

The first `deepspeed.init_distributed` on a machine compiles DeepSpeed's shared-memory comm op
(measured: about 93 s on 2 cores, then cached in ~/.cache/torch_extensions; later runs: 0.5 s).
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from octopipe_plugin.adapters.deepspeed import layer_starts, load_parts, octopipe_config, plan_parts
from octopipe_plugin.errors import FormatError, OctoPipeError
from octopipe_plugin.executor.launch import free_port
from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.schedules.registry import build_plan

# OctoPipe layer of each DeepSpeed list entry: layer 1 is a Linear plus a function, layer 3 two Linears.
LAYER_OF_SPEC = [0, 1, 1, 2, 3, 3, 4]
FUNC_INDEX = 2  # the plain function entry (no parameters, no module)


def tiny_model(n):
    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    return Model(name="tiny", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(n)))


BASE_SEED = 1234
MICRO_BATCHES = 4


def widths(j):
    """(in, out) of Linear entry j: widths grow by one per Linear, so the weight shape names the entry."""
    k = j if j < FUNC_INDEX else j - 1
    return k + 1, k + 2


def specs():
    """The DeepSpeed layer list: Linears chained by width, and one plain function entry."""
    from deepspeed.pipe import LayerSpec

    return [_double if j == FUNC_INDEX else LayerSpec(torch.nn.Linear, *widths(j)) for j in range(len(LAYER_OF_SPEC))]


def batches():
    gen = torch.Generator().manual_seed(0)
    out_width = widths(len(LAYER_OF_SPEC) - 1)[1]
    return [(torch.randn(1, 1, generator=gen), torch.randn(1, out_width, generator=gen)) for _ in range(MICRO_BATCHES)]


def reference_loss():
    """Single process: the same layers seeded as DeepSpeed's seed_layers does, mean MSE over the micro-batches."""
    from deepspeed.runtime.utils import set_random_seed

    funcs = []
    for j in range(len(LAYER_OF_SPEC)):
        if j == FUNC_INDEX:
            funcs.append(_double)
        else:
            set_random_seed(BASE_SEED + j)
            funcs.append(torch.nn.Linear(*widths(j)))
    losses = []
    for x, y in batches():
        for f in funcs:
            x = f(x)
        losses.append(torch.nn.functional.mse_loss(x, y))
    return float(torch.stack(losses).mean())


def _double(x):
    return 2 * x


def build_worker(rank, world, port, ds_config, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed

    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    parts = load_parts(ds_config, num_specs=len(LAYER_OF_SPEC))
    module = OctoPipePipelineModule(specs(), parts=parts, loss_fn=torch.nn.MSELoss(), seed_layers=True,
                                    base_seed=BASE_SEED)
    built = {name: list(sub.weight.shape) for name, sub in module.named_children() if hasattr(sub, "weight")}
    report = dict(parts=module.parts, bounds=[module._local_start, module._local_stop], built=built,
                  funcs=len(module.forward_funcs), owners=[module.stage_owner(j) for j in range(len(LAYER_OF_SPEC))])
    # the stock PipelineEngine trains the partitioned module (ds_config keeps the octopipe block)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                           model_parameters=[p for p in module.parameters()])
    report["loss"] = float(engine.train_batch(data_iter=iter(batches())))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    deepspeed.comm.barrier()


@pytest.mark.framework
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_ranks_build_exactly_their_layers(tmp_path):
    model = tiny_model(5)
    plan = build_plan(model, "1f1b", 2, 2, boundaries=[0, 1, 5])  # 1 layer vs 4: far from DeepSpeed's uniform
    plan_path = tmp_path / "plan.json"
    write_plan(plan, plan_path)
    ds_config = {"train_batch_size": MICRO_BATCHES, "train_micro_batch_size_per_gpu": 1,
                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                 "octopipe": {"plan": str(plan_path), "layer_of_spec": LAYER_OF_SPEC}}
    mp.spawn(build_worker, args=(2, free_port(), ds_config, str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expect_parts = [0, 1, len(LAYER_OF_SPEC)]
    for rank, rep in enumerate(reports):
        lo, hi = expect_parts[rank], expect_parts[rank + 1]
        linears = {str(j): list(widths(j))[::-1] for j in range(lo, hi) if j != FUNC_INDEX}
        assert rep["parts"] == expect_parts
        assert rep["bounds"] == [lo, hi]
        assert rep["built"] == linears  # nothing of the other stage is built here
        assert rep["funcs"] == hi - lo
        assert rep["owners"] == [0] + [1] * (len(LAYER_OF_SPEC) - 1)
        assert rep["loss"] == pytest.approx(reference_loss(), rel=1e-5)


def test_plan_parts_with_and_without_map():
    model = tiny_model(5)
    plan = build_plan(model, "zb-h1", 3, 3, boundaries=[0, 2, 2, 5])  # an empty middle stage
    assert plan_parts(plan) == [0, 2, 2, 5]
    assert plan_parts(plan, LAYER_OF_SPEC) == [0, 3, 3, 7]
    # a layer with no entry of its own (kept outside the list, e.g. the loss) ends where the next starts
    assert layer_starts([0, 0, 2, 3], 5) == [0, 2, 2, 3, 4, 4]


def test_plan_parts_refuses_other_shapes():
    model = tiny_model(8)
    with pytest.raises(OctoPipeError, match="one stage per pipeline rank.*executor"):
        plan_parts(build_plan(model, "interleaved-1f1b", 2, 4, stages_per_device=2))
    with pytest.raises(OctoPipeError, match="one stage per pipeline rank"):
        plan_parts(build_plan(model, "zb-v", 2, 4))
    with pytest.raises(OctoPipeError, match=r"layer_of_spec\[2\].*>= 1"):
        plan_parts(build_plan(model, "1f1b", 2, 2), [0, 1, 0])
    with pytest.raises(OctoPipeError, match=r"layer_of_spec\[0\].*0\.\.7"):
        plan_parts(build_plan(model, "1f1b", 2, 2), [9])


def test_octopipe_config_block(tmp_path):
    assert octopipe_config({"octopipe": {"plan": "p.json"}}) == {"plan": "p.json", "layer_of_spec": None}
    cases = [
        ({}, r"\$\.octopipe: expected an object"),
        ({"octopipe": {}}, r"\$\.octopipe\.plan: expected the path"),
        ({"octopipe": {"plan": 3}}, r"\$\.octopipe\.plan"),
        ({"octopipe": {"plan": "p.json", "layer_of_spec": "0,1"}}, r"\$\.octopipe\.layer_of_spec"),
        ({"octopipe": {"plan": "p.json", "plans": 1}}, r"\$\.octopipe\.plans: expected one of the known fields"),
    ]
    for cfg, pattern in cases:
        with pytest.raises(FormatError, match=pattern):
            octopipe_config(cfg)
    with pytest.raises(FormatError, match="plan.json"):
        load_parts({"octopipe": {"plan": str(tmp_path / "plan.json")}})
    plan_path = tmp_path / "plan.json"
    write_plan(build_plan(tiny_model(5), "1f1b", 2, 2), plan_path)
    with pytest.raises(FormatError, match=r"\$\.octopipe\.plan: expected a mapping onto the PipelineModule's 7"):
        load_parts({"octopipe": {"plan": str(plan_path)}}, num_specs=7)
