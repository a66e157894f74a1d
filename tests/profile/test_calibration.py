"""Calibration: efficiency scales fitted from profiles, read back by the analytic model."""

import dataclasses

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.costs import build_model, layer_cost, load_arch
from octopipe_plugin.costs.calibration import kind_scale, read_document
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import write_model
from octopipe_plugin.profile.calibration import compare, fit, write_document

ARCH = load_arch("deepseek-v3-mini", seq_len=1024)


def gpu_profile(arch, factors: dict[str, tuple[float, float, float]], device: str = "NVIDIA H200"):
    """A profile document as the profiler writes it on `device`: each kind's analytic times x its factors.

    Stands in for measurements we cannot take without a GPU; only the fitting arithmetic is under test.
    """
    model = build_model(arch, "H200", calibrated=False)
    layers = []
    for l in model.layers:
        f = factors.get(l.kind)
        if f is None:
            layers.append(dataclasses.replace(l, source="analytic"))
        else:
            layers.append(dataclasses.replace(l, fwd_ms=l.fwd_ms * f[0], bwd_ms=l.bwd_ms * f[1],
                                              wgrad_ms=l.wgrad_ms * f[2], source="measured"))
    meta = {**model.meta, "gpu": "H200", "impl": "megatron", "dtype": "bfloat16",
            "profile": {"device": device, "device_type": "cuda"}}
    return dataclasses.replace(model, layers=tuple(layers), meta=meta)


def test_fit_gives_analytic_over_measured_and_the_analytic_model_uses_it(tmp_path):
    prof = gpu_profile(ARCH, {"dense": (2.0, 1.25, 0.5), "moe": (1.5, 1.5, 1.5)})
    write_document(fit([prof]))
    dense = kind_scale("H200", "dense")
    assert (dense.fwd, dense.bwd, dense.wgrad, dense.samples) == pytest.approx((0.5, 0.8, 2.0, 1))
    plain, cal = layer_cost(ARCH, "dense", "H200", calibrated=False), layer_cost(ARCH, "dense", "H200")
    assert (cal.fwd_ms, cal.bwd_ms, cal.wgrad_ms) == pytest.approx((2 * plain.fwd_ms, 1.25 * plain.bwd_ms,
                                                                    0.5 * plain.wgrad_ms))
    # kinds and GPUs never measured keep the table's efficiency
    assert layer_cost(ARCH, "lm_head", "H200") == layer_cost(ARCH, "lm_head", "H200", calibrated=False)
    assert layer_cost(ARCH, "dense", "H100") == layer_cost(ARCH, "dense", "H100", calibrated=False)
    assert build_model(ARCH, "H200").meta["calibrated_kinds"] == ["dense", "moe"]
    rows = {r.kind: r for r in compare(prof)}
    assert rows["dense"].ratio(0) == pytest.approx(2.0) and rows["dense"].calibrated_ms == pytest.approx(
        rows["dense"].measured_ms)


def test_samples_accumulate_and_a_remeasured_sample_replaces_itself():
    doc = fit([gpu_profile(ARCH, {"dense": (2.0, 2.0, 2.0)})])
    doc = fit([gpu_profile(ARCH, {"dense": (4.0, 4.0, 4.0)})], doc=doc)  # same arch, device: replaces
    assert len(doc["gpus"]["H200"]["dense"]["samples"]) == 1
    assert doc["gpus"]["H200"]["dense"]["scale"]["fwd"] == pytest.approx(0.25)
    other = load_arch("deepseek-v3-mini", seq_len=4096)
    doc = fit([gpu_profile(other, {"dense": (1.0, 1.0, 1.0)})], doc=doc)
    samples = doc["gpus"]["H200"]["dense"]["samples"].values()
    assert len(samples) == 2
    a = sum(s["analytic_ms"][0] for s in samples)
    m = sum(s["measured_ms"][0] for s in samples)
    assert doc["gpus"]["H200"]["dense"]["scale"]["fwd"] == pytest.approx(a / m)


def test_cpu_profile_has_no_analytic_counterpart_unless_a_gpu_is_named():
    prof = gpu_profile(ARCH, {"dense": (1.0, 1.0, 1.0)}, device="cpu AMD x1 threads")
    prof = dataclasses.replace(prof, meta={**prof.meta, "gpu": "cpu AMD x1 threads",
                                           "profile": {"device": "cpu AMD x1 threads", "device_type": "cpu"}})
    with pytest.raises(OctoPipeError, match="not a GPU of the table"):
        compare(prof)
    assert {r.kind for r in compare(prof, "H200")} == {"dense"}


def test_calibrate_cli_compares_writes_and_model_cli_uses_it(tmp_path, capsys):
    path = tmp_path / "h200.json"
    write_model(gpu_profile(ARCH, {"moe": (2.0, 2.0, 2.0)}), path)
    assert main(["calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "moe" in out and "meas/ana" in out and "2.00" in out
    assert read_document() == {"format": "octopipe-calibration/1", "gpus": {}}  # nothing written without --write
    assert main(["calibrate", str(path), "--write"]) == 0
    assert "H200      moe" in capsys.readouterr().out
    before = build_model(ARCH, "H200", calibrated=False)
    out = str(tmp_path / "m.json")
    assert main(["model", "deepseek-v3-mini", "--seq-len", "1024", "--gpu", "H200", "-o", out]) == 0
    from octopipe_plugin.formats import read_model

    after = read_model(tmp_path / "m.json")
    moe_before = next(l for l in before.layers if l.kind == "moe")
    moe_after = next(l for l in after.layers if l.kind == "moe")
    assert moe_after.fwd_ms == pytest.approx(2 * moe_before.fwd_ms)
    assert main(["calibrate", "--show"]) == 0
    assert "moe" in capsys.readouterr().out


def test_calibrate_cli_refusals(capsys):
    assert main(["calibrate"]) == 2
    assert "--show" in capsys.readouterr().err


def test_bad_calibration_file_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "octopipe-calibration/1", "gpus": {"H200": {"dense": {"scale": {"fwd": -1}}}}}')
    monkeypatch.setenv("OCTOPIPE_CALIBRATION", str(bad))
    with pytest.raises(OctoPipeError, match=r"\$\.gpus\.H200\.dense\.scale\.fwd"):
        layer_cost(ARCH, "dense", "H200")
