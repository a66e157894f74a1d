"""A user's own training script under `torchrun` on 2 gloo ranks: the "octopipe" block is honoured
(OctoPipeEngine, whatever way `deepspeed.initialize` is called) or refused with one line on every
rank, no traceback, no rank left waiting (each launch is bounded by the subprocess timeout). With
`--moe` the script's list has a `LayerSpec(deepspeed.moe.layer.MoE)` entry at EP 2, and a plan with
overlapped pairs, launched by DeepSpeed's own launcher, gives DeepSpeed's own engine's losses."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.schedules.registry import build_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
M = 4


def _plan(tmp_path, layers: int, m: int = M) -> str:
    cost = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)
    model = Model(name="user", layers=tuple(Layer(name=f"l{i}", kind="dense", **cost) for i in range(layers)))
    path = tmp_path / f"plan{layers}_{m}.json"
    write_plan(build_plan(model, "1f1b", 2, m), str(path))
    return str(path)


def launch_env() -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def launch_cmd(*flags) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(HERE / "user_train.py"), *flags]


def launch(*flags, timeout=300):
    """(returncode, combined output) of user_train.py under torchrun on 2 CPU processes."""
    out = subprocess.run(launch_cmd(*flags), env=launch_env(), capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    return out.returncode, out.stdout + out.stderr


def launch_ranks(*flags, timeout=300, port=None):
    """[(returncode, output)] of each rank of user_train.py, started as 2 processes with torchrun's
    environment but not torchrun (which kills the other ranks at the first failure, so it cannot show
    that every rank ends by itself with the line)."""
    from octopipe_plugin.executor.launch import free_port

    port = str(port or free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "user_train.py"), *flags], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for proc in procs:
            out.append((proc.wait(timeout=timeout), proc.stdout.read()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def _refused_outputs(outs, expected: str):
    """The one refusal line every rank of `outs` ([(returncode, output)]) ended with, checked on each."""
    lines = []
    for rc, out in outs:
        assert rc == 1, out  # every rank ends by itself (none left waiting), with the refusal's exit status
        mine = [ln for ln in out.splitlines() if expected in ln]
        assert len(mine) == 1, out  # the same one line on every rank
        assert "Traceback" not in out, out
        lines += mine
    assert lines[0] == lines[1]
    return lines[0]


def _refused(flags, expected: str):
    return _refused_outputs(launch_ranks(*flags), expected)


def _trained_outputs(out: str):
    """Rank 0's losses of a run whose every rank ran OctoPipeEngine (`out`: the ranks' output together)."""
    ranks = re.findall(r"RANK (\d) ENGINE (\w+) LOSSES (\[[^\]]*\])", out)
    assert sorted(r for r, _, _ in ranks) == ["0", "1"], out
    assert {e for _, e, _ in ranks} == {"OctoPipeEngine"}, out
    return json.loads(ranks[0][2])


def _trained(flags):
    rc, out = launch(*flags)
    assert rc == 0, out
    return _trained_outputs(out)


LAYER_COUNT_REFUSAL = "ds_config: field $.octopipe.plan: expected a plan for the PipelineModule's 14 list entries"


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """Two launches of the ranks (torchrun's environment, not torchrun) with /dev/shm watched while they run: the
    14-layer plan trained ("trained") and a 10-layer plan refused ("refused"): {name: (outputs, buffers seen,
    buffers left)}. The refusal test, the keyword run of the three-ways test and the /dev/shm test read them (one
    launch each instead of two)."""
    import glob
    import threading

    from octopipe_plugin.executor.launch import free_port

    tmp = tmp_path_factory.mktemp("user_script")
    out = {}
    for name, flags in (("trained", ["--plan", _plan(tmp, 14)]), ("refused", ["--plan", _plan(tmp, 10)])):
        port = free_port()
        pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
        seen, done = set(), threading.Event()

        def watch():
            while not done.is_set():
                seen.update(glob.glob(pattern))
                done.wait(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            outs = launch_ranks(*flags, port=port)
        finally:
            done.set()
            watcher.join()
        out[name] = (outs, seen, glob.glob(pattern))
    return out


@pytest.mark.timeout(700)
def test_plan_for_another_layer_count_is_refused(watched):
    # one count (fewer than the 14 entries): plan_check.check_plan refuses any other count by one `!=` (more
    # and fewer layers unit-tested in test_ds_block.py); this launch (shared with the /dev/shm test) checks the
    # line reaches every rank
    line = _refused_outputs(watched["refused"][0], LAYER_COUNT_REFUSAL)
    assert "has 10 layers" in line


@pytest.mark.timeout(360)
def test_wrong_microbatch_count_is_refused(tmp_path):
    _refused(["--plan", _plan(tmp_path, 14), "--gas", "2"],
             "ds_config: field $.gradient_accumulation_steps: expected the plan's micro-batch count 4")


@pytest.mark.timeout(360)
def test_missing_plan_file_ends_every_rank(tmp_path):
    _refused(["--plan", str(tmp_path / "nowhere.json")],
             "ds_config: field $.octopipe.plan: expected an existing octopipe-plan/1 file")


@pytest.mark.timeout(360)
def test_subclass_overriding_forward_is_refused(tmp_path):
    _refused(["--plan", _plan(tmp_path, 14), "--subclass", "forward"],
             "NetWithForward overrides PipelineModule.forward")


@pytest.mark.timeout(1300)
def test_positional_model_early_import_and_subclass_all_run_the_plan(tmp_path, watched):
    # the three ways in one launch: the plugin replaces only the engine names `initialize` looks up at call time
    # (adapters/deepspeed/hooks.py), so each way fails this launch on its own (no path of one needs another);
    # against the keyword call's losses (the /dev/shm test's trained launch: the same script and plan, its ranks
    # with torchrun's environment)
    plan = _plan(tmp_path, 14)
    outs = watched["trained"][0]
    assert [r for r, _ in outs] == [0, 0], outs
    keyword = _trained_outputs("".join(o for _, o in outs))
    assert _trained(["--plan", plan, "--subclass", "init", "--positional", "--early-import"]) == keyword


@pytest.mark.timeout(700)
def test_runs_leave_nothing_in_dev_shm(watched):
    """DeepSpeed's CPU shm comm op maps one 66 MiB /dev/shm buffer per rank, named for the run's MASTER_ADDR/PORT,
    and never unlinks it: an OctoPipe run (trained, or refused with its line) unlinks them once every rank has
    mapped them (adapters/deepspeed/shm.py). Watched while the ranks run: the buffers were there, then gone."""
    for name, rc in (("trained", 0), ("refused", 1)):
        outs, seen, left = watched[name]
        assert [r for r, _ in outs] == [rc, rc], outs
        assert len(seen) == 2, (name, seen)  # the shm op ran: one buffer per rank
        assert left == [], name


def _moe_plan(tmp_path) -> str:
    """One stage (the 4 list entries) on one device, 1F1B's order F0 F1 B0 F2 B1 F3 B2 B3, its F+B pairs."""
    from octopipe_plugin.actions import Action, Kind
    from octopipe_plugin.testing.pair_plans import greedy_pairs
    from octopipe_plugin.testing.plans import make_plan

    f, b = (lambda mb: Action(0, Kind.F, mb)), (lambda mb: Action(0, Kind.B, mb))
    row = (f(0), f(1), b(0), f(2), b(1), f(3), b(2), b(3))
    plan = greedy_pairs(make_plan(stage_devices=[0], bounds=[(0, 4)], num_devices=1, num_microbatches=M,
                                  schedule=(row,)))
    assert len(plan.pairs) == 3
    path = tmp_path / "moe_pairs.json"
    write_plan(plan, str(path))
    return str(path)


@pytest.mark.timeout(700)
def test_moe_pairs_in_a_user_script_equal_deepspeeds_engine(tmp_path):
    # a user's PipelineModule with a LayerSpec(deepspeed.moe.layer.MoE) entry at EP 2 (pipeline 1 x expert/data 2):
    # OctoPipeEngine runs the plan's F+B pairs with the MoE's all-to-alls as phases; DeepSpeed's own engine (no
    # block) on the same seeds and data gives the same losses (the second step's after an SGD step of every weight)
    # ours under DeepSpeed's own launcher (`deepspeed --num_gpus 2`, CPU accelerator), theirs under torchrun
    from octopipe_plugin.executor.launch import free_port

    runs = {}
    env = launch_env()
    ours = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--no_local_rank",
            "--master_port", str(free_port()), str(HERE / "user_train.py"), "--moe", "--plan", _moe_plan(tmp_path)]
    # started side by side (their launchers' start-ups are single-threaded), each killed after 400 s
    procs = {"ours": subprocess.Popen(ours, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=ROOT),
             "theirs": subprocess.Popen(launch_cmd("--moe", "--no-block"), env=launch_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, cwd=ROOT)}
    try:
        done = {name: (proc.communicate(timeout=400)[0], proc.returncode) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for name, (out, rc) in done.items():
        assert rc == 0, out
        runs[name] = re.findall(r"RANK (\d) ENGINE (\w+) LOSSES (\[[^\]]*\]) PAIRS (\d+)", out)
        assert sorted(r for r, *_ in runs[name]) == ["0", "1"], out
    assert {e for _, e, _, _ in runs["ours"]} == {"OctoPipeEngine"}
    assert {e for _, e, _, _ in runs["theirs"]} == {"PipelineEngine"}
    assert [int(p) for *_, p in runs["ours"]] == [3 * 2, 3 * 2]  # 3 pairs a step, 2 steps, on each rank
    ours, theirs = json.loads(runs["ours"][0][2]), json.loads(runs["theirs"][0][2])
    assert ours == pytest.approx(theirs, rel=1e-5) and ours[1] != pytest.approx(ours[0], rel=1e-3)
