"""Two small real-compute models whose stage boundaries carry several tensors (tests and examples).

- `MaskedToy`: every boundary carries (hidden, mask), the mask an integer padding mask that
  needs no gradient; the loss is Megatron-shaped (loss_sum, num_tokens, dict).
- `GraphToy`: any layer graph of a `Model` (the zoo's `vlm`: a vision encoder and a text
  embedding both feeding the first decoder layer) with tiny real layers; a boundary carries
  a dict of every output live across it, exactly the cut `graph.live_outputs` names, and a
  stage holding a source layer (the text embedding) reads the micro-batch itself.
Both build identical weights in every process (seeded) and give a single-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..graph import live_outputs, producers
from ..executor.interface import TensorMeta
from .toy import AttnBlock, MLPBlock


def to_device(batches: list, device) -> list:
    """Every tensor of every micro-batch moved to `device`."""
    return [tuple(t.to(device) for t in b) for b in batches]


# ----- (hidden, mask) boundaries

@dataclass(frozen=True, kw_only=True, slots=True)
class MaskedSpec:
    """Shape of the masked toy and its data; `seq` is the default sequence length."""

    hidden: int = 8
    vocab: int = 11
    batch: int = 2
    layers: tuple[str, ...] = ("embed", "attn", "mlp", "attn", "mlp", "attn", "mlp", "head")
    seed: int = 0


class _Embed(nn.Module):
    def __init__(self, vocab: int, h: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)

    def forward(self, x):
        """(tokens, mask) -> (hidden, mask)."""
        tokens, mask = x
        return self.emb(tokens) * mask.unsqueeze(-1), mask


class _MaskedAttn(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, num_heads=2, batch_first=True)

    def forward(self, x):
        """(hidden, mask) -> (hidden + attention over the unpadded keys, mask)."""
        h, mask = x
        y = self.norm(h)
        out, _ = self.attn(y, y, y, key_padding_mask=mask == 0, need_weights=False)
        return h + out * mask.unsqueeze(-1), mask


class _MaskedMLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.block = MLPBlock(h)

    def forward(self, x):
        """(hidden, mask) -> (MLP block of hidden, mask)."""
        h, mask = x
        return self.block(h), mask


class _Head(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        """(hidden, mask) -> the output (the mask stays with the batch for the loss)."""
        h, _ = x
        return self.proj(h)


class MaskedToy:
    """The masked toy: layers, data, loss, boundary metas and the single-process reference."""

    def __init__(self, spec: MaskedSpec = MaskedSpec()):
        self.spec = spec

    def build(self) -> nn.ModuleList:
        """Every layer, seeded so every process builds identical weights (float64)."""
        torch.manual_seed(self.spec.seed)
        h = self.spec.hidden
        make = {"embed": lambda: _Embed(self.spec.vocab, h), "attn": lambda: _MaskedAttn(h),
                "mlp": lambda: _MaskedMLP(h), "head": lambda: _Head(h)}
        return nn.ModuleList([make[k]() for k in self.spec.layers]).double()

    def microbatch(self, mb: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, mask, target): the mask pads a random tail of each row (never the first position)."""
        g = torch.Generator().manual_seed(self.spec.seed * 7919 + mb * 31 + seq)
        b = self.spec.batch
        tokens = torch.randint(0, self.spec.vocab, (b, seq), generator=g)
        lengths = torch.randint(1, seq + 1, (b,), generator=g)
        mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
        target = torch.randn(b, seq, self.spec.hidden, generator=g, dtype=torch.float64)
        return tokens, mask, target

    def data(self, num_microbatches: int, seq: int) -> list:
        """One step's micro-batches."""
        return [self.microbatch(mb, seq) for mb in range(num_microbatches)]

    @staticmethod
    def call(stage: int, module: nn.Module, inputs, batch):
        """Stage 0 reads (tokens, mask) from the batch; the others take (hidden, mask)."""
        return module((batch[0], batch[1])) if stage == 0 else module(inputs)

    @staticmethod
    def loss_fn(out: torch.Tensor, batch):
        """Megatron-shaped: (masked squared-error sum, number of unmasked tokens, logging dict)."""
        _, mask, target = batch
        loss_sum = (((out - target) ** 2).mean(-1) * mask).sum()
        num_tokens = mask.sum()
        return loss_sum, num_tokens, {"lm loss": (loss_sum / num_tokens).detach(), "tokens": num_tokens}

    @staticmethod
    def scale_loss(num_microbatches: int):
        """Per-token mean, then mean over micro-batches (what the reference computes)."""
        return lambda loss, num_tokens: loss / num_tokens / num_microbatches

    def metas(self, num_stages: int, seq: int) -> tuple:
        """(hidden, mask) at every boundary for sequence length `seq`."""
        b, h = self.spec.batch, self.spec.hidden
        act = (TensorMeta(shape=(b, seq, h), dtype=torch.float64),
               TensorMeta(shape=(b, seq), dtype=torch.int64, requires_grad=False))
        return tuple(act for _ in range(num_stages - 1))

    def reference(self, layers: nn.ModuleList, num_microbatches: int, seq: int, device="cpu") -> torch.Tensor:
        """Mean per-token loss over micro-batches, gradients left in `layers` (on `device`)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in to_device(self.data(num_microbatches, seq), device):
            x = (batch[0], batch[1])
            for layer in layers:
                x = layer(x)
            loss_sum, n, _ = self.loss_fn(x, batch)
            loss = loss_sum / n / num_microbatches
            loss.backward()
            total += loss.detach()
        return total


# ----- a layer graph (the zoo's vlm) with real tensors

@dataclass(frozen=True, kw_only=True, slots=True)
class GraphSpec:
    """Tiny dimensions for a graph model's real layers."""

    hidden: int = 8
    vision_hidden: int = 6
    vocab: int = 13
    image_tokens: int = 3
    batch: int = 2
    seed: int = 0


