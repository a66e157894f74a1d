"""Megatron's per-micro-batch loss dicts sent from the rank that computed the loss to the rank that logs them.

Under a V-shape plan the loss is computed on pipeline rank 0 while Megatron's train_step and
evaluate reduce the loss dicts on its last pipeline rank. `send_object_list` would pickle the
dicts' GPU tensors, and the receiver would unpickle them onto the *sender's* GPU. Here only
the structure travels pickled (keys, shapes, dtypes, plain Python values); every tensor is sent
with a point-to-point send and received into a buffer on the receiver's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where a tensor sat in the structure: its index in the send order, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def split_tensors(value, tensors: list):
    """`value` with every tensor replaced by a TensorSlot (the tensors appended to `tensors`, in order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: split_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(split_tensors(v, tensors) for v in value)
    return value


def fill_tensors(value, tensors: list):
    """The structure of `split_tensors` with each TensorSlot replaced by its received tensor."""
    if isinstance(value, TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: fill_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(fill_tensors(v, tensors) for v in value)
    return value


def send_loss_dicts(dicts: list, dst: int, group) -> None:
    """Send the loss dicts to group rank `dst`: their structure pickled, their tensors point to point."""
    tensors: list[torch.Tensor] = []
    skeleton = split_tensors(dicts, tensors)
    dist.send_object_list([skeleton], group_dst=dst, group=group)
    for t in tensors:
        dist.send(t, group_dst=dst, group=group)


def recv_loss_dicts(src: int, group, device) -> list:
    """Receive what `send_loss_dicts` sent from group rank `src`, tensors on `device`."""
    box = [None]
    dist.recv_object_list(box, group_src=src, group=group)
    slots: list[TensorSlot] = []
    slots_of(box[0], slots)
    tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in sorted(slots, key=lambda s: s.index)]
    for t in tensors:
        dist.recv(t, group_src=src, group=group)
    return fill_tensors(box[0], tensors)


def slots_of(value, slots: list) -> None:
    """Collect the TensorSlots of a received structure."""
    if isinstance(value, TensorSlot):
        slots.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            slots_of(v, slots)
    elif isinstance(value, (list, tuple)):
        for v in value:
            slots_of(v, slots)
