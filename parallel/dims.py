"""Parallel degrees of the trainer sub-mesh and the process groups / meshes they imply.

The trainer ranks form a grid with named axes, outermost first:

    (dp_replicate, dp_shard, cp)          product = number of trainer ranks

- `dp_replicate` x `dp_shard` is data parallelism: every (replicate, shard) pair is one
  *data rank* that receives its own micro-batches from the controller. FSDP2 shards
  parameters over `dp_shard` (and `cp`, see below) and, when `dp_replicate > 1`, replicates
  the shards across `dp_replicate` (HSDP).
- `cp` ranks of one data rank hold pieces of the same packed rows (context parallel). They
  also shard parameters: FSDP2 runs over the flattened `dp_shard x cp` axis ("dp_shard_cp"),
  so CP costs no extra parameter memory.
- `ep` does not add ranks: it splits the flattened `dp_shard_cp` axis into
  (`dp_shard_mod_ep`, `ep`), innermost `ep`. Experts are sharded over `ep` (each rank holds
  num_experts / ep of them) and FSDP2 shards each expert shard over `dp_shard_mod_ep`.

Gradients are summed, never averaged, over every axis (FSDP's divide factor is 1) and losses
are normalised by the step's global loss-token count, so the update equals the
single-process update of the whole batch whatever the degrees (runtime/train/losses.py).

torch creates a DeviceMesh over a subset of the world only from existing groups, so the
groups are made here explicitly (every rank of the world calls `new_group` for every group,
as torch requires) and the trainer ranks wrap theirs with `DeviceMesh.from_group`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where meshes are built: config validation needs only ParallelDims
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees of one trainer sub-mesh (`-1` already resolved)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int

    @classmethod
    def resolve(cls, num_ranks: int, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1,
                ep: int = 1) -> ParallelDims:
        """Fill `dp_shard = -1` from `num_ranks` and check every constraint (ValueError otherwise)."""
        if num_ranks < 1:
            raise ValueError(f"the trainer needs at least one rank, got {num_ranks}")
        for name, value in (("dp_replicate", dp_replicate), ("cp", cp), ("ep", ep)):
            if value < 1:
                raise ValueError(f"trainer.parallel.{name} must be >= 1, got {value}")
        if dp_shard == -1:
            if num_ranks % (dp_replicate * cp) != 0:
                raise ValueError(f"trainer.parallel: dp_replicate ({dp_replicate}) x cp ({cp}) must divide the "
                                 f"{num_ranks} trainer ranks")
            dp_shard = num_ranks // (dp_replicate * cp)
        if dp_shard < 1:
            raise ValueError(f"trainer.parallel.dp_shard must be >= 1 or -1 (all remaining ranks), got {dp_shard}")
        if dp_replicate * dp_shard * cp != num_ranks:
            raise ValueError(f"trainer.parallel: dp_replicate ({dp_replicate}) x dp_shard ({dp_shard}) x cp ({cp}) = "
                             f"{dp_replicate * dp_shard * cp}, but there are {num_ranks} trainer ranks")
        if (dp_shard * cp) % ep != 0:
            raise ValueError(f"trainer.parallel.ep ({ep}) must divide dp_shard x cp ({dp_shard * cp}): experts are "
                             f"split over ranks that also shard the dense parameters")
        return cls(dp_replicate, dp_shard, cp, ep)

    @property
    def num_ranks(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def num_data_ranks(self) -> int:
        """Ranks that receive distinct micro-batches (the cp ranks of one data rank share them)."""
        return self.dp_replicate * self.dp_shard

    def coords(self, index: int) -> tuple[int, int, int]:
        """(replicate, shard, cp) coordinates of the trainer rank at `index` (0-based among trainers)."""
        rep, rest = divmod(index, self.dp_shard * self.cp)
        shard, cp = divmod(rest, self.cp)
        return rep, shard, cp

    def data_rank(self, index: int) -> int:
        """The data rank (micro-batch stream) of the trainer at `index`."""
        rep, shard, _ = self.coords(index)
        return rep * self.dp_shard + shard

    def cp_rank(self, index: int) -> int:
        return self.coords(index)[2]


@dataclass
class TrainerMeshes:
    """The groups and meshes one trainer rank needs; built by `build_meshes`."""

    dims: ParallelDims
    index: int
    """This rank's position among the trainer ranks."""
    fsdp: DeviceMesh
    """Dense parameters: 1-D ("dp_shard_cp",) or 2-D ("dp_replicate", "dp_shard_cp") for HSDP."""
    shard_group: dist.ProcessGroup
    """The dp_shard_cp ranks of this replica: within it every parameter element lives on one rank."""
    cp_group: dist.ProcessGroup | None
    """The cp ranks of this data rank (None when cp == 1)."""
    ep: DeviceMesh | None
    """1-D ("ep",) mesh over which experts are split (None when ep == 1)."""
    expert_fsdp: DeviceMesh | None
    """FSDP mesh of the expert shards: ("dp_replicate"?, "dp_shard_mod_ep") (None when ep == 1)."""

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank(self.index)

    @property
    def data_rank(self) -> int:
        return self.dims.data_rank(self.index)