class _Join(nn.Module):
    """A layer consuming several producers: their outputs joined along the sequence, then a block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *xs):
        """Concatenate the inputs along the sequence and run the block."""
        return self.block(torch.cat(xs, dim=1))


class _StageLayers(nn.Module):
    """Layers [start, end) of a model, looked up by their global index."""

    def __init__(self, layers, start: int, end: int):
        super().__init__()
        self.owned = nn.ModuleDict({str(i): layers[i] for i in range(start, end)})

    def __getitem__(self, i: int) -> nn.Module:
        return self.owned[str(i)]


class GraphToy:
    """Real layers for each layer of `model` (by kind), wired as `model`'s graph says."""

    SOURCES = ("vision", "embedding")

    def __init__(self, model, spec: GraphSpec = GraphSpec()):
        self.model = model
        self.spec = spec

    def _layer(self, i: int) -> nn.Module:
        kind = self.model.layers[i].kind
        h, vh = self.spec.hidden, self.spec.vision_hidden
        if kind == "vision":
            return nn.Linear(vh, vh) if not producers(self.model, i) else MLPBlock(vh)
        if kind == "projector":
            return nn.Linear(vh, h)
        if kind == "embedding":
            return nn.Embedding(self.spec.vocab, h)
        if kind == "lm_head":
            return nn.Linear(h, self.spec.vocab)
        block = AttnBlock(h) if i % 2 else MLPBlock(h)
        return _Join(block) if len(producers(self.model, i)) > 1 else block

    def build(self) -> nn.ModuleList:
        """Every layer, seeded so every process builds identical weights (float64)."""
        torch.manual_seed(self.spec.seed)
        return nn.ModuleList([self._layer(i) for i in range(self.model.num_layers)]).double()

    def microbatch(self, mb: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image features, text tokens, next-token labels over image + text positions)."""
        g = torch.Generator().manual_seed(self.spec.seed * 7919 + mb * 31 + seq)
        b, p = self.spec.batch, self.spec.image_tokens
        images = torch.randn(b, p, self.spec.vision_hidden, generator=g, dtype=torch.float64)
        tokens = torch.randint(0, self.spec.vocab, (b, seq), generator=g)
        labels = torch.randint(0, self.spec.vocab, (b, p + seq), generator=g)
        return images, tokens, labels

    def data(self, num_microbatches: int, seq: int) -> list:
        """One step's micro-batches."""
        return [self.microbatch(mb, seq) for mb in range(num_microbatches)]

    def run_layers(self, layers, start: int, end: int, live: dict | None, batch):
        """Layers [start, end) given the live outputs entering the stage ({'layer index': tensor});
        returns the outputs live after `end` (a dict), or the last layer's output at the model's end."""
        values = {int(k): v for k, v in (live or {}).items()}
        for i in range(start, end):
            srcs = producers(self.model, i)
            if not srcs:  # a source layer reads the micro-batch
                kind = self.model.layers[i].kind
                values[i] = layers[i](batch[0] if kind == "vision" else batch[1])
            else:
                values[i] = layers[i](*(values[p] for p in srcs))
        if end == self.model.num_layers:
            return values[end - 1]
        return {str(p): values[p] for p in live_outputs(self.model, end)}

    @staticmethod
    def stage_modules(layers, bounds, stages) -> dict[int, nn.Module]:
        """Each listed stage's layers, indexable by global layer index."""
        return {s: _StageLayers(layers, *bounds[s]) for s in stages}

    def stage_call(self, bounds):
        """TorchStages `call`: run stage s's layer range on the live outputs entering it."""
        def call(stage, module, inputs, batch):
            start, end = bounds[stage]
            return self.run_layers(module, start, end, inputs, batch)

        return call

    @staticmethod
    def loss_fn(out: torch.Tensor, batch):
        """Cross-entropy over every position, with a logging dict."""
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[2].reshape(-1))
        return loss, {"ce": loss.detach()}

    def metas(self, bounds, seq: int) -> tuple:
        """Per boundary, a dict of the live outputs' metas (image positions or text positions of hidden size)."""
        b, p = self.spec.batch, self.spec.image_tokens
        out = []
        for _, end in bounds[:-1]:
            metas = {}
            for q in live_outputs(self.model, end):
                kind = self.model.layers[q].kind
                width = self.spec.vision_hidden if kind == "vision" else self.spec.hidden
                length = seq if kind == "embedding" else p if kind in ("vision", "projector") else p + seq
                metas[str(q)] = TensorMeta(shape=(b, length, width), dtype=torch.float64)
            out.append(metas)
        return tuple(out)

    def reference(self, layers, num_microbatches: int, seq: int, device="cpu") -> torch.Tensor:
        """Mean loss over micro-batches, gradients left in `layers` (on `device`)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in to_device(self.data(num_microbatches, seq), device):
            out = self.run_layers(layers, 0, self.model.num_layers, None, batch)
            loss = self.loss_fn(out, batch)[0] / num_microbatches
            loss.backward()
            total += loss.detach()
        return total
