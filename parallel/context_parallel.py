"""Context parallelism: one long packed row split over the `cp` ranks of the trainer mesh.

A packed micro-batch is a single row (1, T) (runtime/train/packing.py). With context parallelism
each of the `cp` ranks of a group runs the model on T / cp of its tokens, and attention is
made exact by letting every local query see the keys and values of the whole row:

    1. `pad_for_cp` right-pads the row to a multiple of 2 * cp (padding carries no loss);
    2. `cp_split` keeps this rank's tokens and their global indices in the row;
    3. the model runs on the local tokens with a `ContextParallelAttention` context, which
       all-gathers k and v of every layer over the cp group and masks with the global indices:
       local query i may attend key j iff global(j) <= global(i) and doc(i) == doc(j).

Everything outside attention is per token (embeddings, norms, MLPs, the LM head and the
logprob of a token's target), so it needs no communication. RoPE is per token too: a packed
row carries explicit `position_ids` (each document restarts at 0), so a token's rotation
depends on its own position id only, never on where it sits in the local slice; splitting the
position ids with the tokens is therefore exact, and k arrives at the other ranks already rotated.

Load balance. Under a causal mask query t does work proportional to t + 1, so contiguous
slices would give the last rank most of the work. `cp_split` cuts the row into 2 * cp equal
chunks and rank r keeps chunks r and 2 * cp - 1 - r: every rank holds one early and one late
chunk, and the sums of (t + 1) over the ranks' tokens are exactly equal. (Document masking
removes work unevenly, so with short documents the balance is approximate.)

Gradients. Each rank's loss is its local loss tokens' sum divided by the step's global
loss-token count (the repository's convention), the all-gather's backward sums every rank's
k/v gradients back to their owner, and parameter gradients summed over the cp ranks equal the
single-process gradient of the whole row. In the trainer the cp axis is therefore treated like
a data-parallel axis for gradient reduction (FSDP with divide factor 1 over dp_shard x cp).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor

from meshrl.models.common.attention import attention_with_sinks, selected

__all__ = ["cp_local_index", "pad_for_cp", "cp_split", "ContextParallelAttention"]

# Padding values of the packed-row fields that must not be 0; every other field pads with 0.
# doc_ids is handled separately (a new id, see `pad_for_cp`).
_PAD_VALUES = {"loss_mask": False, "sample_ids": -1}


def _row_length(mb: Mapping[str, Tensor]) -> int:
    """T of a micro-batch whose fields are all (1, T); ValueError otherwise."""
    lengths = set()
    for key, value in mb.items():
        if not isinstance(value, Tensor) or value.dim() != 2 or value.shape[0] != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"context parallelism needs (1, T) tensor fields, got {key!r} of shape {shape}")
        lengths.add(value.shape[1])
    if len(lengths) != 1:
        raise ValueError(f"micro-batch fields have different lengths {sorted(lengths)}")
    return lengths.pop()


def _rebuild(mb: Mapping[str, Tensor], fields: dict[str, Tensor]) -> Mapping[str, Tensor]:
    """`fields` in the container type of `mb` (TensorDict with batch_size (1, T'), or dict)."""
    if isinstance(mb, TensorDict):
        length = next(iter(fields.values())).shape[1]
        return TensorDict(fields, batch_size=[1, length], device=mb.device)
    return fields


def pad_for_cp(mb: Mapping[str, Tensor], cp_size: int, pad_id: int = 0) -> Mapping[str, Tensor]:
    """Right-pad every (1, T) field to the next multiple of 2 * cp_size (unchanged if T already is).

    Padding tokens are inert: `input_ids` = pad_id, `position_ids` = 0, `targets` = 0,
    `loss_mask` = False, `sample_ids` = -1, other fields 0, and `doc_ids` = one new id
    (max real id + 1) for the whole tail. The tail sits after every real token and is its own
    document, so under document-causal attention no real token sees it and the real tokens'
    outputs are exactly those of the unpadded row; the pad tokens attend causally among
    themselves (the diagonal is always allowed, so no softmax row is empty).
    Returns the same container type (dict or TensorDict).
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    length = _row_length(mb)
    multiple = 2 * cp_size
    num_pad = -length % multiple
    if num_pad == 0:
        return mb
    fields = {}
    for key, value in mb.items():
        if key == "doc_ids":
            fill = int(value.max()) + 1
        elif key == "input_ids":
            fill = pad_id
        else:
            fill = _PAD_VALUES.get(key, 0)
        pad = torch.full((1, num_pad), fill, dtype=value.dtype, device=value.device)
        fields[key] = torch.cat([value, pad], dim=1)
    return _rebuild(mb, fields)


def cp_local_index(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """Global indices (T / cp,) int64, ascending, of the tokens rank `cp_rank` keeps.

    The row is cut into 2 * cp_size equal chunks; the rank keeps chunks cp_rank and
    2 * cp_size - 1 - cp_rank (see the module docstring for why).
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"row length {seq_len} is not a multiple of 2 * cp_size = {2 * cp_size}; "
                         "pad it with pad_for_cp first")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def cp_split(mb: Mapping[str, Tensor], cp_rank: int, cp_size: int) -> tuple[Mapping[str, Tensor], Tensor]:
    """This rank's share of a (1, T) micro-batch.

    Returns (local micro-batch with every field (1, T / cp) in the input's container type,
    local_index (T / cp,) int64: the global positions in the row of the local tokens, ascending).
    T must be a multiple of 2 * cp_size (`pad_for_cp`). Concatenating all ranks' pieces and
    sorting by their local_index reproduces the row.
    """
    index = cp_local_index(_row_length(mb), cp_rank, cp_size)
    fields = {key: value[:, index.to(value.device)] for key, value in mb.items()}
    return _rebuild(mb, fields), index


def _all_gather_stacked(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """x gathered from every rank of `group` into a new leading dim: (cp, *x.shape), rank order."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group), *x.shape))
    dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """All-gather x over a group into a new leading dim (cp, *x.shape); backward sums every
    rank's gradient of the gathered tensor and hands each rank the slice of its own x.

    NCCL (and other device backends) reduce-scatter directly; gloo has no reduce-scatter, so
    on the CPU the gradient is all-reduced and sliced (cp times the traffic, fine for tests).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _all_gather_stacked(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        if grad.device.type == "cpu":
            # A copy: the all-reduce is in place and autograd may still hold the incoming buffer.
            summed = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(summed, group=ctx.group)
            return summed[dist.get_rank(ctx.group)].clone(), None
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class ContextParallelAttention:
    """Exact document-causal attention for a row split by `cp_split` (an AttentionContext).

    Args:
        doc_ids_full: (1, T) int64, the document ids of the whole (padded) row.
        local_index: (T_local,) int64, the global indices of this rank's tokens (from `cp_split`).
        group: the cp process group (None = the default group); every rank of it calls `attend`
            for the same layers in the same order, with the same T_local.

    `attend(layer_id, q, k, v)` takes the local q (1, Hq, T_local, D) and k, v (1, Hkv, T_local, D)
    (v may have a head dim of its own: MLA), all-gathers k and v (un-repeated, in one collective) and attends the local queries against all
    T keys. The gathered keys stay in rank order rather than being permuted into row order: the
    mask is built in that order instead (SDPA does not care about key order), which saves a copy
    of the full K/V and its backward per layer. On the first call the ranks exchange their
    local indices once and the (1, 1, T_local, T) boolean mask is built; later layers reuse it.

    Memory: every layer keeps the full row's K and V (2 * Hkv * T * D values, plus the GQA repeat)
    alive for backward on every rank, and the mask costs T_local * T bytes. That is fine up to
    rows of a few tens of thousands of tokens; a ring variant (pass K/V blocks around the ring
    and merge partial softmaxes) would keep only T_local keys resident at a time.
    """

    def __init__(self, doc_ids_full: Tensor, local_index: Tensor, group: dist.ProcessGroup | None = None) -> None:
        if doc_ids_full.dim() != 2 or doc_ids_full.shape[0] != 1:
            raise ValueError(f"doc_ids_full must be (1, T), got {tuple(doc_ids_full.shape)}")
        if local_index.dim() != 1:
            raise ValueError(f"local_index must be (T_local,), got {tuple(local_index.shape)}")
        self.doc_ids_full = doc_ids_full  # (1, T)
        self.local_index = local_index  # (T_local,)
        self.group = group
        self._mask: Tensor | None = None
        self._key_index: Tensor | None = None
        self._windowed: dict[int, Tensor] = {}  # window -> mask & sliding window

    def mask(self, device: torch.device) -> Tensor:
        """(1, 1, T_local, T) bool over (local queries, gathered keys in rank order); a collective
        on the first call (the ranks' local indices are all-gathered)."""
        if self._mask is None:
            local = self.local_index.to(device)
            key_index = _all_gather_stacked(local, self.group).reshape(-1)  # (T,) keys in gathered order
            T = self.doc_ids_full.shape[1]
            assert key_index.numel() == T and torch.equal(key_index.sort().values, torch.arange(T, device=device)), \
                "the cp ranks' local indices must partition the row"
            doc = self.doc_ids_full[0].to(device)  # (T,)
            causal = key_index[None, :] <= local[:, None]  # (T_local, T)
            same_doc = doc[local][:, None] == doc[key_index][None, :]  # (T_local, T)
            self._mask = (causal & same_doc)[None, None]
            self._key_index = key_index
        return self._mask

    def windowed_mask(self, device: torch.device, window: int) -> Tensor:
        """`mask` and q - window < k (row distance: documents are contiguous), cached per window."""
        if window not in self._windowed:
            mask = self.mask(device)
            diff = self.local_index.to(device)[:, None] - self._key_index[None, :]  # (T_local, T)
            self._windowed[window] = mask & (diff < window)[None, None]
        return self._windowed[window]

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        """Also takes the contract's sliding `window`, `sinks` and sparse `index` / `keep`
        (models/common/attention.py); index keys are gathered like the keys (no gradient)."""
        B, num_q_heads, T_local, D = q.shape
        assert B == 1 and T_local == self.local_index.numel(), \
            f"q {tuple(q.shape)} does not match one row of {self.local_index.numel()} local tokens"
        # One gather of [k, v] along the head dim (MLA's v is narrower than its q/k).
        kv = _GatherTokens.apply(torch.cat([k, v], dim=-1), self.group)  # (cp, 1, Hkv, T_local, Dk + Dv)
        # (cp, 1, Hkv, T_local, Dk + Dv) -> (1, Hkv, cp * T_local, Dk + Dv): keys in rank order.
        kv = kv.permute(1, 2, 0, 3, 4).reshape(1, k.shape[1], -1, k.shape[-1] + v.shape[-1])
        k_all, v_all = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        mask = self.mask(q.device) if window is None else self.windowed_mask(q.device, window)
        if index is not None or keep is not None:
            index_keys = None
            if index is not None:
                with torch.no_grad():  # (cp, 1, T_local, Di) -> (1, T, Di), rank order like the keys
                    index_keys = _all_gather_stacked(index[0].contiguous(), self.group)
                    index_keys = index_keys.permute(1, 0, 2, 3).reshape(1, -1, index[0].shape[-1])
            mask = selected(mask[:, 0], index_keys, index, keep)
        if sinks is not None:
            return attention_with_sinks(q, k_all, v_all, mask, sinks)
        # Repeat after the gather so only the Hkv heads travel; explicit repeat rather than
        # enable_gqa for the same reason as DocumentCausalAttention (masked CUDA kernel).
        n_rep = num_q_heads // k.shape[1]
        if n_rep > 1:
            k_all = k_all.repeat_interleave(n_rep, dim=1)
            v_all = v_all.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
