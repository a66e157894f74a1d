"""The simulator serialises each link's transfers in the order the shared message rule fixes.

With link contention on, transfers between a pair of devices leave one after the other;
their order must be the per-peer order of `schedules.messages.plan_messages`, the order the
executor posts sends and receives in, so the simulated plan is the plan that runs.
"""

import random

from hypothesis import given, settings, strategies as st

from octopipe_plugin.testing.plans import random_plan
from octopipe_plugin.formats import Cluster, Layer, Link, Model
from octopipe_plugin.schedules.messages import plan_messages
from octopipe_plugin.simulator import SimOptions, simulate


def _model(n, rng):
    return Model(name="m", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=rng.uniform(0.5, 2), bwd_ms=rng.uniform(0.5, 2),
              wgrad_ms=rng.uniform(0.5, 2), state_bytes=0, activation_bytes=0, output_bytes=rng.randrange(1, 4) * 10**6)
        for i in range(n)))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 4), st.integers(1, 5), st.sampled_from(["looped", "v", "arbitrary"]))
def test_contended_transfers_follow_the_shared_per_peer_order(seed, d, m, kind):
    rng = random.Random(seed)
    ns = 2 * d
    model = _model(ns + 2, rng)
    plan = random_plan(rng, num_devices=d, num_layers=ns + 2, num_stages=ns, num_microbatches=m, placement_kind=kind)
    cluster = Cluster(num_devices=d, devices_per_node=2, memory_bytes=10**12,
                      intra_node=Link(bandwidth_gb_per_s=1, latency_us=5),
                      inter_node=Link(bandwidth_gb_per_s=0.5, latency_us=10))
    res = simulate(model, cluster, plan, SimOptions(contention=True))
    by_pair = {}
    for t in sorted(res.transfers, key=lambda t: (t.start, t.end)):
        by_pair.setdefault((t.src, t.dst), []).append(t)
    expected = plan_messages(plan)
    assert set(by_pair) == set(expected)
    for pair, msgs in expected.items():
        sim = by_pair[pair]
        assert [t.producer for t in sim] == [msg.producer for msg in msgs]
        assert all(a.end <= b.start + 1e-9 for a, b in zip(sim, sim[1:]))  # one at a time per direction
