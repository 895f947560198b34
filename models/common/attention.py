"""The attention contract between the model definitions and whoever runs them.

A model never decides *which* tokens attend to which: it computes q, k, v per layer (with
RoPE and qk-norm already applied) and hands them to an `AttentionContext`. The trainer passes a
context for causal or packed (document-masked) training rows; the inference engine passes its
own context that writes k, v into its KV cache (one slot per sequence today, paged later)
and attends over the cached prefix. The
same model code therefore serves both, and the engine never forks the model file.

A context object lives for one forward pass. Anything derived from the batch layout (masks,
cache slots) is built on the first `attend` call and reused by every layer.

Softmax scale is always 1 / sqrt(head_dim) of q (Qwen3, Llama; MLA's q/k dim); a family that
needs another scale rescales q. v may have a head dim of its own (MLA).

Two optional keywords, passed only by the layers that use them (gpt-oss):

- `window=W`: sliding-window attention, token i sees j iff i - W < j <= i (HF's
  `kv_idx > q_idx - sliding_window`); rows are contiguous documents, so the distance in the row
  is the distance in positions;
- `sinks=s` (Hq,): attention sinks, one learned logit per query head that joins every softmax
  as a key whose value is zero (the weights of the real keys then sum to less than 1).
  `attention_with_sinks` is the exact reference every context uses for them.

Sparse attention (GLM-5's DeepSeek sparse-attention indexer) adds two more, also passed only by
the layers that use them:

- `index=(index_keys, select)`: index_keys (B, T, Di) are the new tokens' indexer keys; the
  context lays them out as it does its keys (the row, a cp gather, the engine's cache), calls
  `keep = select(all_index_keys (B, L, Di), allowed (B or 1, T, L))` once, and attends only where
  `allowed & keep` (B, T, L);
- `keep=` (B, T, L): a selection made by an earlier layer of the same forward (the same key
  layout), reused as it is.

Packed-document backends (`make_document_attention` picks one), all with the same numbers:

- "sdpa"  `DocumentCausalAttention`: SDPA with a dense (B, 1, T, T) boolean mask. Any device,
  any B; the mask costs B * T^2 bytes and the CUDA kernel computes every masked tile.
- "flex"  `FlexDocumentAttention`: FlexAttention with a block mask, skipping tiles outside the
  documents; compiled once per process. CUDA for training (no CPU backward in torch).
- "varlen"  `VarlenDocumentAttention`: torch's flash-attention varlen kernel over cumulative
  document lengths. CUDA, B == 1, contiguous documents, bf16/fp16; torch >= 2.10.
- "flash_attn"  the same with the flash-attn package's varlen function, when it is installed.
- "split"  `SplitDocumentAttention`: one causal SDPA call per document of a packed row (B == 1,
  contiguous documents), so the cost is the sum over documents of L^2, not T^2, and no mask
  exists. Any device and dtype; the CPU default (a 2048-token row of 30 short documents costs
  ~1/30 of the dense mask's attention). Falls back to the dense mask for sliding windows, sinks
  and sparse selection.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionContext(Protocol):
    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        """q (B, Hq, T, D); k, v (B, Hkv, T, D), RoPE and qk-norm already applied. Returns (B, Hq, T, Dv).
        `window` (sliding window), `sinks` (Hq,), `index` / `keep` (sparse selection) as in the
        module docstring."""
        ...


def attention_with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None = None,
                         scale: float | None = None) -> Tensor:
    """Masked attention with an fp32 softmax, optionally over one extra sink logit per query head.

    q (B, Hq, T, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv), mask (B or 1, 1, T, L) bool (True =
    attend), sinks (Hq,) -> (B, Hq, T, Dv). The sink is a key with logit sinks[h] and value 0:
    softmax over [scores, sink], then the sink's column is dropped (transformers' gpt-oss).
    Scores are materialised: (B, Hq, T, L) fp32.
    """
    B, num_q_heads, T, D = q.shape
    n_rep = num_q_heads // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (D**-0.5 if scale is None else scale)  # (B, Hq, T, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v


def selected(allowed: Tensor, index_keys: Tensor | None, index: tuple | None, keep: Tensor | None) -> Tensor:
    """The (B or 1, 1, T, L) mask of the keys a query attends to: `allowed` (B or 1, T, L), narrowed
    by a sparse-attention selection (see the module docstring) when `index` or `keep` is given;
    `index_keys` are the context's (B, L, Di) layout of the index keys."""
    if index is not None:
        keep = index[1](index_keys, allowed)
    return (allowed if keep is None else allowed & keep)[:, None]


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """(..., T, L) bool: causal (k <= q) and, with `window`, q - window < k. q_pos (..., T), k_pos (..., L)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = diff >= 0
    return allowed if window is None else allowed & (diff < window)


class OutputHead(Protocol):
    def __call__(self, hidden: Tensor, weight: Tensor) -> Any:
        """hidden (B, T, dim) final-normed states; weight (V, dim) the LM head. Returns anything.

        A model's `forward(tokens, positions, attn, head)` calls this instead of computing the
        (B, T, V) logits, so a caller can compute what it needs (e.g. logprobs of targets in
        chunks) while the LM head is unsharded inside the model's forward.
        """
        ...


class CausalAttention:
    """Plain causal attention over the whole row (one document per row, no padding inside)."""

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        if window is None and sinks is None and index is None and keep is None:
            # enable_gqa keeps k, v un-repeated, which the flash kernel supports (no mask here).
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        idx = torch.arange(q.shape[2], device=q.device)
        mask = selected(window_mask(idx, idx, window)[None], None if index is None else index[0], index, keep)
        return attention_with_sinks(q, k, v, mask, sinks)


class DocumentCausalAttention:
    """Causal attention restricted to tokens of the same document (packed rows).

    doc_ids (B, T) int64: token i attends to token j iff j <= i and doc_ids[b, i] == doc_ids[b, j].
    Give each padding token its own id (or one id for a padding tail): the diagonal is always
    allowed, so no row is fully masked and no NaN can appear.

    The (B, 1, T, T) boolean mask is built on the first `attend` call and cached for the other
    layers. It costs B * T^2 bytes; for very long rows a FlexAttention / varlen context can
    replace this class without touching the model.
    """

    def __init__(self, doc_ids: Tensor) -> None:
        assert doc_ids.dim() == 2, f"doc_ids must be (B, T), got {tuple(doc_ids.shape)}"
        self.doc_ids = doc_ids  # (B, T)
        self._mask: Tensor | None = None
        self._windowed: dict[int, Tensor] = {}  # window -> mask & sliding window

    @classmethod
    def from_positions(cls, positions: Tensor) -> DocumentCausalAttention:
        """Documents inferred from positions (B, T): a new document starts wherever position == 0."""
        return cls(document_ids_from_positions(positions))

    def mask(self, device: torch.device) -> Tensor:
        """(B, 1, T, T) bool, True where attention is allowed."""
        if self._mask is None:
            doc = self.doc_ids.to(device)
            T = doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            same_doc = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
            self._mask = (same_doc & causal)[:, None]
        return self._mask

    def windowed_mask(self, device: torch.device, window: int) -> Tensor:
        """`mask` and q - window < k (row distance: documents are contiguous), cached per window."""
        if window not in self._windowed:
            idx = torch.arange(self.doc_ids.shape[1], device=device)
            self._windowed[window] = self.mask(device) & window_mask(idx, idx, window)
        return self._windowed[window]

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        B, num_q_heads, T, _ = q.shape
        assert self.doc_ids.shape == (B, T), f"doc_ids {tuple(self.doc_ids.shape)} vs q {tuple(q.shape)}"
        mask = self.mask(q.device) if window is None else self.windowed_mask(q.device, window)
        if index is not None or keep is not None:
            mask = selected(mask[:, 0], None if index is None else index[0], index, keep)
        if sinks is not None:
            return attention_with_sinks(q, k, v, mask, sinks)
        # Repeat k, v rather than enable_gqa: with an explicit mask the CUDA path is the
        # memory-efficient kernel, which does not take enable_gqa (it would fall back to math).
        n_rep = num_q_heads // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def document_ids_from_positions(positions: Tensor) -> Tensor:
    """positions (B, T) -> doc_ids (B, T): a document starts at each position 0 (ids count from 0).

    Padding laid out with position 0 per pad token becomes one-token documents, which is harmless.
    """
    return (positions == 0).long().cumsum(dim=1) - 1


# ---------------------------------------------------------------------------------------------
# GPU backends for packed documents.

AttentionBackend = Literal["sdpa", "flex", "varlen", "flash_attn", "split"]
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flex", "varlen", "flash_attn", "split")


@functools.cache
def _compiled_flex_attention() -> Any:
    """flex_attention compiled once per process (eager flex materialises the full score matrix).

    Lazy, so importing this module never starts a compile. Static shapes: on torch 2.11 (H200) the
    dynamic-shape recompile that a second row length triggers fails in inductor ("No choices to
    select" for the flex template), so callers pad rows to `flex_length` buckets instead and each
    bucket compiles once (8 buckets cover 1k-128k tokens, within dynamo's recompile limit).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


_FLEX_MIN_LENGTH = 1024


def flex_length(T: int) -> int:
    """The length a row of T tokens runs at in compiled flex: the next power of two, at least 1024.
    The padding is a document of its own, so its cost is the few diagonal blocks flex computes."""
    return max(_FLEX_MIN_LENGTH, 1 << (T - 1).bit_length())


def pad_doc_ids(doc_ids: Tensor, length: int) -> Tensor:
    """doc_ids (B, T) -> (B, length), the padding one more document per row (id max + 1)."""
    B, T = doc_ids.shape
    if length == T:
        return doc_ids
    fill = doc_ids.amax(dim=1, keepdim=True) + 1
    return torch.cat([doc_ids, fill.expand(B, length - T)], dim=1)


def run_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, compile: bool = True) -> Tensor:
    """flex_attention over q (B, Hq, T, D), k/v (B, Hkv, T, D) with a block mask built for a row of
    `block_mask.seq_lengths` >= T (a `flex_length` bucket): q/k/v are zero-padded to it and the
    output cut back to T."""
    if compile:
        flex = _compiled_flex_attention()
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    T, length = q.shape[2], block_mask.seq_lengths[0]
    if length != T:
        q, k, v = (F.pad(x, (0, 0, 0, length - T)) for x in (q, k, v))
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])[:, :, :T]


