"""Apply parallelism to a model on the trainer mesh: one function and one order for every family.

    expert parallel -> context parallel -> activation checkpointing -> torch.compile -> FSDP2

- Expert parallel (ep > 1): experts are split over the `ep` mesh and tokens travel to them by
  all-to-all (parallel/expert_parallel.py). It goes first because it changes which expert
  weights a rank holds, which FSDP2 then shards.
- Context parallel (cp > 1) changes no module: every family computes attention through an
  `AttentionContext`, and the trainer hands the model a context-parallel one together with
  its piece of each packed row (parallel/context_parallel.py). Positions are explicit, so
  RoPE needs nothing either. The stage only checks that the model follows that contract.
- Activation checkpointing wraps each block's `forward` in place (module names, state-dict
  keys and FSDP units stay exactly as they were): "full" recomputes the whole block,
  `every = N` only every N-th block, "selective" keeps matmul and attention outputs and
  recomputes the cheap element-wise ops (norms, activations, RoPE) in backward.
- torch.compile compiles each block separately (a block's code is shared by all blocks, so
  it compiles once); layer indices are not specialised on.
- FSDP2 last: expert shards on their own mesh, then every block, then the root. Parameters
  stay fp32 and compute runs in `compute_dtype` (bf16 on GPU); gradients are reduced in fp32
  and summed, not averaged (divide factor 1, see parallel/dims.py). With `dp_replicate > 1`
  the mesh is 2-D and FSDP2 runs HSDP (shard inside a replica group, all-reduce across).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from meshrl.models.common.lora import LoRALinear, merge_weight
from meshrl.parallel.dims import TrainerMeshes


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model (its `layers` container), in order."""
    blocks = getattr(model, "layers", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no `layers` container of blocks to parallelize")
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def parallelize(model: nn.Module, meshes: TrainerMeshes | DeviceMesh, compute_dtype: torch.dtype,
                ac: str = "none", ac_every: int = 1, compile: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply EP -> CP -> AC -> compile -> FSDP2 to `model` in place and return it.

    `meshes` is a `TrainerMeshes` (from parallel.dims.build_meshes) or, for plain FSDP2, a 1-D
    DeviceMesh. `ac` is "none" | "full" | "selective"; with "full", `ac_every = N` checkpoints
    every N-th block only. `reshard_after_forward` false keeps every block's gathered weights from
    its forward to its backward (`ParallelConfig.reshard_after_forward`).
    """
    if isinstance(meshes, DeviceMesh):
        fsdp_mesh, ep_mesh, expert_mesh, cp = meshes, None, None, 1
    else:
        fsdp_mesh, ep_mesh, expert_mesh, cp = meshes.fsdp, meshes.ep, meshes.expert_fsdp, meshes.dims.cp
    blocks = blocks_of(model)

    if ep_mesh is not None:
        from meshrl.parallel.expert_parallel import apply_expert_parallel, expert_modules

        if not expert_modules(model):
            raise ValueError(f"trainer.parallel.ep = {ep_mesh.size()} but {type(model).__name__} has no experts "
                             f"(expert parallelism needs a MoE model)")
        apply_expert_parallel(model, ep_mesh)
    if cp > 1 and not hasattr(model, "hidden"):
        raise ValueError(f"context parallelism needs a model that takes an AttentionContext; "
                         f"{type(model).__name__} does not")
    apply_activation_checkpointing(blocks, ac, ac_every)
    if compile:
        apply_compile(blocks)
    apply_fsdp(model, blocks, fsdp_mesh, expert_mesh, compute_dtype, reshard_after_forward)
    return model


# ------------------------------------------------------------------------- activation checkpointing


def _selective_policy():
    """Save the outputs of matmuls and attention kernels; recompute everything else."""
    from torch.utils import checkpoint as ac
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # Profiler range markers are bookkeeping, not computation, and collectives (expert-parallel
    # all-to-all) emit a different number of them in forward and in recomputation, which the
    # op-by-op matching of selective checkpointing would reject.
    ignored = getattr(ac, "SAC_IGNORED_OPS", None)
    if isinstance(ignored, set):
        for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
            packet = getattr(torch.ops.profiler, name, None)
            for overload in (getattr(packet, "default", None), getattr(packet, "_RecordFunction", None)):
                if overload is not None:
                    ignored.add(overload)

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm")
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every: int = 1) -> None:
    """Wrap the forward of the chosen blocks in torch.utils.checkpoint (non-reentrant)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be none, full or selective, got {mode!r}")
    if every < 1:
        raise ValueError(f"activation checkpointing `every` must be >= 1, got {every}")
    context_fn = _selective_policy() if mode == "selective" else None
    for i, block in enumerate(blocks):
        if mode == "full" and i % every != 0:
            continue
        inner = block.forward
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}

        def forward(*args, _inner=inner, _kw=kwargs, **fkwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **_kw, **fkwargs)

        block.forward = forward  # an instance attribute: names, hooks and FSDP units are untouched


# ------------------------------------------------------------------------- compile


def apply_compile(blocks: list[nn.Module]) -> None:
    """torch.compile every block. Layer ids are module ints: do not specialise (one graph for all)."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # MoE blocks read expert row counts on the host (the CPU expert loop's split, EP's all-to-all
    # sizes): traced as unbacked ints instead of a graph break, which under activation
    # checkpointing would run the whole block eagerly.
    torch._dynamo.config.capture_scalar_outputs = True
    # Attention contexts cache their mask on the first layer's call (a Python side effect). Under
    # activation checkpointing dynamo would graph-break on it; replaying it in the recompute is
    # unnecessary (the cache is already filled), so let dynamo skip that replay.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    limit = max(torch._dynamo.config.cache_size_limit, 16)
    torch._dynamo.config.cache_size_limit = limit
    for block in blocks:
        block.compile()


# ------------------------------------------------------------------------- FSDP2


def _set_sum(module: FSDPModule) -> None:
    # Gradients are summed over data-parallel ranks; losses carry the global normalisation.
    # Force plain SUM collectives: a divide factor alone makes FSDP use PREMUL_SUM, which gloo
    # lacks (and NCCL only does zero-copy for plain sums).
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, expert_mesh: DeviceMesh | None,
               compute_dtype: torch.dtype, reshard_after_forward: bool = True) -> None:
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if expert_mesh is not None:
        from meshrl.parallel.expert_parallel import expert_modules

        for experts in expert_modules(model):
            _set_sum(fully_shard(experts, mesh=expert_mesh, mp_policy=mp))
    for i, block in enumerate(blocks):
        # the last block is needed again right away by backward: keep it unsharded
        _set_sum(fully_shard(block, mesh=mesh, mp_policy=mp,
                             reshard_after_forward=reshard_after_forward and i < len(blocks) - 1))
    _set_sum(fully_shard(model, mesh=mesh, mp_policy=mp))


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights. A forward without a backward (no-grad evaluation)
    leaves the units that are not resharded after forward (`reshard_after_forward`, the last block,
    the root) gathered; an optimizer step would then update only the shards under them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full parameter) in `named_parameters` order; a collective on the trainer mesh.

    A LoRA linear yields its merged weight under the base weight's name and no adapter tensors
    (models/common/lora.py): the names and shapes are those of `lora.policy_parameters`, the model
    the engines and an HF export hold.

    Every trainer rank must iterate to the end (each DTensor's all-gather involves them all).
    Expert shards split by expert parallelism are gathered over the ep group as well. A DTensor
    on a one-rank mesh holds all of itself: its local tensor is yielded without a collective or a
    DTensor dispatch (a colocated trainer on one GPU). The modules are walked once, not once per
    parameter: at the 0.6B shape this iteration takes a few ms instead of ~40-60 ms (CPU, measured).
    """
    from meshrl.parallel.expert_parallel import gather_expert_shards

    one_rank: dict[int, bool] = {}  # id(mesh) -> whether it has one rank
    seen: set[int] = set()
    for prefix, module in model.named_modules():  # the order named_parameters() walks
        ep_group = getattr(module, "ep_group", None)
        if isinstance(module, LoRALinear):
            yield from _merged(prefix, module, one_rank)
            continue
        for pname, param in module._parameters.items():  # noqa: SLF001 - what named_parameters reads
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            t = _full(param, one_rank)
            yield (f"{prefix}.{pname}" if prefix else pname), (t if ep_group is None else
                                                                gather_expert_shards(t, group=ep_group))


def _merged(prefix: str, module: LoRALinear, one_rank: dict[int, bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA linear as the policy sees it: the merged weight (models/common/lora.py), its bias."""
    full = {name: _full(p, one_rank) for name, p in module._parameters.items() if p is not None}  # noqa: SLF001
    yield f"{prefix}.weight", merge_weight(full["weight"], full["lora_a"], full["lora_b"], module.lora_scale)
    if "bias" in full:
        yield f"{prefix}.bias", full["bias"]


def full_adapters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (full lora_a, full lora_b)} of every LoRA linear, detached; a collective on
    the trainer mesh like `full_tensors` (every trainer rank calls it)."""
    one_rank: dict[int, bool] = {}
    return {path: (_full(m.lora_a, one_rank), _full(m.lora_b, one_rank))
            for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def _full(param: torch.Tensor, one_rank: dict[int, bool]) -> torch.Tensor:
    """The full value of one (possibly FSDP-sharded) parameter, detached."""
    if not isinstance(param, DTensor):
        return param.detach()
    mesh = param.device_mesh
    if id(mesh) not in one_rank:
        one_rank[id(mesh)] = mesh.size() == 1
    local = param._local_tensor  # noqa: SLF001 - read only: avoids a DTensor dispatch per parameter
    if one_rank[id(mesh)] and local.shape == param.shape:
        return local.detach()
    return param.detach().full_tensor()


def full_shape(model: nn.Module, name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of a parameter: DTensor.shape is global over FSDP, and expert shards
    split by expert parallelism count all `num_global_experts` in their first dim."""
    shape = tuple(param.shape)
    module = model.get_submodule(name.rpartition(".")[0])
    if getattr(module, "ep_group", None) is not None:
        shape = (module.num_global_experts, *shape[1:])
    return shape


def clip_grad_norm_(model: nn.Module, max_norm: float, shard_group: torch.distributed.ProcessGroup | None) -> float:
    """Clip all gradients to a global L2 norm of `max_norm`; returns the norm before clipping.

    Within one data-parallel replica every element of every parameter lives on exactly one rank
    of the `dp_shard_cp` group: dense parameters are FSDP shards over it, and experts are split
    over `ep` and sharded over `dp_shard_mod_ep`, which together are the same ranks. So the
    squared norm is a sum of local shards' squares, all-reduced once over that group, whatever
    mix of meshes the parameters live on (torch's clip_grad_norm_ wants one mesh).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    # One multi-tensor kernel per (device, dtype) group for the norms and one for the rescale (the
    # loop of pow / sum / mul_ per parameter it replaces launched ~4 kernels per parameter).
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if local:
        squares = torch.nn.utils.get_total_norm(local, 2.0).float().square()
    if shard_group is not None and torch.distributed.get_world_size(shard_group) > 1:
        torch.distributed.all_reduce(squares, group=shard_group)
    norm = float(squares.sqrt())
    scale = min(1.0, max_norm / (norm + 1e-6))  # a non-finite norm leaves the gradients as they are
    if local and scale < 1.0:
        for group in _by_device_and_dtype(local):
            torch._foreach_mul_(group, scale)
    return norm


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
