"""What crosses a stage boundary: one tensor, or a tuple / list / dict of them (nested allowed).

A boundary value is flattened into its tensor leaves (in a fixed order: sequence order,
dict insertion order) and a structure that rebuilds it. `BoundaryMeta` is the same
structure with a `TensorMeta` at every leaf; the receiver allocates its buffers from it,
and the gradient of a boundary travels back only for the leaves whose meta `needs_grad`.
A meta the receiver cannot know in advance travels once per step as a small JSON
handshake (`encode_meta` / `decode_meta`) ahead of the first activation of the boundary.
"""

from __future__ import annotations

import json
from typing import Any, Sequence, Union

import torch

from .interface import TensorMeta

# A pytree of TensorMeta: TensorMeta | tuple/list of metas | dict[str, meta]
BoundaryMeta = Union[TensorMeta, tuple, list, dict]

META_BYTES = 8192  # the handshake buffer: JSON of structure, shapes, dtypes, requires_grad flags
_LEAF = "T"


def flatten(value) -> tuple[list, Any]:
    """(leaves in order, structure) of a boundary value or meta; a leaf is anything not a tuple/list/dict."""
    leaves: list = []
    return leaves, _flatten(value, leaves)


def _flatten(value, leaves: list):
    if isinstance(value, dict):
        return ("dict", tuple((k, _flatten(v, leaves)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("tuple" if isinstance(value, tuple) else "list", tuple(_flatten(v, leaves) for v in value))
    leaves.append(value)
    return _LEAF


def unflatten(leaves: Sequence, structure):
    """Rebuild a value of `structure` from its leaves (inverse of `flatten`)."""
    it = iter(leaves)
    out = _unflatten(it, structure)
    if next(it, _END) is not _END:
        raise ValueError("more leaves than the structure holds")
    return out


_END = object()


def _unflatten(it, structure):
    if structure == _LEAF:
        return next(it)
    kind, items = structure
    if kind == "dict":
        return {k: _unflatten(it, s) for k, s in items}
    seq = [_unflatten(it, s) for s in items]
    return tuple(seq) if kind == "tuple" else seq


def meta_of(value, *, grad: bool = True) -> BoundaryMeta:
    """The meta of a boundary value; `grad=False` (forward-only steps) marks no leaf as needing a gradient."""
    leaves, structure = flatten(value)
    metas = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a boundary carries tensors only, got {type(t).__name__}")
        metas.append(TensorMeta(shape=tuple(t.shape), dtype=t.dtype, requires_grad=grad and t.requires_grad))
    return unflatten(metas, structure)


def leaf_metas(meta: BoundaryMeta) -> tuple[list[TensorMeta], Any]:
    """(leaf metas, structure) of a boundary meta."""
    leaves, structure = flatten(meta)
    for m in leaves:
        if not isinstance(m, TensorMeta):
            raise TypeError(f"a boundary meta holds TensorMeta leaves, got {type(m).__name__}")
    return leaves, structure


def mismatch(declared: BoundaryMeta, actual: BoundaryMeta, *, check_grad: bool) -> str | None:
    """Why a produced value does not fit the declared meta (None when it fits)."""
    d_leaves, d_struct = leaf_metas(declared)
    a_leaves, a_struct = leaf_metas(actual)
    if d_struct != a_struct:
        return f"structure {_describe(a_struct)}, declared {_describe(d_struct)}"
    for i, (d, a) in enumerate(zip(d_leaves, a_leaves)):
        if tuple(d.shape) != tuple(a.shape) or d.dtype != a.dtype:
            return f"leaf {i}: {tuple(a.shape)} {a.dtype}, declared {tuple(d.shape)} {d.dtype}"
        # a leaf that needs a gradient the receiver would not send back would silently lose it
        if check_grad and a.needs_grad and not d.needs_grad:
            return f"leaf {i} requires grad, declared requires_grad=False (its gradient would be dropped)"
    return None


def _describe(structure) -> str:
    if structure == _LEAF:
        return "tensor"
    kind, items = structure
    if kind == "dict":
        return "{" + ", ".join(f"{k}: {_describe(s)}" for k, s in items) + "}"
    inner = ", ".join(_describe(s) for s in items)
    return f"({inner})" if kind == "tuple" else f"[{inner}]"


def encode_meta(meta: BoundaryMeta) -> torch.Tensor:
    """The handshake message of a meta: a fixed-size uint8 tensor holding its length and JSON."""
    leaves, structure = leaf_metas(meta)
    doc = {"s": structure, "t": [[list(m.shape), str(m.dtype).removeprefix("torch."), m.requires_grad]
                                 for m in leaves]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) + 4 > META_BYTES:
        raise ValueError(f"boundary meta of {len(leaves)} tensors needs {len(raw)} bytes, the handshake holds "
                         f"{META_BYTES - 4}")
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def decode_meta(buf: torch.Tensor) -> BoundaryMeta:
    """The meta a handshake message carries (inverse of `encode_meta`)."""
    data = bytes(buf.cpu().tolist())
    n = int.from_bytes(data[:4], "little")
    doc = json.loads(data[4:4 + n].decode())
    leaves = [TensorMeta(shape=tuple(shape), dtype=getattr(torch, dtype), requires_grad=rg)
              for shape, dtype, rg in doc["t"]]
    return unflatten(leaves, _tuples(doc["s"]))


def _tuples(structure):
    """JSON turned the structure's tuples into lists: turn them back so structures compare equal."""
    if structure == _LEAF:
        return _LEAF
    kind, items = structure
    if kind == "dict":
        return (kind, tuple((k, _tuples(s)) for k, s in items))
    return (kind, tuple(_tuples(s) for s in items))


def grad_leaves(meta: BoundaryMeta) -> list[int]:
    """Indices of the leaves whose gradient travels back."""
    leaves, _ = leaf_metas(meta)
    return [i for i, m in enumerate(leaves) if m.needs_grad]


def pack_grads(meta: BoundaryMeta, grads, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The tensors a gradient message carries: one per leaf that needs a gradient, zeros (on `device`) where the
    stage gave None."""
    leaves, structure = leaf_metas(meta)
    if grads is None:
        glist = [None] * len(leaves)
    else:
        glist, gstruct = flatten(grads)
        if gstruct != structure:
            raise ValueError(f"gradient structure {_describe(gstruct)} does not match the boundary's "
                             f"{_describe(structure)}")
    out = []
    for i in grad_leaves(meta):
        g = glist[i]
        out.append(g if g is not None else torch.zeros(leaves[i].shape, dtype=leaves[i].dtype, device=device))
    return out


def unpack_grads(meta: BoundaryMeta, tensors: Sequence[torch.Tensor]):
    """The gradient value of a boundary: its structure, received tensors at grad leaves, None elsewhere."""
    leaves, structure = leaf_metas(meta)
    full: list = [None] * len(leaves)
    for i, t in zip(grad_leaves(meta), tensors, strict=True):
        full[i] = t
    return unflatten(full, structure)


def same_meta(a: BoundaryMeta, b: BoundaryMeta) -> bool:
    """Whether two metas describe identical buffers (structure, shapes, dtypes, gradient flags)."""
    al, ast = leaf_metas(a)
    bl, bst = leaf_metas(b)
    return ast == bst and all(tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype and x.needs_grad == y.needs_grad
                              for x, y in zip(al, bl))

