"""Paged KV cache for the native engine: blocks, block tables, prefix cache, paged attention.

Storage. One tensor holds every layer's keys and values, shaped
(n_layers, 2, Hkv, num_blocks, block_size, D): head-major, so one head's keys of a block are
contiguous and a gather by block table gives (Hkv, B, L, D) that batched matmuls take without
a transposing copy (about half of a CPU decode step went into that copy). `KVCache.layer` hands
out (num_blocks, block_size, Hkv, D) views of it. Values narrower than keys (MLA) get a tensor
of their own dim; every write checks the tensor against the dims of its cache and raises on a
mismatch. A sequence owns a *block table*: the list of
block ids holding its positions 0.., block_size positions per block. Block 0 is the null
block: it is never handed out, padded rows write their garbage k/v there and padded table
entries point at it, so fixed-shape (CUDA-graph) batches need no branches.

Blocks. `BlockManager` counts references per block. A block filled with known tokens is
*registered* in the prefix cache under a hash chained over (parent hash, its token ids), so the
key names the whole prefix, not just the block's tokens. A new sequence looks its full prompt
blocks up and takes a reference on every hit instead of recomputing them. Shared blocks are
immutable: a sequence only writes at positions past what it shares, except right after a fork
(n samples of one prompt share the prompt's last, partly filled block); writing into a block
with more than one reference first copies it (copy-on-write, `BlockManager.writable`).
A registered block whose last reference goes away stays cached (least recently freed first out)
until an allocation needs it, so a later turn of a multi-turn episode reuses its earlier turns.

Attention. `PagedAttention` is the models' `AttentionContext` over this cache: it writes the new
k/v into their slots (block * block_size + offset) and attends over each row's blocks.

- "torch" backend (CPU and GPU): gather the rows' blocks into a contiguous (B, Hkv, L, D)
  tensor by block table, then one SDPA call with a boolean mask (key position <= query
  position). A CPU decode instead reads a dense copy of the rows' k/v that it keeps beside the
  blocks (`dense`, runtime/engine/dense_decode.py): no gather per layer and step. GQA is folded into the query length (the g query heads of a kv head become g x T
  query rows), so k/v are never repeated. Exact, simple, and fixed-shape when L is bucketed,
  but it moves every gathered key twice.
- "triton" backend (CUDA decode only, T == 1): runtime/engine/kernels.py's `paged_decode_attention`
  reads k/v straight from the blocks with an online softmax, tiles of 32 keys, tensor-core
  products and, for few rows, split key ranges. It reads each cached key once, which is what
  the decode loop is bound by. It is used only if triton imports; prefill always takes the torch
  path (prefill without a cached prefix uses SDPA's causal kernel on the new tokens directly).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from meshrl.models.common import fused_decode
from meshrl.models.common.attention import attention_with_sinks, selected, window_mask
from meshrl.models.common.fp8 import FP8, quantize_rows
from meshrl.runtime.engine.kernels import fp8_kv_write, kv_write, paged_decode_attention, triton_available  # noqa: F401 (re-exported)

NULL_BLOCK = 0

AttentionBackend = Literal["torch", "triton"]


# ---------------------------------------------------------------------------- block bookkeeping


def block_hashes(tokens: list[int], block_size: int, num_blocks: int, start: list[int] | None = None) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks of `tokens`; `start` holds known ones."""
    hashes = list(start or [])
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else 0
        hashes.append(hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]))))
    return hashes


@dataclass
class _CachedBlock:
    key: int
    parent: int
    tokens: tuple[int, ...]


