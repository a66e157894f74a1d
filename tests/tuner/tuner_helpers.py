"""Hand-built models and clusters for the tuner tests (no zoo needed)."""

from __future__ import annotations

from octopipe_plugin.formats import Cluster, Layer, Link, Model

GIB = 2**30


def layer(i: int, f: float, i_ms: float | None = None, w: float | None = None, state: int = GIB,
          act: int = GIB, kind: str = "dense") -> Layer:
    """One layer; I and W default to F."""
    return Layer(name=f"l{i}", kind=kind, fwd_ms=f, bwd_ms=f if i_ms is None else i_ms,
                 wgrad_ms=f if w is None else w, state_bytes=state, activation_bytes=act, output_bytes=2**20)


def hetero_model(n: int = 12) -> Model:
    """Embedding, light and heavy decoder layers and a heavy LM head: what the Megatron split handles badly."""
    layers = [layer(0, 0.2, 0.1, 0.3, kind="embedding")]
    for i in range(1, n - 1):
        layers.append(layer(i, 1.0 if i < 3 else 2.0, kind="dense" if i < 3 else "moe"))
    layers.append(layer(n - 1, 3.0, kind="lm_head"))
    return Model(name="hetero", layers=tuple(layers))


def cluster(devices: int, memory_gib: float = 1000.0, per_node: int = 8, latency_us: float = 1.0) -> Cluster:
    """A cluster with fast links (transfers of 1 MiB cost a few microseconds)."""
    return Cluster(num_devices=devices, devices_per_node=per_node, memory_bytes=int(memory_gib * GIB),
                   intra_node=Link(bandwidth_gb_per_s=400, latency_us=latency_us),
                   inter_node=Link(bandwidth_gb_per_s=50, latency_us=5 * latency_us))
