"""Roles, devices, process groups and meshes of one job.

    world ranks --assign_roles()--> controller (1, CPU only) | trainers (T) | inference (I)

`assign_roles` is a pure function of (world size, layout, controller rank). Inference ranks
come in replicas of `tensor_parallel` consecutive ranks, each replica one engine; its first rank
(the replica's leader) is the one the controller load-balances over and hears completions from.
The controller
is the process past the node's GPUs (on CPU: the last local rank), found by an all-gather
of a flag, because which torchrun agent gets which global ranks is decided by the
rendezvous, not by us.

Process groups (every rank creates all of them, in the same order, as torch requires):
- the default group: gloo on CPU, "cpu:gloo,cuda:nccl" on GPU;
- `trainer`: the trainer ranks (statistics, barriers); their FSDP/CP/EP groups and meshes
  come from parallel.dims.build_meshes, created by the trainer ranks alone;
- `inference`: the inference ranks, a DeviceMesh with the axis "replica" (tensor_parallel 1), or
  ("replica", "tp") with one group per tp position across replicas and one per replica;
- per replica with tensor_parallel > 1: `tp` (NCCL on GPU: the model's all-reduces and the
  engine's per-step sample broadcast) and `tp_control` (gloo: the leader tells the others how many
  controller messages to apply before each engine step; see runtime/engine/loop.py);
- `sync`: trainer rank 0 + all inference ranks, for the weight broadcast (NCCL on GPU);
- `kv` (inference.prefill_ranks > 0 only): all inference ranks, for the KV blocks a prefill replica
  sends a decode replica point to point (NCCL on GPU, gloo on CPU; runtime/engine/disagg.py);
- `down[r]` / `up[r]`: a gloo pair (controller, r) per direction for control messages, so
  that a receiving thread and a sending thread never share a group.

Colocated layout (`resolve_colocation`): trainer k and inference rank k share device k (local
ranks k and N + k of the node; the controller is local rank 2N, on the CPU). There is no `sync`
group (NCCL refuses two ranks of one communicator on one device); instead each pair gets two gloo
groups, `to_peer` / `from_peer` as seen from each side, for runtime/weight_sync.py's colocated path.

torch has no DeviceMesh over an uneven split of one world, so `Layout` holds the two
sub-meshes side by side; their ranks are global ranks of the one job.
"""

from __future__ import annotations

import datetime
import os
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshrl.parallel.dims import ParallelDims, TrainerMeshes, build_meshes

CONTROLLER, TRAINER, INFERENCE = "controller", "trainer", "inference"


@dataclass(frozen=True)
class Roles:
    """Which global rank plays which role."""

    world_size: int
    controller: int
    trainers: tuple[int, ...]
    inference: tuple[int, ...]
    tensor_parallel: int = 1
    colocated: bool = False
    prefill_replicas: int = 0  # inference.prefill_ranks: the first K replicas only prefill

    @property
    def prefill_engines(self) -> tuple[int, ...]:
        """Prefill/decode disaggregation: the first rank of every prefill-only replica (none without it)."""
        return self.engines[:self.prefill_replicas]

    @property
    def decode_engines(self) -> tuple[int, ...]:
        """The replicas that decode: every replica without disaggregation, else all but the prefill ones."""
        return self.engines[self.prefill_replicas:]

    def peer_of(self, rank: int) -> int:
        """Colocated layout: the rank sharing `rank`'s device (trainer k <-> inference rank k)."""
        assert self.colocated, "only a colocated layout pairs ranks"
        if rank in self.trainers:
            return self.inference[self.trainers.index(rank)]
        return self.trainers[self.inference.index(rank)]

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The inference ranks of each engine replica: `tensor_parallel` consecutive ones."""
        n = self.tensor_parallel
        return tuple(self.inference[i:i + n] for i in range(0, len(self.inference), n))

    @property
    def engines(self) -> tuple[int, ...]:
        """The first rank of every replica: where the controller sends work and hears completions from."""
        return tuple(replica[0] for replica in self.replicas)

    def replica_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of the replica that inference rank `rank` belongs to."""
        return next(replica for replica in self.replicas if rank in replica)

    def role_of(self, rank: int) -> str:
        if rank == self.controller:
            return CONTROLLER
        if rank in self.trainers:
            return TRAINER
        if rank in self.inference:
            return INFERENCE
        raise ValueError(f"rank {rank} is outside a world of {self.world_size}")