class FlexDocumentAttention:
    """Document-causal attention with FlexAttention (packed rows, any B).

    doc_ids (B, T) as for `DocumentCausalAttention`. The block mask (causal & same document) is
    built on the first `attend` call and reused by every layer; flex skips the key/value tiles
    it marks empty, which is most of a row of many short documents. Compiled, rows run padded to a
    `flex_length` bucket (one compile per bucket); `compile=False` runs flex eagerly at the row's
    own length (unfused, dense scores: for tests); torch has no flex backward on CPU.
    """

    def __init__(self, doc_ids: Tensor, compile: bool = True) -> None:
        assert doc_ids.dim() == 2, f"doc_ids must be (B, T), got {tuple(doc_ids.shape)}"
        self.doc_ids = doc_ids  # (B, T)
        self.compile = compile
        self._block_mask: Any = None

    def block_mask(self, device: torch.device) -> Any:
        """The BlockMask of (kv <= q) & same document, for all heads (H broadcast)."""
        if self._block_mask is None:
            doc_ids = self.doc_ids.to(device)
            if self.compile:
                doc_ids = pad_doc_ids(doc_ids, flex_length(doc_ids.shape[1]))
            self._block_mask = document_block_mask(doc_ids)
        return self._block_mask

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        B, num_q_heads, T, _ = q.shape
        assert self.doc_ids.shape == (B, T), f"doc_ids {tuple(self.doc_ids.shape)} vs q {tuple(q.shape)}"
        if window is not None or sinks is not None or index is not None or keep is not None:
            raise ValueError("the 'flex' attention backend has no sliding windows, attention sinks or sparse "
                             "selection yet (gpt-oss, GLM-5); use trainer.attention = 'sdpa'")
        return run_flex(q, k, v, self.block_mask(q.device), self.compile)


