"""User architecture files (YAML / JSON, optionally on a zoo base) and their refusals; named clusters."""

import json

import pytest
import yaml

from octopipe_plugin.costs import GPUS, ZOO, get_gpu, load_arch, resolve_cluster, resolve_model
from octopipe_plugin.errors import FormatError, OctoPipeError
from octopipe_plugin.formats import model_to_dict


def test_yaml_arch_on_a_zoo_base(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"base": "llama3-8b", "name": "tiny", "num_layers": 4, "seq_len": 2048}))
    model = resolve_model(str(path), "H200")
    assert model.name == "tiny" and [x.kind for x in model.layers] == ["embedding"] + ["dense"] * 4 + ["lm_head"]
    assert model.meta["gpu"] == "H200" and model.meta["arch"]["hidden"] == 4096


def test_json_arch_file_and_model_file_pass_through(tmp_path):
    arch = tmp_path / "a.json"
    arch.write_text(json.dumps({"name": "m", "num_layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "vocab": 1000}))
    model = resolve_model(str(arch))
    doc = tmp_path / "model.json"
    doc.write_text(json.dumps(model_to_dict(model)))
    assert resolve_model(str(doc)) == model
    with pytest.raises(OctoPipeError, match="cannot take overrides"):
        resolve_model(str(doc), tp=2)


@pytest.mark.parametrize("doc,json_path,expected", [
    ({"name": "m", "num_layers": 2, "hiden": 256, "ffn": 512, "heads": 4, "vocab": 10}, "$.hiden", "did you mean 'hidden'"),
    ({"name": "m", "num_layers": 2, "ffn": 512, "heads": 4, "vocab": 10}, "$.hidden", "field is missing"),
    ({"name": "m", "num_layers": "two", "hidden": 256, "ffn": 512, "heads": 4, "vocab": 10}, "$.num_layers", "integer"),
    ({"name": "m", "num_layers": 2, "hidden": -256, "ffn": 512, "heads": 4, "vocab": 10}, "$.hidden", "an integer in 1.."),
    ({"name": "m", "num_layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "vocab": 10, "tp": 3}, "$.heads",
     "a multiple of tp=3"),
    ({"name": "m", "num_layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "vocab": 10, "num_experts": 4,
      "top_k": 6}, "$.top_k", "1..num_experts=4"),
    ({"name": "m", "hybrid_pattern": "M*X", "hidden": 256, "ffn": 512, "heads": 4, "vocab": 10},
     "$.hybrid_pattern", "'M' (Mamba)"),
    ({"name": "m", "num_layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "vocab": 10, "recompute": "yes"},
     "$.recompute", "boolean"),
    ({"format": "octopipe-arch/2", "name": "m", "num_layers": 2, "hidden": 256, "ffn": 512, "heads": 4,
      "vocab": 10}, "$.format", "major version 1"),
])
def test_bad_arch_file_names_file_field_and_expectation(tmp_path, doc, json_path, expected):
    path = tmp_path / "bad_arch.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(FormatError) as info:
        resolve_model(str(path))
    msg = str(info.value)
    assert str(path) in msg and json_path in msg and expected in msg


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(OctoPipeError, match="llama3-8b"):
        resolve_model("llama-9000")
    with pytest.raises(OctoPipeError, match="H100"):
        resolve_model("llama3-8b", "TPU")
    with pytest.raises(OctoPipeError, match="hidden"):
        load_arch("llama3-8b", hiddn=3)


def test_gpu_table_and_aliases():
    assert set(GPUS) >= {"A100-80G", "H100-SXM", "H200", "B200"}
    for alias, name in (("a100", "A100-80G"), ("H100", "H100-SXM"), ("h200", "H200"), ("B200", "B200")):
        assert get_gpu(alias).name == name
    for spec in GPUS.values():
        assert 0 < spec.efficiency <= 1 and spec.nvlink_gb_per_s > spec.ib_gb_per_s
    assert set(ZOO) >= {"llama3-8b", "deepseek-v3-mini", "nemotron-h", "gemma3", "vlm", "llama2-7b"}


def test_named_clusters():
    c = resolve_cluster("h100x16")
    h100 = get_gpu("H100")
    assert (c.num_devices, c.devices_per_node, c.memory_bytes) == (16, 8, h100.memory_bytes)
    assert c.intra_node.bandwidth_gb_per_s == h100.nvlink_gb_per_s and c.inter_node.bandwidth_gb_per_s == h100.ib_gb_per_s
    assert c.same_node(0, 7) and not c.same_node(7, 8)
    assert c.transfer_ms(0, 8, 1e9) > c.transfer_ms(0, 1, 1e9)
    small = resolve_cluster("A100x4")
    assert small.devices_per_node == 4 and small.memory_bytes == get_gpu("A100").memory_bytes
    assert resolve_cluster("b200x8").intra_node.bandwidth_gb_per_s == 900
    for bad in ("h100", "tpux8", "h100x0"):
        with pytest.raises(OctoPipeError):
            resolve_cluster(bad)
