"""examples/deepspeed/train_gpt.py under DeepSpeed's own launcher (`deepspeed --num_gpus 2` with the CPU
accelerator, gloo): steps, eval_batch, a checkpoint and a resume, against DeepSpeed's engine on the
same partition (one uninterrupted run) and, under a V-shape plan, a single-process reference.

SGD without clipping, fp32: a scale error shows in the losses after the first step."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octopipe_plugin.executor.launch import free_port
from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.schedules.registry import build_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "deepspeed" / "train_gpt.py"
SIZES = dict(vocab=64, hidden=16, heads=2, layers=4, seq=8)
M, MBS, LR = 4, 2, 0.2


def _config(tmp) -> str:
    path = tmp / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M,
                                "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
                                "steps_per_print": 10 ** 6}))
    return str(path)


def _plan(tmp, name: str, **kw) -> str:
    entries = SIZES["layers"] + 3  # embedding, blocks, final norm, tied head: the plan's layers are the list entries
    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    model = Model(name="gpt", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(entries)))
    path = tmp / f"{name}.json"
    write_plan(build_plan(model, name, 2, M, **kw), str(path))
    return str(path)


def _start(tmp, config: str, *flags) -> subprocess.Popen:
    """DeepSpeed's launcher on 2 CPU processes, started."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    launcher = Path(sys.executable).with_name("deepspeed")
    args = [f"--{k}={v}" for k, v in SIZES.items()]
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), str(EXAMPLE),
           "--ds-config", config, *args, *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)


def _finish(proc: subprocess.Popen) -> dict:
    """Rank 0's printed losses of a started launch (killed after 400 s: a hang fails the test)."""
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = stdout + stderr
    assert proc.returncode == 0, text
    engine = re.search(r"engine (\w+)", text)
    steps = {int(s): float(v) for s, v in re.findall(r"step (\d+): loss (\S+)", text)}
    evals = [float(v) for v in re.findall(r"eval loss (\S+)", text)]
    return {"engine": engine.group(1) if engine else None, "steps": steps, "eval": evals}


def _launch_all(tmp, config: str, *runs) -> list[dict]:
    """Launches of DeepSpeed's launcher (each on 2 CPU processes) started side by side: their launcher and
    launch.py processes are single-threaded start-ups that would otherwise leave one of the host's cores idle."""
    procs = []
    try:
        for flags in runs:
            procs.append(_start(tmp, config, *flags))
        return [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _reference(steps: int) -> tuple[dict, float]:
    """Single process: the same layers seeded as seed_layers does, SGD on the mean loss of M micro-batches."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_gpt as T
    finally:
        sys.path.pop(0)
    from deepspeed.runtime.utils import set_random_seed

    specs = T.gpt_specs(SIZES["vocab"], SIZES["hidden"], SIZES["heads"], SIZES["layers"])
    funcs, params, emb = [], [], None
    for i, spec in enumerate(specs):
        set_random_seed(1234 + i)
        if getattr(spec, "forward_fn", None) is not None:
            funcs.append(lambda x, e=emb, f=spec.forward_fn: f(e, x))
            continue
        layer = spec.build()
        emb = emb if emb is not None or not isinstance(layer, torch.nn.Embedding) else layer
        funcs.append(layer)
        params += list(layer.parameters())
    opt = torch.optim.SGD(params, lr=LR)

    def loss_of(batch):
        x, y = batch
        for f in funcs:
            x = f(x)
        return T.loss_fn(x, y)

    losses = {}
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for batch in T.batches(SIZES["vocab"], SIZES["seq"], MBS, 0, step, M):
            loss = loss_of(batch)
            (loss / M).backward()
            total += float(loss.detach())
        opt.step()
        losses[step] = total / M
    with torch.no_grad():
        ev = sum(float(loss_of(b)) for b in T.batches(SIZES["vocab"], SIZES["seq"], MBS, 0, -1, M)) / M
    return losses, ev


@pytest.mark.timeout(1800)
def test_train_checkpoint_resume_equal_deepspeeds_engine_and_v_shape_equals_reference(tmp_path):
    from deepspeed.runtime.utils import partition_uniform

    entries = SIZES["layers"] + 3
    flat = _plan(tmp_path, "1f1b", boundaries=partition_uniform(entries, 2))  # DeepSpeed's own "uniform" split
    vplan, config = _plan(tmp_path, "zb-v"), _config(tmp_path)
    # the runs that need no checkpoint side by side; then the resumed one, from the first's checkpoint
    first, stock, vshape = _launch_all(tmp_path, config, ["--plan", flat, "--steps", "3", "--save", str(tmp_path / "ck")],
                                       ["--no-octopipe", "--steps", "5"], ["--plan", vplan, "--steps", "3"])
    resumed, = _launch_all(tmp_path, config, ["--plan", flat, "--steps", "2", "--load", str(tmp_path / "ck")])
    assert first["engine"] == resumed["engine"] == "OctoPipeEngine" and stock["engine"] == "PipelineEngine"
    ours = {**first["steps"], **resumed["steps"]}
    assert sorted(ours) == list(range(5)) and sorted(stock["steps"]) == list(range(5))
    for step in range(5):
        assert ours[step] == pytest.approx(stock["steps"][step], rel=1e-5, abs=1e-6), step
    assert resumed["eval"][0] == pytest.approx(stock["eval"][0], rel=1e-5)

    ref, ref_eval = _reference(3)
    assert vshape["engine"] == "OctoPipeEngine"
    for step in range(3):
        assert vshape["steps"][step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step
    assert vshape["eval"][0] == pytest.approx(ref_eval, rel=1e-5)
    assert ref[2] != pytest.approx(ref[0], rel=1e-3)  # the steps did train
