"""Tensor parallelism inside an inference replica (Megatron-style, plain local tensors).

An engine replica of N ranks holds 1/N of every attention and FFN matrix of a dense model,
as the family's `PARALLEL_PLAN["tp"]` says:

    x (B, T, dim), the same on every rank
      -> wq, wk, wv   colwise: rank r keeps output features [r*n/N, (r+1)*n/N), i.e. its
                      n_heads/N query heads and n_kv_heads/N kv heads
      -> q_norm, k_norm, RoPE, attention over the local heads (the engine's KV cache holds them)
      -> wo           rowwise: rank r keeps input features [r*n/N, (r+1)*n/N), the ones its heads
                      produced, and computes a partial sum of the output ...
      -> all-reduce(sum) over the group: the full (B, T, dim) on every rank
    and the same for the SwiGLU FFN (w1, w3 colwise, w2 rowwise): two all-reduces per block.

The embedding, the norms (q_norm/k_norm act on one head and are shared by all heads), RoPE and
the LM head stay replicated, so every rank computes the full logits and samples the same way
(the engine still broadcasts the first rank's samples: runtime/engine/native.py `_to_host`).

Heads. The attention modules reshape with -1 heads, so they run on whatever the local
projections hold. GQA keeps its grouping: query head h reads kv head h // (n_heads/n_kv_heads),
and both are split in contiguous ranges of the same proportion, so a rank's query heads read
exactly its kv heads.

Why plain tensors and not DTensor: the engine copies new weights into the parameters in place
and its CUDA graphs capture reads of those very storages; a sharded Linear here is an
nn.Linear subclass whose weight is the local slice, and the rowwise one calls dist.all_reduce on
its output (captured into the graph and replayed on NCCL like any kernel). Parameter names do not
change (`layers.0.attention.wq.weight`), so weight sync and state dicts see the same keys.

Weight sync (runtime/weight_sync.py) keeps broadcasting full tensors: `full_shape` gives the
bucket plan the trainer uses and `local_slice` picks this rank's part of each received tensor.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.parallel.parallelize import full_shape as _unsharded_shape

__all__ = ["ColwiseLinear", "RowwiseLinear", "check_tensor_parallel", "full_shape", "local_slice",
           "shard_for_inference"]

Style = Literal["colwise", "rowwise"]


class _ShardedLinear(nn.Linear):
    """An nn.Linear holding rank `tp_rank`'s contiguous 1/`tp_size` of `source` along `shard_dims`."""

    # parameter name -> the dim it is split along (a parameter not named here is replicated)
    shard_dims: dict[str, int] = {}

    def __init__(self, source: nn.Linear, group: dist.ProcessGroup, rank: int, size: int) -> None:
        weight = source.weight.detach()
        dim = self.shard_dims["weight"]
        local = weight.shape[dim] // size
        in_features = local if dim == 1 else source.in_features
        out_features = local if dim == 0 else source.out_features
        super().__init__(in_features, out_features, bias=source.bias is not None, device="meta", dtype=weight.dtype)
        self.tp_group = group
        self.tp_rank = rank
        self.tp_size = size
        for name, param in source.named_parameters(recurse=False):
            setattr(self, name, nn.Parameter(self.take(name, param.detach()), requires_grad=param.requires_grad))

    def take(self, name: str, full: Tensor) -> Tensor:
        """This rank's part of the full parameter `name` (a copy, contiguous)."""
        dim = self.shard_dims.get(name)
        if dim is None:
            return full.clone()
        local = full.shape[dim] // self.tp_size
        return full.narrow(dim, self.tp_rank * local, local).clone(memory_format=torch.contiguous_format)

    def local_view(self, name: str, full: Tensor) -> Tensor:
        """This rank's part of the full parameter `name`, as a view of `full`."""
        dim = self.shard_dims.get(name)
        if dim is None:
            return full
        local = full.shape[dim] // self.tp_size
        return full.narrow(dim, self.tp_rank * local, local)

    def full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(getattr(self, name).shape)
        dim = self.shard_dims.get(name)
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)