def assign_roles(world_size: int, num_trainer_ranks: int, num_inference_ranks: int, controller: int = -1,
                 tensor_parallel: int = 1, colocated: bool = False, prefill_replicas: int = 0) -> Roles:
    """Split `world_size` ranks into one controller, trainers, then inference ranks.

    `controller` is the global rank chosen as controller (-1 = the last rank). Trainers are the
    first `num_trainer_ranks` other ranks in order, inference ranks the rest, in replicas of
    `tensor_parallel` consecutive ranks; with `prefill_replicas` = K (inference.prefill_ranks) the
    first K replicas prefill only and the others decode.
    """
    needed = 1 + num_trainer_ranks + num_inference_ranks
    if world_size != needed:
        raise ValueError(
            f"the layout needs {needed} ranks (1 controller + {num_trainer_ranks} trainer + "
            f"{num_inference_ranks} inference) but the job has {world_size}"
        )
    if tensor_parallel < 1 or num_inference_ranks % tensor_parallel:
        raise ValueError(f"layout.num_inference_ranks ({num_inference_ranks}) must be a multiple of "
                         f"inference.tensor_parallel ({tensor_parallel})")
    controller = controller % world_size
    others = [r for r in range(world_size) if r != controller]
    return Roles(
        world_size=world_size,
        controller=controller,
        trainers=tuple(others[:num_trainer_ranks]),
        inference=tuple(others[num_trainer_ranks:]),
        tensor_parallel=tensor_parallel,
        colocated=colocated,
        prefill_replicas=prefill_replicas,
    )


def use_cuda(requested: str) -> bool:
    """Whether this job runs on GPUs: a function of the config and the node, equal on every rank."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("dist.device = 'cuda' but CUDA is not available")
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def resolve_colocation(colocate: bool | str, num_trainer_ranks: int, num_inference_ranks: int,
                       tensor_parallel: int, cuda: bool) -> bool:
    """Whether the job runs colocated: layout.colocate as set, or for "auto" on a one-node GPU job,
    whether the split layout needs more GPUs than the node has (equal on every rank of the node).
    ValueError when "auto" would have to colocate a layout that cannot be."""
    if colocate != "auto":
        return bool(colocate)
    world, local_world = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if not cuda or (world is not None and world != local_world):  # CPU, or several nodes: set it explicitly
        return False
    gpus, needed = torch.cuda.device_count(), num_trainer_ranks + num_inference_ranks
    if needed <= gpus:
        return False
    if num_inference_ranks != num_trainer_ranks or tensor_parallel != 1:
        raise ValueError(f"layout: {num_trainer_ranks} trainer + {num_inference_ranks} inference ranks need {needed} "
                         f"GPUs, this node has {gpus}; sharing them (layout.colocate) needs num_inference_ranks = "
                         "num_trainer_ranks and inference.tensor_parallel = 1")
    return True


def pick_device(cuda: bool, colocated_pairs: int | None = None) -> torch.device:
    """This process's device before roles are known: the GPU of its local rank, or the CPU.

    A process past the node's GPUs gets the CPU (it will volunteer as the controller). In a
    colocated layout of N pairs, local ranks k and N + k share GPU k, and local rank 2N is the CPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda and colocated_pairs is not None:
        if colocated_pairs > torch.cuda.device_count():
            raise ValueError(f"layout: a colocated layout of {colocated_pairs} trainer ranks needs {colocated_pairs} "
                             f"GPUs, this node has {torch.cuda.device_count()}")
        if local_rank >= 2 * colocated_pairs:
            return torch.device("cpu")
        local_rank %= colocated_pairs
    if not cuda or local_rank >= torch.cuda.device_count():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_world(cuda: bool, timeout_s: float) -> tuple[int, int]:
    """Start the default process group; returns (rank, world size).

    After an elastic restart under torchrun's shared agent store, the previous attempt's group
    keys are still in that store and the new workers would read stale peer addresses (gloo:
    "connectFullMesh ... Connection refused"). Every attempt therefore gets its own key prefix.
    That prefix is only sound with one agent: each agent counts its own restarts (one that
    restarts for another node's failure, or was started again, counts fewer), so a job of several
    agents that may restart runs without the shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    required by launch.check_world_size; rank 0 then hosts a fresh store every attempt).

    Afterwards TORCHELASTIC_RESTART_COUNT holds the job's attempt, the largest of the agents'
    counts, so that every rank (resume decision, log tags, restarts.jsonl) sees one value.
    """
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                    is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"meshrl/attempt-{attempt}", agent_store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    job_attempt = torch.tensor([attempt], dtype=torch.int64)  # a CPU tensor: gloo carries it on GPU nodes too
    dist.all_reduce(job_attempt, op=dist.ReduceOp.MAX)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(int(job_attempt))
    return dist.get_rank(), dist.get_world_size()