_FLEX_BLOCK = 128  # flex_attention's default sparse block size
# Query rows per step when classifying blocks: bounds the (B, rows, T) boolean temporaries.
_MASK_ELEMENTS_PER_STEP = 1 << 25


def document_block_mask(doc_ids: Tensor, block_size: int = _FLEX_BLOCK) -> Any:
    """doc_ids (B, T) -> flex BlockMask of (kv <= q) & (doc[q] == doc[kv]), heads broadcast.

    Equal to `create_block_mask(mask_mod, B, None, T, T)` (same partial and full blocks), but
    that evaluates mask_mod over a dense (B, T, T) grid at once: 2.5 GiB of temporaries at
    T = 16k and 10 GiB at 32k (measured on torch 2.11). Here the blocks are classified a band
    of query rows at a time, so the temporaries stay around 150 MB whatever T is.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, T = doc_ids.shape
    num_blocks = -(-T // block_size)
    padded = num_blocks * block_size
    idx = torch.arange(padded, device=doc_ids.device)
    doc = torch.zeros(B, padded, dtype=doc_ids.dtype, device=doc_ids.device)
    doc[:, :T] = doc_ids
    valid = idx < T  # padding past T allows nothing, so a trailing block is never "full"
    blocks_per_step = max(1, _MASK_ELEMENTS_PER_STEP // (B * padded * block_size))
    any_allowed = torch.empty(B, num_blocks, num_blocks, dtype=torch.bool, device=doc_ids.device)
    all_allowed = torch.empty_like(any_allowed)
    for q0 in range(0, num_blocks, blocks_per_step):
        q1 = min(q0 + blocks_per_step, num_blocks)
        rows = slice(q0 * block_size, q1 * block_size)
        allowed = ((doc[:, rows, None] == doc[:, None, :])
                   & (idx[None, :] <= idx[rows, None]) & valid[None, :] & valid[rows, None])  # (B, rows, padded)
        allowed = allowed.view(B, q1 - q0, block_size, num_blocks, block_size)
        any_allowed[:, q0:q1] = allowed.any(dim=4).any(dim=2)
        all_allowed[:, q0:q1] = allowed.all(dim=4).all(dim=2)
    partial = (any_allowed & ~all_allowed)[:, None]  # (B, 1, num_blocks, num_blocks)
    full = all_allowed[:, None]

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Applied by flex inside the partial blocks only.
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return BlockMask.from_kv_blocks(*_block_indices(partial), *_block_indices(full), BLOCK_SIZE=block_size,
                                    mask_mod=document_causal, seq_lengths=(T, T))


def _block_indices(dense: Tensor) -> tuple[Tensor, Tensor]:
    """(B, H, Qb, KVb) bool -> per query block the count (B, H, Qb) and the kv block indices
    (B, H, Qb, KVb), selected blocks first in ascending order: BlockMask's layout."""
    as_int = dense.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


