"""Trainer -> inference weight broadcast in flat buckets.

After every optimizer step the trainer ranks gather each parameter's full tensor (a
collective over the trainer mesh), trainer rank 0 packs them into flat buckets of about
`bucket_mb` MiB in the inference dtype, and broadcasts each bucket on the sync group
(trainer rank 0 + every inference rank; NCCL on GPU, gloo on CPU). Each inference rank
receives the same buckets and copies the slices into its engine's parameters in place,
between two decode steps, so requests in flight keep their KV cache and go on.

Both sides derive the same bucket plan from the parameter names and shapes of the same
model definition, so nothing but the flat buffers crosses the wire.

Tensor-parallel inference ranks (parallel/tensor_parallel.py) receive the same full buckets and
copy only their slice of each sharded parameter: the plan is made of full shapes on both sides
(`tensor_parallel.full_shape`), and `tensor_parallel.local_slice` picks the rank's rows or
columns out of the received tensor. The trainer does not know how the engines are split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from meshrl.parallel import full_tensors
from meshrl.parallel.tensor_parallel import full_shape, local_slice


def bucket_plan(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, bucket_mb: float) -> list[list[int]]:
    """Group parameter indices into consecutive buckets of at most ~bucket_mb MiB (one big tensor may exceed it)."""
    limit = bucket_mb * 2**20
    plan: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, shape) in enumerate(shapes):
        nbytes = math.prod(shape) * itemsize
        if current and size + nbytes > limit:
            plan.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        plan.append(current)
    return plan


def _shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    # full shapes, so the trainer's sharded (FSDP / expert-parallel) model and a tensor-parallel
    # engine's model give the same plan
    return [(name, full_shape(model, name, p)) for name, p in model.named_parameters()]


@torch.no_grad()
def send_weights(model: nn.Module, group: dist.ProcessGroup | None, src: int, dtype: torch.dtype,
                 bucket_mb: float, device: torch.device) -> int:
    """Trainer side. Every trainer rank calls it (full-tensor gathers); only `src` broadcasts.

    `group` is the sync group on trainer rank 0 and None on the other trainer ranks.
    Returns the number of bytes broadcast.
    """
    shapes = _shapes(model)
    plan = bucket_plan(shapes, dtype.itemsize, bucket_mb)
    tensors = full_tensors(model)
    sent = 0
    for bucket in plan:
        numel = sum(math.prod(shapes[i][1]) for i in bucket)
        # cast straight into the bucket: no per-parameter temporary, no concatenation
        flat = torch.empty(numel, dtype=dtype, device=device) if group is not None else None
        offset = 0
        for _ in bucket:
            t = next(tensors)[1]
            if flat is not None:
                flat[offset:offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
        if flat is None:
            continue
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    assert next(tensors, None) is None, "bucket plan does not cover every parameter"
    return sent


@torch.no_grad()
def receive_weights(model: nn.Module, group: dist.ProcessGroup, src: int, dtype: torch.dtype,
                    bucket_mb: float, device: torch.device) -> None:
    """Inference side: receive every bucket and copy it into `model`'s parameters in place
    (a tensor-parallel model's sharded parameters take only their slice of the full tensor)."""
    shapes = _shapes(model)
    params = [p for _, p in model.named_parameters()]
    for bucket in bucket_plan(shapes, dtype.itemsize, bucket_mb):
        numel = sum(math.prod(shapes[i][1]) for i in bucket)
        flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in bucket:
            name, shape = shapes[i]
            size = math.prod(shape)
            params[i].copy_(local_slice(model, name, flat[offset:offset + size].view(shape)))
            offset += size