def find_controller(device: torch.device) -> int:
    """All ranks agree on the controller (an all-gather of each process's claim).

    The best claim is a process with no GPU of its own (the one past the node's GPUs, as the
    launchers start it); failing that, the last local rank of a node (CPU jobs, or a node with
    more GPUs than the job uses). Ties go to the lowest global rank.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    claim = 2 if device.type == "cpu" and torch.cuda.is_available() else int(local_rank == local_world - 1)
    # a CPU tensor, so the default group's gloo backend carries it even on GPU nodes
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([claim], dtype=torch.int64))
    claims = [int(t) for t in gathered]
    best = max(claims)
    if best == 0:
        raise ValueError("no process can be the controller (no node has a last local rank?)")
    return claims.index(best)


@dataclass
class Layout:
    """This process's view of the job: its role, device, groups and meshes."""

    rank: int
    roles: Roles
    device: torch.device
    trainer_group: dist.ProcessGroup | None = None
    inference_group: dist.ProcessGroup | None = None
    sync_group: dist.ProcessGroup | None = None
    trainer_meshes: TrainerMeshes | None = None
    inference_mesh: DeviceMesh | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_control: dist.ProcessGroup | None = None
    kv_group: dist.ProcessGroup | None = None  # P/D disaggregation: KV blocks between inference ranks
    to_peer: dist.ProcessGroup | None = None  # colocated layout: this rank -> the rank on its device
    from_peer: dist.ProcessGroup | None = None  # and back
    down: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    up: dict[int, dist.ProcessGroup] = field(default_factory=dict)

    @property
    def role(self) -> str:
        return self.roles.role_of(self.rank)

    @property
    def is_trainer_leader(self) -> bool:
        return self.rank == self.roles.trainers[0]

    @property
    def peer(self) -> int:
        """Colocated layout: the rank sharing this rank's device."""
        return self.roles.peer_of(self.rank)

    @property
    def is_replica_leader(self) -> bool:
        """An inference rank that speaks for its replica (every rank when tensor_parallel is 1)."""
        return self.rank in self.roles.engines


