"""CPU decode attention over a dense copy of every decoding row's keys and values.

The paged cache (runtime/engine/kv_cache.py) keeps each sequence's k/v in blocks that are
scattered over the storage, so its torch decode path gathers every row's blocks into a contiguous
tensor at every layer of every step before two batched matmuls read it: on a CPU the gather moved
as many bytes as the matmuls read and took about as long (2026-12-01, tiny model, 256 rows x 320
tokens: `index_select` 135 ms and `bmm` 134 ms of a 688 ms profile). A CUDA decode has the Triton
kernel, which reads the blocks in place; a CPU has no such kernel.

`DenseRows` keeps a second copy of the decoding rows' k/v, one contiguous (Lcap, D) matrix per
(row, kv head, layer, k or v), Lcap = max_blocks * block_size:

    data (n_layers, 2, rows, Hkv, Lcap, D)

- the paged cache stays the source of truth (prefill, the prefix cache, copy-on-write,
  preemption and the P/D block transfer use it unchanged); every decode forward writes its new
  k/v to both;
- a row that starts decoding (its sequence just finished its prompt, or was forked from one that
  did) is *refilled*: one `index_select` over its block table copies its cached positions for
  every layer at once (`refill`); the scheduler queues the row when it sends the row's whole
  block table, which is exactly when the row changes hands or its sequence was recomputed;
- decode attention then reads rows [0, B) and keys [0, L) as a view (no copy), scores them with
  one batched matmul per layer over (row, kv head), the group's query heads as the rows of each
  product (GQA without repeating k/v), masks keys past each row's position, softmax in fp32,
  and one batched matmul with the values.

Copy-on-write swaps a block for a copy of itself, so a row's dense keys stay valid through it.
Pad rows of a decode batch (slot 0, the null block) write their garbage into a scratch row. Used on CPU with the torch backend for models whose
attention layers all keep plain k/v of one head dim in the model dtype (not FP8 caches, MLA
latents or linear-attention states); a layer with a sliding window or sinks still reads the
paged cache. `check` asserts the copy against the paged cache (engine tests run it every step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.runtime.engine.kv_cache import KVCache, gather_blocks


def dense_rows_fit(kv: KVCache, device: torch.device, attention: str, has_states: bool) -> bool:
    """Whether an engine with this cache decodes over `DenseRows` (see the module docstring)."""
    return device.type == "cpu" and attention == "torch" and not has_states and kv.data is not None and not kv.fp8


class DenseRows:
    """The dense k/v of rows 0..num_rows-1 (module docstring); `data` is
    (n_layers, 2, num_rows + 1, Hkv, max_blocks * block_size, D) in the cache's dtype, the last
    row a scratch row that pad rows write to."""

    def __init__(self, kv: KVCache, num_rows: int, max_blocks: int) -> None:
        self.kv = kv
        self.capacity = max_blocks * kv.block_size
        n_layers = kv.data.shape[0]
        self.num_rows = num_rows
        # One more row than the engine has: pad rows of a batch write their k/v there.
        self._shape = (n_layers, 2, num_rows + 1, kv.num_kv_heads, self.capacity, kv.head_dim)
        self.data = torch.zeros(self._shape, dtype=kv.data.dtype, device=kv.data.device)
        self._views: dict[int, tuple[Tensor, Tensor]] = {}  # layer id -> (k, v) views of data

    def release(self) -> int:
        """Free the storage (a sleeping engine) -> bytes freed; `restore` allocates it again."""
        freed = self.data.numel() * self.data.element_size()
        self.data = self.data.new_empty(0)
        self._views = {}
        return freed

    def restore(self) -> None:
        if self.data.numel() == 0:
            self.data = torch.zeros(self._shape, dtype=self.kv.data.dtype, device=self.kv.data.device)
            self._views = {}

    def refill(self, rows: list[int], tables: Tensor, num_blocks: int) -> None:
        """Copy the first num_blocks blocks of each row's device block table (tables (R, max_blocks)
        int32) from the paged cache into the rows' dense keys and values, every layer at once."""
        data, bs = self.kv.data, self.kv.block_size  # (n_layers, 2, Hkv, num_blocks, bs, D)
        index = torch.tensor(rows, dtype=torch.long)
        picked = data.index_select(3, tables[index, :num_blocks].reshape(-1).long())  # (nl, 2, Hkv, n * nb, bs, D)
        picked = picked.view(*data.shape[:3], len(rows), num_blocks * bs, data.shape[-1]).transpose(2, 3)
        self.data[:, :, index, :, :num_blocks * bs] = picked

    def layer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """(k, v) of one layer, each (num_rows, Hkv, Lcap, D), views of `data`."""
        views = self._views.get(layer_id)
        if views is None:
            i = self.kv.index[layer_id]
            views = self._views[layer_id] = (self.data[i, 0], self.data[i, 1])
        return views

    def check(self, row: int, table: list[int], length: int) -> None:
        """Assert that the row's dense keys and values of positions [0, length) are the paged cache's."""
        if length == 0:
            return
        nb = -(-length // self.kv.block_size)
        blocks = torch.tensor([table[:nb]])
        for layer_id in self.kv.index:
            dense = self.layer(layer_id)
            for cache, copy in zip(self.kv.layer(layer_id), dense):
                paged = gather_blocks(cache, blocks)[:, 0, :length]  # (Hkv, length, D)
                assert torch.equal(copy[row, :, :length], paged), f"row {row}: dense k/v differ from the paged cache"


class DenseDecode:
    """What one decode forward over rows [0, B) needs of `DenseRows`: where each row's new k/v
    goes, the mask of keys [0, L) each row sees, and the attention (module docstring).

    slots, positions (B, 1) long: each row's new cache slot (0: a pad row) and position; L: keys
    to attend over (>= every position + 1).
    """

    def __init__(self, rows: DenseRows, slots: Tensor, positions: Tensor, L: int) -> None:
        self.rows = rows
        B = positions.shape[0]
        Hkv, cap = rows.kv.num_kv_heads, rows.capacity
        # Flat index of (row b, head h, position p) in a layer's (rows * Hkv * Lcap, D) view;
        # pad rows go to the scratch row.
        row = torch.where(slots == 0, rows.num_rows, torch.arange(B)[:, None])  # (B, 1)
        self.index = ((row * Hkv + torch.arange(Hkv)[None, :]) * cap + positions).reshape(-1)
        self.masked = (torch.arange(L)[None, :] > positions)[:, None, None, :]  # (B, 1, 1, L): keys past the row
        self.L = L

    def write(self, layer_id: int, k: Tensor, v: Tensor) -> None:
        """Store this step's k/v (B, Hkv, 1, D) in the rows' dense copy (every layer, every step)."""
        k_rows, v_rows = self.rows.layer(layer_id)  # (num_rows, Hkv, Lcap, D)
        D = k_rows.shape[-1]
        k_rows.view(-1, D).index_copy_(0, self.index, k.reshape(-1, D))
        v_rows.view(-1, D).index_copy_(0, self.index, v.reshape(-1, D))

    def attend(self, layer_id: int, q: Tensor) -> Tensor:
        """q (B, Hq, 1, D) over the keys [0, L) of rows [0, B), this step's written -> (B, Hq, 1, D)."""
        k_rows, v_rows = self.rows.layer(layer_id)  # (num_rows, Hkv, Lcap, D)
        Hkv, D = k_rows.shape[1], k_rows.shape[-1]
        B, num_q_heads = q.shape[:2]
        keys = k_rows[:B, :, :self.L]  # (B, Hkv, L, D): a view, each (L, D) matrix contiguous
        values = v_rows[:B, :, :self.L]
        qg = q.reshape(B, Hkv, num_q_heads // Hkv, D)  # query head h = kv_head * group + j
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * D**-0.5  # (B, Hkv, group, L)
        weights = torch.softmax(scores.masked_fill_(self.masked, float("-inf")), dim=-1)
        out = torch.matmul(weights.to(values.dtype), values)  # (B, Hkv, group, D)
        return out.view(B, num_q_heads, 1, D)
