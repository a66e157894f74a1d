"""ModelGraph: the layers of a Model as a networkx DAG (branches such as encoder -> decoder) and its summaries."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from functools import cached_property

import networkx as nx

from .errors import OctoPipeError
from .formats.model import Layer, Model


@dataclass(frozen=True, kw_only=True, slots=True)
class KindSummary:
    """Layers of one kind: count, mean per-layer costs, and totals."""

    kind: str
    count: int
    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    state_bytes: float
    activation_bytes: float
    output_bytes: float
    total_ms: float  # F + I + W summed over the kind's layers


@dataclass(frozen=True, kw_only=True, slots=True)
class Heaviest:
    """The layer with the largest F + I + W and its ratio to the median layer."""

    index: int
    layer: Layer
    ratio_to_median: float


def producers(model: Model, index: int) -> tuple[int, ...]:
    """Layers whose output layer `index` consumes: Model.inputs where given, else the previous layer."""
    if index in model.inputs:
        return tuple(model.inputs[index])
    return (index - 1,) if index > 0 else ()


def _edges(model: Model):
    """Every (producer, consumer) pair, refusing a producer that does not run before its consumer."""
    for i in range(model.num_layers):
        for p in producers(model, i):
            if not 0 <= p < i:
                raise OctoPipeError(f"model {model.name}: layer {i} consumes layer {p}, which does not run before it")
            yield p, i


def last_uses(model: Model) -> list[int]:
    """Per layer, the last layer that consumes its output (itself when none does)."""
    last_use = list(range(model.num_layers))  # a layer nobody consumes is live across no boundary
    for p, c in _edges(model):
        last_use[p] = max(last_use[p], c)
    return last_use


def live_outputs(model: Model, boundary: int) -> tuple[int, ...]:
    """Layers whose outputs cross a stage boundary placed before layer `boundary` (what that cut sends)."""
    return tuple(p for p, last in enumerate(last_uses(model)[:boundary]) if last >= boundary)


def boundary_bytes(model: Model) -> list[int]:
    """Bytes crossing a stage boundary before each layer 0..L: every producer output still to be consumed, once."""
    n = model.num_layers
    last_use = last_uses(model)
    # Layer p's output crosses boundaries p+1 .. last_use[p]: add it at the first, drop it after the last.
    delta = [0] * (n + 2)
    for p, last in enumerate(last_use):
        delta[p + 1] += model.layers[p].output_bytes
        delta[last + 1] -= model.layers[p].output_bytes
    cuts, live = [], 0
    for k in range(n + 1):
        live += delta[k]
        cuts.append(live)
    return cuts


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """A Model's layers as a DAG (edge p -> c when c consumes p's output) in the order the pipeline partitions."""

    model: Model

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The layer DAG; node attributes are the Layer (`layer`) and its `kind`."""
        g = nx.DiGraph()
        for i, layer in enumerate(self.model.layers):
            g.add_node(i, layer=layer, kind=layer.kind)
        for p, i in _edges(self.model):
            g.add_edge(p, i, bytes=self.model.layers[p].output_bytes)
        return g

    @property
    def is_chain(self) -> bool:
        """True when every layer feeds exactly the next one (no branches)."""
        return all(producers(self.model, i) == ((i - 1,) if i else ()) for i in range(self.model.num_layers))

    @cached_property
    def order(self) -> tuple[int, ...]:
        """Topological order the pipeline partitions: execution order, ties broken by layer index."""
        return tuple(nx.lexicographical_topological_sort(self.graph))

    def sources(self) -> list[int]:
        """Layers that read the micro-batch input (tokens, images)."""
        return [n for n in self.order if self.graph.in_degree(n) == 0]

    @cached_property
    def _cuts(self) -> list[int]:
        return boundary_bytes(self.model)

    def cut_bytes(self, boundary: int) -> int:
        """Bytes crossing a stage boundary placed before layer `boundary` (every live producer output, once)."""
        return self._cuts[boundary] if 0 <= boundary <= self.model.num_layers else 0

    def as_chain(self) -> Model:
        """The same Model with each layer's output_bytes set to what a cut right after it sends,
        so simulators that read only the last layer's output see branch traffic too."""
        layers = tuple(replace(layer, output_bytes=self._cuts[i + 1] if i + 1 < self.model.num_layers
                                else layer.output_bytes)
                       for i, layer in enumerate(self.model.layers))
        return replace(self.model, layers=layers)

    def kind_summaries(self) -> list[KindSummary]:
        """Per-kind count, mean F/I/W, state, activation and output bytes, in first-appearance order."""
        groups: dict[str, list[Layer]] = {}
        for i in self.order:
            layer = self.model.layers[i]
            groups.setdefault(layer.kind, []).append(layer)
        out = []
        for kind, layers in groups.items():
            def mean(attr: str) -> float:
                return statistics.fmean(getattr(x, attr) for x in layers)

            out.append(KindSummary(kind=kind, count=len(layers), fwd_ms=mean("fwd_ms"), bwd_ms=mean("bwd_ms"),
                                   wgrad_ms=mean("wgrad_ms"), state_bytes=mean("state_bytes"),
                                   activation_bytes=mean("activation_bytes"), output_bytes=mean("output_bytes"),
                                   total_ms=sum(x.total_ms for x in layers)))
        return out

    def heaviest(self) -> Heaviest:
        """The costliest layer (F + I + W) and its ratio to the median layer's."""
        totals = [layer.total_ms for layer in self.model.layers]
        index = max(range(len(totals)), key=totals.__getitem__)
        median = statistics.median(totals)
        ratio = totals[index] / median if median > 0 else float("inf")
        return Heaviest(index=index, layer=self.model.layers[index], ratio_to_median=ratio)

    def totals(self) -> dict[str, float]:
        """Whole-model F, I, W milliseconds and state / activation bytes of one micro-batch."""
        layers = self.model.layers
        return {"fwd_ms": sum(x.fwd_ms for x in layers), "bwd_ms": sum(x.bwd_ms for x in layers),
                "wgrad_ms": sum(x.wgrad_ms for x in layers), "state_bytes": sum(x.state_bytes for x in layers),
                "activation_bytes": sum(x.activation_bytes for x in layers)}