class ColwiseLinear(_ShardedLinear):
    """Output features [r*n/N, (r+1)*n/N): (..., in) -> this rank's slice (..., out/N) of the output."""

    shard_dims = {"weight": 0, "bias": 0}


class RowwiseLinear(_ShardedLinear):
    """Input features [r*n/N, (r+1)*n/N): (..., in/N) -> partial sums, all-reduced to the full (..., out)."""

    shard_dims = {"weight": 1}

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp_group)
        return out if self.bias is None else out + self.bias  # the bias once, after the sum


_SHARDED: dict[str, type[_ShardedLinear]] = {"colwise": ColwiseLinear, "rowwise": RowwiseLinear}


def _matches(pattern: str, path: str) -> bool:
    """A plan path against a module path; "*" matches exactly one component."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def check_tensor_parallel(model: nn.Module, size: int) -> dict[str, Style]:
    """Which Linear of `model` to split how for a tensor-parallel degree `size`: {module path: style}.

    Raises ValueError naming the problem when the model cannot be split `size` ways: a family
    without a tensor-parallel plan (MoE, the generic HF wrapper), or query heads, kv heads or the
    FFN width not divisible by `size`. Works on a meta-device model (no storage needed).
    """
    from meshrl.models import MODEL_FAMILIES

    args = getattr(model, "args", None)
    family = next((f for f in MODEL_FAMILIES.values() if isinstance(args, f.args_cls)), None)
    label = family.name if family is not None else type(model).__name__
    if family is None or not family.parallel_plan.get("tp") or "ep" in family.parallel_plan:
        raise ValueError(f"inference.tensor_parallel = {size}: the {label} model has no tensor-parallel plan "
                         "for inference; it is implemented for the dense families qwen3 and llama only "
                         "(use more inference ranks with tensor_parallel = 1 instead)")
    for what, count in (("attention heads", args.n_heads), ("kv heads", args.n_kv_heads),
                        ("FFN width (hidden_dim)", args.hidden_dim)):
        if count % size:
            raise ValueError(f"inference.tensor_parallel = {size} must divide the {label} model's {what} ({count})")
    plan: dict[str, Style] = {}
    for path, module in model.named_modules():
        style = next((s for p, s in family.parallel_plan["tp"].items() if _matches(p, path)), None)
        if style is None:
            continue
        if style not in _SHARDED or type(module) is not nn.Linear:
            raise ValueError(f"tensor parallel plan of {label}: {path} is a {type(module).__name__} with style "
                             f"{style!r}; only plain nn.Linear modules split 'colwise' or 'rowwise' are supported")
        split = module.out_features if style == "colwise" else module.in_features
        assert split % size == 0, f"{path}: {split} features do not split {size} ways"
        plan[path] = style
    if not plan:
        raise ValueError(f"tensor parallel plan of {label} matches no module of the model")
    return plan


def shard_for_inference(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Shard `model` in place for this rank's position in `group`; returns it.

    Every Linear the family's plan names is replaced by a `ColwiseLinear` / `RowwiseLinear`
    holding this rank's slice (same parameter names); everything else stays replicated. Works on
    a meta-device model too (materialise with `to_empty` afterwards). ValueError: see
    `check_tensor_parallel`.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for path, style in check_tensor_parallel(model, size).items():
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, _SHARDED[style](getattr(owner, child), group, rank, size))
    return model


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def full_shape(model: nn.Module, name: str, param: Tensor) -> tuple[int, ...]:
    """The unsharded shape of parameter `name` (tensor-parallel slices, and whatever
    parallel.parallelize.full_shape knows: FSDP DTensors, expert-parallel shards)."""
    module, leaf = _owner(model, name)
    if isinstance(module, _ShardedLinear):
        return module.full_shape(leaf)
    return _unsharded_shape(model, name, param)


def local_slice(model: nn.Module, name: str, full: Tensor) -> Tensor:
    """This rank's part of the full (unsharded) tensor of parameter `name`, as a view of `full`;
    `full` itself for a parameter that is not tensor-parallel."""
    module, leaf = _owner(model, name)
    if isinstance(module, _ShardedLinear):
        return module.local_view(leaf, full)
    return full