def _grid(dims: ParallelDims, trainer_ranks: list[int]) -> torch.Tensor:
    """Global ranks as a (dp_replicate, dp_shard_mod_ep, ep) grid over the flattened dp_shard_cp axis."""
    import torch

    shard_cp = dims.dp_shard * dims.cp
    return torch.tensor(trainer_ranks, dtype=torch.int64).view(dims.dp_replicate, shard_cp // dims.ep, dims.ep)


def _groups_along(grid: torch.Tensor, keep: tuple[int, ...]) -> list[list[int]]:
    """Rank lists of the sub-grids that vary the axes in `keep` and fix all others."""
    other = [d for d in range(grid.dim()) if d not in keep]
    moved = grid.permute(*other, *keep).reshape(math.prod(grid.shape[d] for d in other) if other else 1, -1)
    return [row.tolist() for row in moved]


class _GroupMaker:
    """Every rank of the world creates every group, once per distinct rank list, in one order.

    (torch requires all ranks to call new_group in the same order; non-members get a
    placeholder. Local synchronisation would avoid that, but its group names depend on how
    many groups each process already has, which differs between roles.)
    """

    def __init__(self, rank: int, timeout) -> None:
        self.rank = rank
        self.timeout = timeout
        self.made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def mine(self, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        """Create the groups of `rank_lists`; return the one this rank belongs to (None if none)."""
        found = None
        for ranks in rank_lists:
            key = tuple(ranks)
            if key not in self.made:
                import torch.distributed as dist

                self.made[key] = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                found = self.made[key]
        return found


def build_meshes(dims: ParallelDims, trainer_ranks: list[int], rank: int, device_type: str,
                 timeout=None) -> TrainerMeshes | None:
    """Create the groups of `dims` over `trainer_ranks` (global ranks, in order) and this rank's meshes.

    Called by EVERY rank of the world, in the same place of the program (group creation is
    collective); returns None on ranks that are not trainers. Groups are created in one
    order: fsdp, replicate, cp, ep, expert fsdp.
    """
    from torch.distributed.device_mesh import DeviceMesh

    assert len(trainer_ranks) == dims.num_ranks, (trainer_ranks, dims)
    make = _GroupMaker(rank, timeout)
    grid = _grid(dims, trainer_ranks)  # (R, S/ep, ep) where S = dp_shard * cp
    lists = all_rank_lists(dims, trainer_ranks)
    shard_group = make.mine(lists["dp_shard_cp"])
    # the replicate groups of dense and expert shards are the same rank lists (created once)
    rep_group = make.mine(lists["dp_replicate"]) if dims.dp_replicate > 1 else None
    cp_group = make.mine(lists["cp"]) if dims.cp > 1 else None
    ep_group = make.mine(lists["ep"]) if dims.ep > 1 else None
    mod_group = make.mine(lists["dp_shard_mod_ep"]) if dims.ep > 1 else None
    if rank not in trainer_ranks:
        return None

    index = trainer_ranks.index(rank)
    if rep_group is None:
        fsdp = DeviceMesh.from_group(shard_group, device_type, mesh_dim_names=("dp_shard_cp",))
    else:
        fsdp = DeviceMesh.from_group([rep_group, shard_group], device_type, mesh=grid.flatten(1),
                                     mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    ep_mesh = expert_fsdp = None
    if ep_group is not None:
        ep_mesh = DeviceMesh.from_group(ep_group, device_type, mesh_dim_names=("ep",))
        if rep_group is None:
            expert_fsdp = DeviceMesh.from_group(mod_group, device_type, mesh_dim_names=("dp_shard_mod_ep",))
        else:
            plane = grid[:, :, index % dims.ep]  # (R, S/ep): the ranks holding the same experts
            expert_fsdp = DeviceMesh.from_group([rep_group, mod_group], device_type, mesh=plane,
                                                mesh_dim_names=("dp_replicate", "dp_shard_mod_ep"))
    return TrainerMeshes(dims=dims, index=index, fsdp=fsdp, shard_group=shard_group, cp_group=cp_group, ep=ep_mesh,
                        expert_fsdp=expert_fsdp)


def all_rank_lists(dims: ParallelDims, trainer_ranks: list[int]) -> dict[str, list[list[int]]]:
    """Every group `build_meshes` may create, by purpose (for tests and the docs)."""
    import torch

    grid = _grid(dims, trainer_ranks)
    rep_grid = grid.flatten(1)
    cp_grid = torch.tensor(trainer_ranks).view(dims.dp_replicate, dims.dp_shard, dims.cp)
    return {
        "dp_shard_cp": _groups_along(rep_grid, (1,)),
        "dp_replicate": _groups_along(rep_grid, (0,)),
        "cp": _groups_along(cp_grid, (2,)),
        "ep": _groups_along(grid, (2,)),
        "dp_shard_mod_ep": _groups_along(grid, (1,)),
    }