def document_cu_seqlens(doc_ids: Tensor) -> tuple[Tensor, int]:
    """doc_ids (1, T) of contiguous documents -> (cu_seqlens (num_docs + 1,) int32, max doc length).

    cu_seqlens[i] is the row offset where document i starts, cu_seqlens[-1] == T: the layout
    varlen kernels take. A document id that appears in two separate runs raises ValueError,
    since varlen would treat the runs as two documents where `DocumentCausalAttention` has one.
    """
    if doc_ids.dim() != 2 or doc_ids.shape[0] != 1:
        raise ValueError(f"varlen attention needs one packed row, doc_ids (1, T); got {tuple(doc_ids.shape)}")
    doc = doc_ids[0]  # (T,)
    T = doc.shape[0]
    is_start = torch.ones(T, dtype=torch.bool, device=doc.device)
    is_start[1:] = doc[1:] != doc[:-1]
    starts = is_start.nonzero().squeeze(1)  # (num_docs,)
    if torch.unique(doc).numel() != starts.numel():
        raise ValueError("varlen attention needs each document's tokens contiguous in the row; "
                         "use the 'sdpa' or 'flex' backend for interleaved doc_ids")
    cu_seqlens = torch.cat([starts, starts.new_tensor([T])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


# torch's varlen kernel and its parameter names, resolved on first use outside compiled code
# (`VarlenDocumentAttention` does it when built) and only read after: on torch 2.11 dynamo breaks
# the graph on `importlib.util.find_spec`, and it traces through functools.cache wrappers, so a
# cached lookup would still split every compiled block at its attention.
_VARLEN: dict[str, Any] = {}


def _torch_varlen_attn() -> Any:
    """torch.nn.attention.varlen.varlen_attn, or None on a torch without it (before 2.10)."""
    if "fn" not in _VARLEN:
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            _VARLEN["fn"] = None
        else:
            from torch.nn.attention.varlen import varlen_attn

            _VARLEN["fn"] = varlen_attn
    return _VARLEN["fn"]


def _torch_varlen_params() -> frozenset[str]:
    if "params" not in _VARLEN:
        _VARLEN["params"] = frozenset(inspect.signature(_torch_varlen_attn()).parameters)
    return _VARLEN["params"]


def _torch_varlen_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int,
                         cu_k: Tensor | None = None, max_k: int | None = None) -> Tensor:
    """q (N, Hq, D), k, v (N, Hkv, D) -> (N, Hq, D) causal within each document. With `cu_k` /
    `max_k` the documents' keys have their own lengths (runtime/train/shared_prompt.py's branches)
    and the causal mask is aligned bottom-right, the kernels' convention.

    The signature moved between releases: 2.10 takes `is_causal`, 2.11 a `window_size`
    ((-1, 0) is causal), 2.12 adds `enable_gqa`; without it k, v are repeated to Hq heads.
    """
    params = _torch_varlen_params()
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    cu_k, max_k = (cu_seqlens, max_len) if cu_k is None else (cu_k, max_k)
    return _torch_varlen_attn()(q, k, v, cu_seqlens, cu_k, max_len, max_k, **kwargs)


def _flash_attn_varlen_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int,
                              cu_k: Tensor | None = None, max_k: int | None = None) -> Tensor:
    """The flash-attn package's varlen kernel (GQA native); imported only when used. `cu_k` /
    `max_k` as in `_torch_varlen_causal`."""
    from flash_attn import flash_attn_varlen_func

    cu_k, max_k = (cu_seqlens, max_len) if cu_k is None else (cu_k, max_k)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_k, max_len, max_k, causal=True)


