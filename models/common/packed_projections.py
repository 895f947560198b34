"""Packed projections for inference: q/k/v as one matmul, SwiGLU's gate and up as one matmul.

A decode step of a small batch is bound by how many kernels it launches, not by the bytes it
reads (docs/benchmarks.md, the engine matrix at 8 and 64 sequences). Two projections that read
the same input can be one matmul over their weights stacked by rows: q/k/v in `GQAttention`
(3 -> 1) and w1/w3 in `FeedForward` (2 -> 1), 3 fewer launches per layer.

No parameter changes name, shape or identity: weight sync, state dicts and checkpoints see the
same `wq.weight`, `wk.weight`, `wv.weight`. The stacked matrix is a view over the members'
storage, valid only while the members are neighbouring rows of one storage:

- `pack(model)` (the native engine, once its model is on the device, where `enabled`) moves each group's weights
  (and biases) into one new storage, rows one after another, and rebinds the parameters' data to
  views of it; then `bind`.
- `bind(model)` sets each module's `packed` {group: (weight, bias or None, output sizes)} for the
  groups whose members are neighbours, and clears the rest. The colocated receiver calls it again
  after it made every parameter a view of one flat buffer (runtime/weight_sync.py): the members
  are neighbours there when they are consecutive parameters (q/k/v and w1/w3 without biases).

In-place weight loads (weight sync) write the members, so the stacked view sees them. Only exact
`nn.Linear` members without hooks are packed: FP8 linears, tensor-parallel shards and LoRA
wrappers keep their own forwards. A module class opts in with `packs = {group: member names}` and
reads `self.packed` in its forward; the trainer never packs (its `packed` stays empty).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

Packed = tuple[Tensor, Tensor | None, tuple[int, ...]]


def _members(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    linears = [getattr(module, name, None) for name in names]
    if not all(type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks for lin in linears):
        return None
    first = linears[0].weight
    if any(lin.in_features != linears[0].in_features or lin.weight.dtype != first.dtype
           or lin.weight.device != first.device or (lin.bias is None) != (linears[0].bias is None) for lin in linears):
        return None
    return linears


def _groups(model: nn.Module):
    for module in model.modules():
        for group, names in getattr(type(module), "packs", {}).items():
            yield module, group, _members(module, names)


def _stacked(tensors: list[Tensor]) -> Tensor | None:
    """One view over `tensors` stacked along dim 0 if they are contiguous neighbours in one storage."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]):
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def enabled(device: torch.device) -> bool:
    """Whether the engine packs on `device`: on CUDA (measured faster: an H200's 0.6B decode step
    2.21 -> 1.87 ms at 8 sequences), not on CPU (3-6% slower there, docs/benchmarks.md).
    MESHRL_PACKED_PROJECTIONS=1 / 0 forces it on / off (to compare; the CPU tests)."""
    forced = os.environ.get("MESHRL_PACKED_PROJECTIONS")
    return forced != "0" if forced in ("0", "1") else device.type == "cuda"


@torch.no_grad()
def pack(model: nn.Module) -> int:
    """Give every packable group one storage (module docstring), then `bind`; returns the groups packed."""
    for _, _, linears in _groups(model):
        if linears is None:
            continue
        for attr in ("weight", "bias"):
            if getattr(linears[0], attr) is None:
                continue
            stacked = torch.cat([getattr(lin, attr).detach() for lin in linears])
            offset = 0
            for lin in linears:
                param = getattr(lin, attr)
                param.data = stacked[offset:offset + param.shape[0]]
                offset += param.shape[0]
    return bind(model)


def bind(model: nn.Module) -> int:
    """Set each opted-in module's `packed` from where its members' data lives now; returns how many
    groups are packed (the others fall back to one matmul per member)."""
    count = 0
    for module, group, linears in _groups(model):
        packed: dict[str, Packed] = {name: entry for name, entry in module.packed.items() if name != group}
        weight = _stacked([lin.weight for lin in linears]) if linears else None
        bias = None
        if weight is not None and linears[0].bias is not None:
            bias = _stacked([lin.bias for lin in linears])
            weight = weight if bias is not None else None
        if weight is not None:
            packed[group] = (weight, bias, tuple(lin.out_features for lin in linears))
            count += 1
        module.packed = packed
    return count
