"""Expert parallelism: split every MoE layer's experts over the `ep` ranks, move tokens by all-to-all.

After `apply_expert_parallel(model, ep_mesh)` rank r of the ep group holds experts
[r * E/ep, (r + 1) * E/ep) of every MoE layer, and the MoE's dispatcher is replaced:

    1. counts (E,) of rows per expert -> all-to-all -> how many rows every rank sends to
       each of my experts; the split sizes per rank follow from them (one host sync);
    2. the rows, already sorted by expert, go to the ranks holding their experts (all-to-all);
    3. received rows are regrouped by local expert (they arrive grouped by source rank), the
       local experts run, and the rows are put back in arrival order;
    4. a second all-to-all returns every row to the rank it came from, in its original place.

Routing, the top-k weighting and the combine into tokens stay on the token's own rank (see
common/moe.py). The all-to-all is an autograd function whose backward is the reverse
all-to-all, so an expert's gradient sums the contributions of every rank's tokens. That sum is
already the complete gradient of the expert slice: nothing may reduce expert gradients over
`ep` again, while non-expert gradients are summed over all data-parallel ranks as usual
(FSDP2 with divide factor 1, or an all-reduce).

Why the shards are plain local tensors, not DTensor(Shard(0)) on the ep mesh: FSDP2 accepts a
DTensor parameter only if its mesh and the FSDP mesh are sub-meshes of one root mesh, and the
trainer's meshes are built from separate process groups (parallel/dims.py: torch has no
DeviceMesh over a subset of the world otherwise). A plain (E/ep, ...) parameter is an ordinary
parameter to FSDP2, so the expert groups can be wrapped with `fully_shard` on the expert-FSDP
mesh (`dp_shard_mod_ep`) before their blocks are wrapped on the dense mesh; the block's wrap then
leaves them alone. The cost of plain tensors is that nothing in the parameter says it is an ep
shard: full weights (export, weight sync) need `gather_expert_shards` over the ep group. Each
expert module carries `ep_group` and `num_global_experts`, and its parameters carry
`_meshrl_ep_gather` (note that `fully_shard` replaces parameter objects, dropping such
attributes: after FSDP2 look the module up instead, see `ep_gather_for`).

Initialise or load the full model on every rank first (as for FSDP), then apply this: each rank
keeps its slice and frees the rest. On the meta device the slices are meta tensors.
Works on gloo (CPU) and NCCL (GPU) alike.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from meshrl.models.common.moe import GroupedExperts, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with explicit split sizes; backward runs the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad_in = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable all_to_all_single: x (sum(in_splits), ...) -> (sum(out_splits), ...)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelDispatcher:
    """The MoE dispatcher of one ep rank (common/moe.py's `Dispatcher` protocol)."""

    def __init__(self, group: dist.ProcessGroup, num_global_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_global_experts = num_global_experts
        self.num_local_experts = num_global_experts // self.ep

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        # x: (M, dim) rows sorted by global expert; counts: (E,) int64 -> (M, dim) expert outputs
        ep, local = self.ep, self.num_local_experts
        assert counts.shape == (self.num_global_experts,) and experts.num_experts == local
        # recv_counts[s, j]: rows rank s sends to my local expert j.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(ep, local)
        send_counts = counts.view(ep, local)
        splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # one host sync
        send_splits, recv_splits = splits[0], splits[1]

        x_recv = all_to_all(x, recv_splits, send_splits, self.group)  # (R, dim), grouped by source rank
        # Regroup by local expert (stable: source rank order is kept within an expert).
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=counts.device).repeat(ep), recv_counts.flatten())  # (R,)
        perm = torch.argsort(expert_of_row, stable=True)
        y_local = experts(x_recv[perm], recv_counts.sum(0))  # (R, dim)
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)  # back in arrival order
        return all_to_all(y_recv, send_splits, recv_splits, self.group)  # (M, dim)


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The grouped-expert modules of a model (the units FSDP2 wraps on the expert mesh)."""
    return [m.experts for m in moe_layers(model)]


def gather_expert_shards(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(E/ep, ...) shard of this rank -> the full (E, ...) tensor; a collective over `group`."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def ep_gather_for(model: nn.Module, param_name: str):
    """The function that turns the local value of parameter `param_name` into the full one over
    ep (`gather_expert_shards` bound to its group), or None if the parameter is not an ep shard.
    Looks at the owning module, so it works after `fully_shard` replaced the parameters."""
    module_name, _, _ = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    group = getattr(module, "ep_group", None)
    return None if group is None else functools.partial(gather_expert_shards, group=group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer and dispatch tokens by all-to-all. In place.

    `ep_mesh` is a 1-D mesh over the ep ranks. Raises ValueError if the model has no MoE layer,
    a layer's expert count is not divisible by ep, or the model is already expert-parallel.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D ep mesh, got {ep_mesh.ndim} dims "
                         f"{ep_mesh.mesh_dim_names}")
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers to split over ep ranks")
    ep, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    for moe in layers:
        if getattr(moe.experts, "ep_group", None) is not None:
            raise ValueError("apply_expert_parallel was already applied to this model")
        if moe.num_experts % ep != 0:
            raise ValueError(f"a MoE layer has {moe.num_experts} experts, which ep = {ep} ranks cannot split "
                             f"evenly (ep must divide the number of experts)")
    if ep == 1:
        return model
    for moe in layers:
        experts = moe.experts
        local = moe.num_experts // ep
        gather = functools.partial(gather_expert_shards, group=group)
        for name, full in list(experts.named_parameters(recurse=False)):  # w1, w2, w3 (and biases): expert on dim 0
            # clone: the slice must own its storage so the full tensor is freed.
            shard = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(),
                                 requires_grad=full.requires_grad)
            shard._meshrl_ep_gather = gather
            setattr(experts, name, shard)
        experts.num_experts = local
        experts.num_global_experts = moe.num_experts
        experts.ep_group = group
        moe.dispatcher = ExpertParallelDispatcher(group, moe.num_experts)
    return model