class VarlenDocumentAttention:
    """Document-causal attention with a flash-attention varlen kernel (one packed row).

    doc_ids (1, T) with each document's tokens contiguous (what runtime/train/packing.py produces).
    The row is handed to the kernel as (T, H, D) with cumulative document lengths, so no mask
    exists and no tile outside a document is computed. Flash kernels take bf16/fp16 only.
    `kernel`: "torch" (torch.nn.attention.varlen, torch >= 2.10) or "flash_attn" (the package).
    """

    def __init__(self, doc_ids: Tensor, kernel: Literal["torch", "flash_attn"] = "torch",
                 host_doc_ids: Tensor | None = None) -> None:
        if doc_ids.dim() != 2 or doc_ids.shape[0] != 1:
            raise ValueError(f"varlen attention needs one packed row, doc_ids (1, T); got {tuple(doc_ids.shape)}")
        if kernel not in ("torch", "flash_attn"):
            raise ValueError(f"kernel must be 'torch' or 'flash_attn', got {kernel!r}")
        self.doc_ids = doc_ids  # (1, T)
        self.kernel = kernel
        self._seqlens: tuple[Tensor, int] | None = None
        if kernel == "torch" and _torch_varlen_attn() is not None:
            _torch_varlen_params()  # resolved here, outside compiled code (see _VARLEN)
        if host_doc_ids is not None:  # the boundaries from the CPU copy: no host sync
            if host_doc_ids.shape != doc_ids.shape:
                raise ValueError(f"host_doc_ids {tuple(host_doc_ids.shape)} vs doc_ids {tuple(doc_ids.shape)}")
            cu_seqlens, max_len = document_cu_seqlens(host_doc_ids.cpu())
            self._seqlens = (cu_seqlens.to(doc_ids.device), max_len)
        elif doc_ids.is_cuda:  # here too: its host sync inside the first compiled block would break its graph
            self.cu_seqlens(doc_ids.device)

    def cu_seqlens(self, device: torch.device) -> tuple[Tensor, int]:
        """(cu_seqlens (num_docs + 1,) int32 on `device`, max doc length), computed once per forward
        (when the context is built, for doc_ids on CUDA)."""
        if self._seqlens is None:
            cu_seqlens, max_len = document_cu_seqlens(self.doc_ids)
            self._seqlens = (cu_seqlens.to(device), max_len)
        return self._seqlens

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        B, _, T, _ = q.shape
        assert self.doc_ids.shape == (B, T), f"doc_ids {tuple(self.doc_ids.shape)} vs q {tuple(q.shape)}"
        if window is not None or sinks is not None or index is not None or keep is not None:
            raise ValueError("varlen attention has no sliding windows, attention sinks or sparse selection here "
                             "(gpt-oss, GLM-5); use trainer.attention = 'sdpa'")
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"varlen (flash) attention needs bf16 or fp16 q/k/v, got {q.dtype}; "
                             "use the 'sdpa' or 'flex' backend for fp32")
        cu_seqlens, max_len = self.cu_seqlens(q.device)
        # (1, H, T, D) -> (T, H, D): the model's q/k/v are views of (T, H, D) projections, so
        # contiguous() is usually free.
        q_, k_, v_ = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        varlen = _torch_varlen_causal if self.kernel == "torch" else _flash_attn_varlen_causal
        out = varlen(q_, k_, v_, cu_seqlens, max_len)  # (T, Hq, D)
        return out.transpose(0, 1).unsqueeze(0)