@dataclass
class BlockManager:
    """Reference-counted blocks 1..num_blocks-1 with an LRU prefix cache (block 0 is the null block).

    Invariant: every usable block is in exactly one of: `free` (no references, no content),
    `evictable` (no references, registered content), or in use (ref > 0, maybe registered).
    """

    num_blocks: int
    block_size: int
    ref: list[int] = field(init=False)
    free: list[int] = field(init=False)
    evictable: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)
    cached: dict[int, int] = field(init=False, default_factory=dict)  # key -> block
    info: dict[int, _CachedBlock] = field(init=False, default_factory=dict)  # block -> its key and content
    hits: int = 0
    """Blocks served from the prefix cache so far (a statistic)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {self.num_blocks}")
        self.ref = [0] * self.num_blocks
        self.free = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out block 1 first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free or evictable)."""
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        """A block with one reference; evicts the least recently freed cached block if needed."""
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._unregister(block)
        else:
            raise RuntimeError("KV cache out of blocks (the scheduler must check num_free first)")
        assert self.ref[block] == 0
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.evictable[block]
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref[block] > 0, f"block {block} freed twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.info:
                self.evictable[block] = None  # most recently freed: evicted last
            else:
                self.free.append(block)

    def release(self, table: list[int]) -> None:
        """Drop one reference on every block of a block table."""
        for block in table:
            self.decref(block)

    def match(self, hashes: list[int], tokens: list[int]) -> list[int]:
        """Cached blocks for the longest run of `hashes` found, each with a new reference."""
        blocks = []
        for i, key in enumerate(hashes):
            block = self.cached.get(key)
            if block is None:
                break
            entry = self.info[block]
            # A hash collision must not hand out another prefix's keys: compare the content.
            if entry.tokens != tuple(tokens[i * self.block_size:(i + 1) * self.block_size]) or \
                    entry.parent != (hashes[i - 1] if i else 0):
                break
            self.incref(block)
            blocks.append(block)
        self.hits += len(blocks)
        return blocks

    def register(self, block: int, key: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Record that `block` (in use) holds the full block `tokens` after the prefix `parent`."""
        assert self.ref[block] > 0 and len(tokens) == self.block_size
        if key in self.cached or block in self.info:
            return  # the same content is cached already (e.g. two samples that agree)
        self.cached[key] = block
        self.info[block] = _CachedBlock(key, parent, tokens)

    def _unregister(self, block: int) -> None:
        entry = self.info.pop(block)
        del self.cached[entry.key]

    def clear_prefix_cache(self) -> None:
        """Forget every registered block (new weights make cached keys stale); blocks in use stay."""
        for block in list(self.info):
            self._unregister(block)
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.free.append(block)

    def writable(self, table: list[int], index: int) -> int | None:
        """Make table[index] exclusively owned before a write; returns the source block to copy
        from when a new block was swapped in (copy-on-write), else None."""
        block = table[index]
        if self.ref[block] == 1 and block not in self.info:
            return None
        if self.ref[block] == 1:
            # Sole owner of a registered block about to change: its cache entry would lie.
            self._unregister(block)
            return None
        new = self.allocate()
        self.decref(block)
        table[index] = new
        return block

    def check(self) -> None:
        """Assert the bookkeeping invariants (for tests)."""
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free) and not free & evictable and NULL_BLOCK not in free | evictable
        for block in range(1, self.num_blocks):
            in_use = self.ref[block] > 0
            assert in_use + (block in free) + (block in evictable) == 1, f"block {block} is lost or doubly owned"
            assert (block in evictable) <= (block in self.info)
        assert all(self.cached[e.key] == b for b, e in self.info.items()) and len(self.cached) == len(self.info)


# ---------------------------------------------------------------------------- storage


class KVCache:
    """The k/v storage of every attention layer, in the model dtype or (fp8=True) in e4m3 with one
    fp32 scale per token, head and k/v in `scales` (n_layers, 2, Hkv, num_blocks, block_size):
    writes quantise each new head vector on its own (`fp8.quantize_rows`), reads dequantise.

    Keys are (n_layers, Hkv, num_blocks, block_size, head_dim) and values (n_layers, Hkv,
    num_blocks, block_size, v_head_dim). When the two dims agree (every GQA family) both are views
    of one (n_layers, 2, Hkv, num_blocks, block_size, D) tensor `data`, the layout the Triton
    kernel reads. A family whose values are narrower than its keys (MLA: DeepSeek-V3's q/k head
    dim is nope + rope, its v head dim its own) gets two tensors and `data` is None. Writes check
    each tensor against its own dims (`write_slots`), so a k or v of another shape raises.
    v_head_dim = 0 stores keys only: MLA's latent cache, one "head" of latent + rope key per token
    (`PagedAttention.attend_latent` reads the values out of the keys).

    layer_ids: the ids the model passes to `attend`, in the order of the storage's first dim.
    """

    def __init__(self, layer_ids: list[int], num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, v_head_dim: int | None = None, fp8: bool = False) -> None:
        self.index = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.fp8 = fp8
        self._views: dict[int, tuple[Tensor, Tensor]] = {}  # layer id -> (k, v) views (`layer`)
        shape = (len(layer_ids), num_kv_heads, num_blocks, block_size)
        self.data: Tensor | None = None
        self.scales: Tensor | None = None
        if fp8 and self.v_head_dim != head_dim:
            raise ValueError(f"inference.kv_cache_dtype = 'fp8' needs keys and values of one head dim; this model's "
                             f"cache holds {'an MLA latent' if self.v_head_dim == 0 else 'values of another dim'} "
                             f"(k {head_dim}, v {self.v_head_dim}): use kv_cache_dtype = 'auto'")
        if self.v_head_dim == head_dim:
            self.data = torch.zeros((len(layer_ids), 2, *shape[1:], head_dim), dtype=FP8 if fp8 else dtype,
                                    device=device)
            if fp8:  # one dequantisation scale per (layer, k or v, head, slot)
                self.scales = torch.ones((len(layer_ids), 2, *shape[1:]), dtype=torch.float32, device=device)
        else:
            self._k = torch.zeros((*shape, head_dim), dtype=dtype, device=device)
            self._v = torch.zeros((*shape, self.v_head_dim), dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None, fp8: bool = False) -> int:
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if fp8:  # e4m3 values and one fp32 scale per token, head and k/v
            return num_layers * block_size * num_kv_heads * (head_dim + v_head_dim + 8)
        return num_layers * block_size * num_kv_heads * (head_dim + v_head_dim) * dtype.itemsize

    def _storage(self) -> tuple[Tensor, Tensor]:
        """(keys, values), each (n_layers, Hkv, num_blocks, block_size, its head dim)."""
        if self.data is not None:
            return self.data[:, 0], self.data[:, 1]
        return self._k, self._v

    @property
    def latent(self) -> bool:
        """Keys only (v_head_dim 0): MLA's compressed latent and rotary key per token."""
        return self.v_head_dim == 0

    def layer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """(k, v) of one layer, each a (num_blocks, block_size, Hkv, its head dim) view of the head-major storage."""
        views = self._views.get(layer_id)  # made once: every layer of every forward asks
        if views is None:
            if layer_id not in self.index:
                raise ValueError(f"attention layer {layer_id} has no KV cache (the cache holds layers "
                                 f"{sorted(self.index)})")
            i = self.index[layer_id]
            k, v = self._storage()
            views = self._views[layer_id] = (k[i].permute(1, 2, 0, 3), v[i].permute(1, 2, 0, 3))
        return views

    def layer_scales(self, layer_id: int) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """FP8 cache: (k scales, v scales) of one layer, each a (num_blocks, block_size, Hkv) fp32 view
        (x = x8 * scale per token and head); (None, None) for a cache in the model dtype."""
        if self.scales is None:
            return None, None
        s = self.scales[self.index[layer_id]]
        return s[0].permute(1, 2, 0), s[1].permute(1, 2, 0)

    def release(self) -> int:
        """Free the storage (a sleeping engine: runtime/engine/native.py `sleep`); returns the bytes
        freed. `restore` allocates it again, zeroed."""
        names = ("data",) if self.data is not None else ("_k", "_v")
        tensors = {name: getattr(self, name) for name in names + (("scales",) if self.scales is not None else ())}
        self._released = {name: (tuple(t.shape), t.dtype, t.device) for name, t in tensors.items()}
        for name, t in tensors.items():
            setattr(self, name, t.new_empty(0))
        self._views = {}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def released(self) -> bool:
        """Whether `release` freed the storage and `restore` has not allocated it again."""
        return bool(getattr(self, "_released", None))

    def restore(self) -> None:
        for name, (shape, dtype, device) in self._released.items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        self._released = {}
        self._views = {}

    def storages(self) -> list[tuple[Tensor, int]]:
        """Every storage tensor with its block dim: the k/v tensor `data` (or keys and values apart)
        and an FP8 cache's scales; e4m3 as bytes (index_select / index_copy_ and the P/D block
        transfer, runtime/engine/disagg.py, need no fp8 kernels then). Writes go to the cache."""
        if self.data is None:
            return [(self._k, 2), (self._v, 2)]
        out = [(self.data.view(torch.uint8) if self.fp8 else self.data, 3)]
        return out + ([(self.scales, 3)] if self.scales is not None else [])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer, k and v): the data half of copy-on-write."""
        if src:
            k, _ = self._storage()
            s = torch.tensor(src, device=k.device)
            d = torch.tensor(dst, device=k.device)
            if self.data is not None:
                data = self.data.view(torch.uint8) if self.fp8 else self.data  # fp8 indexing: as bytes
                data[:, :, :, d] = data[:, :, :, s]
                if self.scales is not None:
                    self.scales[:, :, :, d] = self.scales[:, :, :, s]
            else:
                for t in (self._k, self._v):
                    t[:, :, d] = t[:, :, s]


# ---------------------------------------------------------------------------- attention


def gather_blocks(cache: Tensor, tables: Tensor) -> Tensor:
    """cache (num_blocks, bs, Hkv, D) (a view of any layout), tables (B, nb) -> (Hkv, B, nb * bs, D)
    keys in position order, head-major (no copy beyond the gather on the engine's storage).

    index_select over the flattened table, not `[:, tables]`: advanced indexing took 4-6x longer
    on CPU (tiny model, 64 rows x 8 blocks: 17 -> 3-4 ms a call, 2026-12-01)."""
    num_kv_heads, (B, nb), bs, D = cache.shape[2], tables.shape, cache.shape[1], cache.shape[3]
    picked = torch.index_select(cache.permute(2, 0, 1, 3), 1, tables.reshape(-1))  # (Hkv, B * nb, bs, D)
    return picked.view(num_kv_heads, B, nb * bs, D)


def gather_fp8_blocks(cache: Tensor, tables: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """`gather_blocks`, dequantised when the cache is e4m3 (scales (num_blocks, bs, Hkv)) -> (Hkv, B, L, D) in dtype."""
    if scales is None:
        return gather_blocks(cache, tables)
    x8 = gather_blocks(cache.view(torch.uint8), tables).view(FP8)  # fp8 indexing: as bytes
    s = scales.permute(2, 0, 1)[:, tables].flatten(2, 3)  # (Hkv, B, L)
    return (x8.float() * s[..., None]).to(dtype)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
    """q (B, Hq, T, D), k (Hkv, B, L, D), v (Hkv, B, L, Dv) head-major, mask (B, 1, T, L) bool -> (B, Hq, T, Dv).
    `scale` of the scores: 1/sqrt(D) when None. `sinks` (Hq,): one extra logit per query head
    whose value is zero (gpt-oss; models/common/attention.py's `attention_with_sinks`).

    The Hq / Hkv query heads that share a kv head are stacked along the query length, so a
    masked (memory-efficient) kernel runs GQA without repeating k/v; (kv head, row) are the
    batch dims, in the order the head-major keys already have.
    """
    B, num_q_heads, T, D = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    qf = q.reshape(B, num_kv_heads, group * T, D).transpose(0, 1)  # head h = kv_head * group + j -> rows j * T + t
    maskf = (mask.repeat(1, 1, group, 1) if group > 1 else mask).transpose(0, 1)  # (1, B, group * T, L)
    if group * T <= 8 or sinks is not None:
        # A few query rows (decode): plain matmuls with an fp32 softmax run ~10x faster on CPU
        # than SDPA's masked kernels, which are built for long query blocks.
        scores = (qf @ k.transpose(-1, -2)).float() * (D**-0.5 if scale is None else scale)  # (Hkv, B, group*T, L)
        scores = scores.masked_fill(~maskf, float("-inf"))
        if sinks is not None:  # row j * T + t of kv head h is query head h * group + j
            sink = sinks.float().view(num_kv_heads, 1, group, 1, 1).expand(-1, B, -1, T, 1)
            scores = torch.cat([scores, sink.reshape(num_kv_heads, B, group * T, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)
        out = (weights[..., :-1] if sinks is not None else weights).to(v.dtype) @ v
    else:
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=maskf, scale=scale)
    return out.transpose(0, 1).reshape(B, num_q_heads, T, v.shape[-1])


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                              positions: Tensor, window: int | None = None, sinks: Tensor | None = None,
                              k_scales: Tensor | None = None, v_scales: Tensor | None = None) -> Tensor:
    """The torch backend. q (B, Hq, T, D) at positions (B, T); tables (B, nb) cover every position.

    Query at position p sees cached keys 0..p of its row (causal within the new tokens), with a
    sliding `window` only p - window < key position; `sinks` as in `grouped_sdpa`. An FP8 cache
    passes its (num_blocks, block_size, Hkv) scales: the gathered keys and values are dequantised
    to q's dtype.
    """
    keys = gather_fp8_blocks(k_cache, tables, k_scales, q.dtype)  # (Hkv, B, L, D)
    values = gather_fp8_blocks(v_cache, tables, v_scales, q.dtype)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    diff = positions[:, :, None] - key_pos[None, None, :]  # (B, T, L)
    mask = (diff >= 0) if window is None else (diff >= 0) & (diff < window)
    return grouped_sdpa(q, keys, values, mask[:, None], sinks=sinks)


def check_fits(cache: Tensor, slots: Tensor, x: Tensor) -> None:
    """ValueError unless x (B, Hkv, T, D) has the heads and head dim of cache (num_blocks, bs, Hkv, D)
    and one slot per token."""
    _, _, num_kv_heads, head_dim = cache.shape
    if x.dim() != 4 or x.shape[1] != num_kv_heads or x.shape[3] != head_dim:
        raise ValueError(f"cannot write a tensor of shape {tuple(x.shape)} into a KV cache of {num_kv_heads} heads "
                         f"x {head_dim} dims per token (the cache was sized for another layer shape)")
    if x.shape[0] * x.shape[2] != slots.numel():
        raise ValueError(f"{x.shape[0] * x.shape[2]} new tokens but {slots.numel()} cache slots")


def write_slots(cache: Tensor, slots: Tensor, x: Tensor) -> None:
    """Store x (B, Hkv, T, D) at the flat slots (B * T,) of a (num_blocks, bs, Hkv, D) view of
    head-major storage (view() fails loudly on any other layout instead of writing to a copy).

    x must have the cache's heads and head dim: viewing the storage with x's shape instead would
    reinterpret it (a narrower v would be scattered across the wrong slots without any error).
    """
    check_fits(cache, slots, x)
    _, _, num_kv_heads, head_dim = cache.shape
    storage = cache.permute(2, 0, 1, 3).view(num_kv_heads, -1, head_dim)  # (Hkv, num_blocks * bs, D)
    x = x.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    if cache.dtype == FP8:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
        storage, x = storage.view(torch.uint8), x.view(torch.uint8)
    storage.index_copy_(1, slots, x)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def write_kv(cache: KVCache, layer_id: int, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store one layer's new k/v (B, Hkv, T, D) at the flat slots (B * T,), quantised (with their
    scales) in an FP8 cache (one Triton launch on CUDA, else `write_fp8_torch`) -> that layer's
    (k, v) cache views. A cache in the model dtype takes one Triton launch for both where the decode
    fusions are on (models/common/fused_decode.py, MESHRL_FUSED_DECODE), else two index_copy_."""
    k_cache, v_cache = cache.layer(layer_id)
    check_fits(v_cache, slots, v)  # both checked before either is written
    if (not cache.fp8 and cache.data is not None and fused_decode.enabled(k) and k.dtype == v.dtype == k_cache.dtype
            and k.shape[-1] == v.shape[-1]):
        check_fits(k_cache, slots, k)
        kv_write(k, v, slots, k_cache, v_cache)
    elif cache.fp8 and k.is_cuda and triton_available() and _pow2(k.shape[-1]):
        check_fits(k_cache, slots, k)
        fp8_kv_write(k, v, slots, k_cache, v_cache, *cache.layer_scales(layer_id))
    elif cache.fp8:
        write_fp8_torch(cache, layer_id, slots, k, v)
    else:
        write_slots(k_cache, slots, k)
        write_slots(v_cache, slots, v)
    return k_cache, v_cache


def write_fp8_torch(cache: KVCache, layer_id: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """The FP8 cache write in torch ops: `fp8.quantize_rows` per (token, head), values and scales."""
    k_cache, v_cache = cache.layer(layer_id)
    k_scales, v_scales = cache.layer_scales(layer_id)
    for x, dst, dst_scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        x8, scale = quantize_rows(x)  # (B, Hkv, T, D), (B, Hkv, T)
        write_slots(dst, slots, x8)
        dst_scales.permute(2, 0, 1).view(dst_scales.shape[2], -1).index_copy_(
            1, slots, scale.transpose(0, 1).reshape(scale.shape[1], -1))


class PagedAttention:
    """AttentionContext of one engine forward over the paged cache.

    slots (B, T) long: where each new token's k/v goes (pads -> the null block). positions (B, T)
    long: each new token's absolute position. tables (B, nb) int32: the rows' block tables, padded
    with the null block; nb * block_size must reach past every row's last position.
    context_lens (B,) int32: positions + 1 of the last new token (decode kernel only).
    fresh: no row has cached tokens before its new ones (a plain prefill), so attention can run
    causally on the new tokens alone. dense: a CPU decode's dense copy of the rows' k/v
    (runtime/engine/dense_decode.py), written beside the paged cache and read instead of it.
    """

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor, tables: Tensor,
                 context_lens: Tensor | None = None, backend: AttentionBackend = "torch", fresh: bool = False,
                 dense=None) -> None:
        self.cache = cache
        self.slots = slots
        self.positions = positions
        self.tables = tables
        self.tables_long = tables.long()
        self.context_lens = context_lens
        self.backend = backend
        self.fresh = fresh
        self.dense = dense

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None) -> Tensor:
        """q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D); k/v are written to the cache first.

        A sliding `window` or `sinks` (gpt-oss) take the torch path (the Triton kernel has neither);
        every block stays cached, the window is a mask.
        """
        k_cache, v_cache = write_kv(self.cache, layer_id, self.slots.reshape(-1), k, v)
        plain = window is None and sinks is None
        if self.dense is not None:
            self.dense.write(layer_id, k, v)
            if plain:
                return self.dense.attend(layer_id, q)
        k_scales, v_scales = self.cache.layer_scales(layer_id)
        if self.fresh and plain:
            # Right padding sits after every real token, so causal attention never reads it.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        if self.fresh:
            idx = torch.arange(q.shape[2], device=q.device)
            return attention_with_sinks(q, k, v, window_mask(idx, idx, window)[None, None], sinks)
        if self.backend == "triton" and plain:
            return paged_decode_attention(q, k_cache, v_cache, self.tables, self.context_lens, k_scales=k_scales,
                                          v_scales=v_scales)
        return paged_attention_reference(q, k_cache, v_cache, self.tables_long, self.positions, window, sinks,
                                         k_scales, v_scales)

    def attend_latent(self, layer_id: int, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                      wkv_b: Tensor, v_head_dim: int, index: tuple | None = None, keep: Tensor | None = None,
                      index_dim: int = 0) -> Tensor:
        """Multi-head latent attention over a latent cache (models/common/mla.py). q_nope (B, H, T, Dn),
        q_rope (B, H, T, Dr), latent (B, T, R), k_rope (B, 1, T, Dr), wkv_b (H * (Dn + Dv), R) -> (B, H, T, Dv).

        [latent, k_rope] (R + Dr per token) is written to the cache. A fresh prefill expands the new
        tokens' per-head k and v, as the trainer does; otherwise the queries are absorbed into the
        latent space (q_nope W_uk), attend over the cached [latent, k_rope] as one shared kv head
        whose values are its first R dims, and the result leaves through W_uv.

        Sparse attention (GLM-5; `index` / `keep` as in models/common/attention.py): the row also
        holds the token's `index_dim` indexer-key dims ([latent, k_rope, index key]; zeros in a
        layer that reuses another's selection), and attention is narrowed to the selected keys.
        """
        k_cache, _ = self.cache.layer(layer_id)  # (num_blocks, bs, 1, R + Dr [+ Di])
        B, H, T, nope_dim = q_nope.shape
        rank, rope_dim = latent.shape[-1], k_rope.shape[-1]
        scale = (nope_dim + rope_dim) ** -0.5
        index_keys = index[0] if index is not None else latent.new_zeros(B, T, index_dim)
        row = torch.cat([latent, k_rope[:, 0], index_keys], dim=-1)[:, None] if index_dim else \
            torch.cat([latent, k_rope[:, 0]], dim=-1)[:, None]
        write_slots(k_cache, self.slots.reshape(-1), row)
        w = wkv_b.view(H, nope_dim + v_head_dim, rank)
        sparse = index is not None or keep is not None
        if self.fresh:
            k_nope, v = F.linear(latent, wkv_b).view(B, T, H, -1).transpose(1, 2).split([nope_dim, v_head_dim], -1)
            k = torch.cat([k_nope, k_rope.expand(-1, H, -1, -1)], dim=-1)
            q = torch.cat([q_nope, q_rope], -1)
            if not sparse:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            idx = torch.arange(T, device=q.device)
            mask = selected(window_mask(idx, idx, None)[None], index_keys, index, keep)  # (B, 1, T, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :nope_dim]), q_rope], dim=-1)  # (B, H, T, R + Dr)
        keys = gather_blocks(k_cache, self.tables_long)  # (1, B, L, R + Dr [+ Di])
        key_pos = torch.arange(keys.shape[2], device=q.device)
        mask = key_pos[None, None, :] <= self.positions[:, :, None]  # (B, T, L)
        mask = selected(mask, keys[0, ..., rank + rope_dim:], index, keep) if sparse else mask[:, None]
        out = grouped_sdpa(q, keys[..., : rank + rope_dim], keys[..., :rank], mask, scale)  # (B, H, T, R)
        return torch.einsum("bhtr,hvr->bhtv", out, w[:, nope_dim:])
