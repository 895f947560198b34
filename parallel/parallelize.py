"""Apply parallelism to a model on the trainer mesh, one order for every family.

The order (torchtitan's) is expert parallel -> context parallel -> activation checkpointing
-> torch.compile -> FSDP2. Today only the last stage exists (FSDP2 over the `dp_shard` axis);
the others arrive with the models-and-parallelism work and slot in before it.

FSDP2 wraps every transformer block, then the root, so that one block's parameters are
gathered at a time. On GPU the parameters are kept in fp32 and computed in bf16
(MixedPrecisionPolicy); gradients are reduced in fp32. On CPU everything is fp32.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def parallelize(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype) -> nn.Module:
    """Shard `model` with FSDP2 over `mesh` (per block, then the root). Returns the model."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = getattr(model, "layers", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no `layers` container to shard per block")
    children = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks
    for block in children:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full parameter) in a fixed order; a collective on the trainer mesh.

    Every trainer rank must iterate to the end (each DTensor's all-gather involves them all).
    """
    for name, param in model.named_parameters():
        t = param.detach()
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)