class SplitDocumentAttention:
    """Document-causal attention as one causal SDPA call per document (one packed row).

    doc_ids (1, T) with each document's tokens contiguous (runtime/train/packing.py's rows). Each
    document's q/k/v are views of the row; outputs are concatenated back in row order, so the
    backward is SDPA's own per document. Cost: sum of L^2 over documents, plus one call per
    document and layer (cheap next to T^2 once documents are a few dozen tokens or more).
    Windows, sinks and sparse selection go through `DocumentCausalAttention`'s dense mask.
    """

    def __init__(self, doc_ids: Tensor) -> None:
        if doc_ids.dim() != 2 or doc_ids.shape[0] != 1:
            raise ValueError(f"split attention needs one packed row, doc_ids (1, T); got {tuple(doc_ids.shape)}")
        self.doc_ids = doc_ids  # (1, T)
        self._bounds: list[tuple[int, int]] | None = None
        self._dense: DocumentCausalAttention | None = None

    def bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] of each document in the row, computed once per forward."""
        if self._bounds is None:
            cu_seqlens, _ = document_cu_seqlens(self.doc_ids)
            cu = cu_seqlens.tolist()
            self._bounds = list(zip(cu[:-1], cu[1:]))
        return self._bounds

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        B, num_q_heads, T, _ = q.shape
        assert self.doc_ids.shape == (B, T), f"doc_ids {tuple(self.doc_ids.shape)} vs q {tuple(q.shape)}"
        if window is not None or sinks is not None or index is not None or keep is not None:
            if self._dense is None:
                self._dense = DocumentCausalAttention(self.doc_ids)
            return self._dense.attend(layer_id, q, k, v, window, sinks, index, keep)
        gqa = num_q_heads != k.shape[1]
        bounds = self.bounds()
        if len(bounds) == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # torch.split, not one slice per document: the backward of n slices builds n zero-filled
        # row-sized gradients and adds them up (quadratic in the documents of a row); a split's
        # backward is one concatenation of the pieces. Same views, same values.
        sizes = [e - s for s, e in bounds]
        outs = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
                for qd, kd, vd in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))]
        return torch.cat(outs, dim=2)


def make_document_attention(doc_ids: Tensor, backend: AttentionBackend,
                            host_doc_ids: Tensor | None = None) -> AttentionContext:
    """An attention context for packed rows doc_ids (B, T); see the module docstring for backends.

    `doc_ids` must already be on the device the model runs on: that is how the GPU-only
    backends know they would run on CPU, which they refuse with a ValueError. `host_doc_ids`: the
    same ids on the CPU where the caller has them; the varlen backends then find the document
    boundaries there, without the three host syncs of doing it on the device.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    if backend == "sdpa":
        return DocumentCausalAttention(doc_ids)
    if backend == "split":
        return SplitDocumentAttention(doc_ids)
    if backend == "varlen" and _torch_varlen_attn() is None:
        raise ValueError(f"attention backend 'varlen' needs torch.nn.attention.varlen (torch >= 2.10); "
                         f"this is torch {torch.__version__}")
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attention backend 'flash_attn' needs the flash-attn package, which is not installed; "
                         "use 'varlen' (torch's own flash varlen kernel) or 'flex'")
    if backend in ("varlen", "flash_attn") and (doc_ids.dim() != 2 or doc_ids.shape[0] != 1):
        raise ValueError(f"attention backend {backend!r} needs one packed row, doc_ids (1, T); "
                         f"got {tuple(doc_ids.shape)}")
    if doc_ids.device.type != "cuda":
        why = "torch has no FlexAttention backward on CPU" if backend == "flex" else "flash kernels are CUDA-only"
        raise ValueError(f"attention backend {backend!r} needs doc_ids on a CUDA device ({why}); "
                         f"got {doc_ids.device}; use 'sdpa'")
    if backend == "flex":
        return FlexDocumentAttention(doc_ids)
    return VarlenDocumentAttention(doc_ids, kernel="torch" if backend == "varlen" else "flash_attn",
                                   host_doc_ids=host_doc_ids)
