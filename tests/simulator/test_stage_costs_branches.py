"""A cut inside a branched model carries every live producer output (vision encoder + decoder)."""

from octopipe_plugin.formats import Layer, Model, Stage
from octopipe_plugin.simulator import stage_costs


def _layer(name, out):
    return Layer(name=name, kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1, state_bytes=0,
                 activation_bytes=0, output_bytes=out)


def test_cut_between_branches_sends_both_outputs():
    # 0: vision (100 B) -> 1: projector (10 B); 2: embedding (7 B); 3: decoder consumes 1 and 2.
    layers = (_layer("vision", 100), _layer("projector", 10), _layer("embedding", 7), _layer("decoder", 5))
    model = Model(name="b", layers=layers, inputs={2: (), 3: (1, 2)})
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=3, device=1), Stage(start=3, end=4, device=2))
    out = stage_costs(model, stages).output
    assert out[0] == 100  # only the vision output is live after layer 0
    assert out[1] == 10 + 7  # projector and embedding outputs both cross into the decoder


def test_chain_uses_last_layer_output():
    layers = (_layer("a", 3), _layer("b", 4), _layer("c", 5))
    model = Model(name="c", layers=layers)
    stages = (Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1))
    assert stage_costs(model, stages).output[0] == 4
