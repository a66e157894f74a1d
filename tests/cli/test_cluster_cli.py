"""`octopipe cluster --measure`: measured links make a cluster file that plans and simulates like a named one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.costs import resolve_cluster
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import Layer, Model, read_cluster, write_model
from octopipe_plugin.profile.links import LinkSample, build_cluster, fit_link, link_pairs, node_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_model(path) -> str:
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=0.5, state_bytes=1 << 20,
                         activation_bytes=1 << 20, output_bytes=1 << 20) for i in range(8))
    write_model(Model(name="small8", layers=layers), path)
    return str(path)


def _plans_and_simulates(capsys, tmp_path, cluster: str, model: str, tag: str) -> str:
    plan = str(tmp_path / f"plan-{tag}.json")
    rc = main(["plan", "--model", model, "--cluster", cluster, "--microbatches", "4", "--iterations", "20",
               "--no-progress", "-o", plan])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rc = main(["simulate", "--model", model, "--cluster", cluster, "--plan", plan])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "step time" in out
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_measured_cluster_file_loads_plans_and_simulates(tmp_path, capsys):
    local = str(tmp_path / "local.json")
    assert main(["cluster", "--measure", "--ranks", "4", "--repeats", "2", "-o", local]) == 0
    out = capsys.readouterr().out
    assert "intra-node:" in out and f"wrote {local}" in out
    cluster = read_cluster(local)  # the format's own checks: positive bandwidth, latency, memory
    assert (cluster.num_devices, cluster.devices_per_node) == (4, 4)
    assert cluster.intra_node == cluster.inter_node  # one node: nothing crosses one
    assert cluster.gpu is None  # CPU processes match no GPU of the cost model
    model = _small_model(tmp_path / "m.json")
    _plans_and_simulates(capsys, tmp_path, local, model, "measured")
    _plans_and_simulates(capsys, tmp_path, "h100x4", model, "named")  # the same commands, the same outputs


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_ranks_per_node_measures_the_inter_node_class_too(tmp_path, capsys):
    local = str(tmp_path / "two-nodes.json")
    assert main(["cluster", "--measure", "--ranks", "4", "--ranks-per-node", "2", "--repeats", "3", "--max-mib", "4",
                 "--name", "pairs", "-o", local]) == 0
    cluster = read_cluster(local)
    assert (cluster.name, cluster.num_devices, cluster.devices_per_node) == ("pairs", 4, 2)
    assert "(one node" not in capsys.readouterr().out  # both classes measured


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_torchrun_launch_is_measured_from_its_environment(tmp_path):
    out = tmp_path / "launch.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def launch(repeats: int):
        return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "octopipe_plugin", "cluster",
                               "--measure", "--repeats", str(repeats), "--max-mib", "4", "-o", str(out)],
                              env=env, capture_output=True, text=True, timeout=500)

    proc = launch(3)
    if proc.returncode != 0 and "not a finite positive number" in proc.stderr:
        # the documented refusal of a fit a busy spell spoilt (profile/links.py fit_link), whose advice is to rerun
        # with more --repeats: taken once (CI saw it once in many runs, the message hidden under torchrun's report)
        proc = launch(9)
    said = [ln for ln in proc.stderr.splitlines() if "octopipe" in ln and "error" in ln.lower()]
    assert proc.returncode == 0, "\n".join(said) or proc.stderr[-2000:]
    cluster = read_cluster(str(out))
    assert (cluster.num_devices, cluster.devices_per_node) == (2, 2)  # LOCAL_WORLD_SIZE 2 on one host


def test_fit_recovers_latency_and_bandwidth():
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 25)
    link = fit_link(sizes, [50e-6 + n / 4e9 for n in sizes], "test link")
    assert link.latency_us == pytest.approx(50.0, rel=1e-6)
    assert link.bandwidth_gb_per_s == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("times", [
    [1e-3, 5e-4, 2e-4, 1e-4],  # larger messages faster: negative bandwidth
    [1e-3, 1e-3, 1e-3, 1e-3],  # no size dependence: infinite bandwidth
    [1e-9, 2e-4, 3e-3, 5e-2],  # intercept below zero: negative latency
])
def test_a_measured_figure_that_is_not_finite_and_positive_is_refused_in_one_line(times):
    with pytest.raises(OctoPipeError) as info:
        fit_link((1 << 12, 1 << 16, 1 << 20, 1 << 25), times, "intra-node link (0-1)")
    text = str(info.value)
    assert "\n" not in text and "intra-node link (0-1)" in text and "not a finite positive number" in text


def test_build_cluster_medians_pairs_per_class_and_names_nodes():
    sizes = (1 << 12, 1 << 20)
    fast = tuple(10e-6 + n / 10e9 for n in sizes)
    slow = tuple(30e-6 + n / 1e9 for n in sizes)
    samples = [LinkSample(src=0, dst=1, seconds=fast), LinkSample(src=2, dst=3, seconds=fast),
               LinkSample(src=1, dst=2, seconds=slow)]
    cluster = build_cluster(samples, 4, 2, sizes, 1 << 30, None, "t")
    assert cluster.intra_node.bandwidth_gb_per_s == pytest.approx(10.0)
    assert cluster.inter_node.latency_us == pytest.approx(30.0)
    assert link_pairs(4, 2) == ([(0, 1), (2, 3)], [(1, 2)])


def test_node_groups_follow_local_world_size_and_refuse_mixed_hosts():
    assert node_groups(["a", "a", "b", "b"], None) == 2
    assert node_groups(["a", "a", "a", "a"], 2) == 2  # two launch nodes on one host: allowed
    with pytest.raises(OctoPipeError, match="ranks 0..1 form node 0 but run on hosts a, b"):
        node_groups(["a", "b", "a", "b"], 2)
    with pytest.raises(OctoPipeError, match="do not split"):
        node_groups(["a", "a", "a"], 2)


def test_show_a_named_cluster_and_write_it_as_a_file(tmp_path, capsys):
    path = str(tmp_path / "h100x8.json")
    assert main(["cluster", "h100x8", "-o", path]) == 0
    assert read_cluster(path) == resolve_cluster("h100x8")
    assert json.load(open(path))["format"] == "octopipe-cluster/1"


@pytest.mark.parametrize("argv, said", [
    (["cluster", "h100x8", "--measure"], "give no cluster name"),
    (["cluster"], "--measure to measure"),
    (["cluster", "h100x8", "--ranks", "4"], "go with --measure"),
])
def test_misused_options_are_refused_in_one_line(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_measure_outside_a_launch_without_ranks_says_what_to_give(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["cluster", "--measure"]) == 2
    assert "give --ranks N" in capsys.readouterr().err