def build_layout(roles: Roles, rank: int, device: torch.device, timeout_s: float, message_timeout_s: float,
                 cuda: bool, dims: ParallelDims | None = None) -> Layout:
    """Create every group (all ranks, same order) and the sub-meshes this rank belongs to.

    `dims` are the trainer's parallel degrees (default: plain FSDP2 over all trainer ranks).

    The controller always runs on the CPU, whatever device its local rank would have had.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    idle = datetime.timedelta(seconds=message_timeout_s)
    if rank == roles.controller:
        device = torch.device("cpu")
    lay = Layout(rank=rank, roles=roles, device=device)
    trainer_group = dist.new_group(list(roles.trainers), timeout=timeout)
    inference_group = dist.new_group(list(roles.inference), timeout=timeout)
    sync_backend = "nccl" if cuda else "gloo"
    sync_group = None
    if roles.colocated:
        _check_colocated_devices(roles, rank, device)
        _build_colocated_pairs(lay, timeout)
    else:
        sync_group = dist.new_group([roles.trainers[0], *roles.inference], timeout=timeout, backend=sync_backend)
    kv_group = None
    if roles.prefill_replicas:  # only then: a job without disaggregation keeps exactly its groups
        kv_group = dist.new_group(list(roles.inference), timeout=timeout, backend=sync_backend)
    for r in (*roles.trainers, *roles.inference):
        lay.down[r] = dist.new_group([roles.controller, r], timeout=idle, backend="gloo")
        lay.up[r] = dist.new_group([roles.controller, r], timeout=idle, backend="gloo")
    tp_across = _build_tensor_parallel(lay, timeout, idle, sync_backend)
    # every rank takes part in creating the trainer's groups; only trainers get meshes
    dims = dims if dims is not None else ParallelDims.resolve(len(roles.trainers))
    lay.trainer_meshes = build_meshes(dims, list(roles.trainers), rank, device.type, timeout)
    if rank in roles.trainers:
        lay.trainer_group = trainer_group
    if rank in roles.inference:
        lay.inference_group = inference_group
        lay.kv_group = kv_group
        if tp_across is None:
            lay.inference_mesh = DeviceMesh.from_group(inference_group, device.type, mesh_dim_names=("replica",))
        else:
            lay.inference_mesh = DeviceMesh.from_group([tp_across, lay.tp_group], device.type,
                                                       mesh=torch.tensor(roles.replicas),
                                                       mesh_dim_names=("replica", "tp"))
    if rank == roles.trainers[0] or rank in roles.inference:
        lay.sync_group = sync_group
    # keep only the pair groups this rank is a member of
    if rank != roles.controller:
        lay.down = {rank: lay.down[rank]}
        lay.up = {rank: lay.up[rank]}
    return lay


def _check_colocated_devices(roles: Roles, rank: int, device: torch.device) -> None:
    """Every (trainer k, inference k) pair is on one device of one host (an all-gather of each
    rank's host and device index), or ValueError naming the pairs that are not."""
    host = zlib.crc32(os.uname().nodename.encode())  # stable across processes, unlike hash()
    me = torch.tensor([host, -1 if device.type == "cpu" else device.index], dtype=torch.int64)
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(roles.world_size)]
    dist.all_gather(gathered, me)
    where = [tuple(t.tolist()) for t in gathered]
    apart = [(t, i) for t, i in zip(roles.trainers, roles.inference) if where[t] != where[i]]
    if apart:
        raise ValueError(f"layout.colocate: trainer/inference pairs {apart} are not on one device of one host "
                         "(colocation runs on one node: local ranks k and N + k share GPU k)")


def _build_colocated_pairs(lay: Layout, timeout: datetime.timedelta) -> None:
    """Two gloo groups per (trainer k, inference k) pair, one per direction (every rank, same order)."""
    roles = lay.roles
    for t, i in zip(roles.trainers, roles.inference):
        trainer_to_engine = dist.new_group([t, i], timeout=timeout, backend="gloo")
        engine_to_trainer = dist.new_group([t, i], timeout=timeout, backend="gloo")
        if lay.rank == t:
            lay.to_peer, lay.from_peer = trainer_to_engine, engine_to_trainer
        elif lay.rank == i:
            lay.to_peer, lay.from_peer = engine_to_trainer, trainer_to_engine


def _build_tensor_parallel(lay: Layout, timeout: datetime.timedelta, idle: datetime.timedelta,
                           backend: str) -> dist.ProcessGroup | None:
    """Create the tensor-parallel groups (every rank, same order) and keep this rank's in `lay`.

    Per replica: `tp` on `backend` (NCCL on GPU) and `tp_control` on gloo, whose timeout is the
    control channels' (the followers wait on it while the replica is idle). Then, per tp position,
    the group of that position across replicas (the "replica" axis of the inference mesh); this
    rank's is returned (None without tensor parallelism, or on a rank outside the inference mesh).
    """
    roles = lay.roles
    if roles.tensor_parallel == 1:
        return None
    for replica in roles.replicas:
        tp_group = dist.new_group(list(replica), timeout=timeout, backend=backend)
        tp_control = dist.new_group(list(replica), timeout=idle, backend="gloo")
        if lay.rank in replica:
            lay.tp_group, lay.tp_control = tp_group, tp_control
    mine = None
    for position in range(roles.tensor_parallel):
        ranks = [replica[position] for replica in roles.replicas]
        group = dist.new_group(ranks, timeout=timeout)
        if lay.rank in ranks:
            mine = group
    return mine
