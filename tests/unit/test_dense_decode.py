"""CPU dense decode (runtime/engine/dense_decode.py): refilled rows equal the paged cache, and
attention over them equals the paged torch path, with pad rows that leave every real row alone."""

from __future__ import annotations

import torch

from meshrl.runtime.engine.dense_decode import DenseDecode, DenseRows
from meshrl.runtime.engine.kv_cache import KVCache, PagedAttention


def test_dense_decode_equals_paged_attention_and_pads_touch_no_row():
    torch.manual_seed(0)
    bs, max_blocks, Hkv, Hq, D, rows = 4, 3, 2, 4, 8, 3
    kv = KVCache([0, 1], num_blocks=10, block_size=bs, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32,
                 device=torch.device("cpu"))
    kv.data.normal_()
    dense = DenseRows(kv, rows, max_blocks)
    tables = torch.tensor([[3, 7, 0], [5, 1, 2], [9, 0, 0]], dtype=torch.int32)  # rows own scattered blocks
    positions = torch.tensor([[6], [9], [0]])  # row 2 is a pad this step (slot 0)
    slots = torch.tensor([[7 * bs + 2], [2 * bs + 1], [0]])
    dense.refill([0, 1], tables, 3)
    before = dense.data[:, :, 2].clone()

    q = torch.randn(3, Hq, 1, D)
    k, v = torch.randn(3, Hkv, 1, D), torch.randn(3, Hkv, 1, D)
    nb = 3
    paged = PagedAttention(kv, slots, positions, tables[:, :nb])
    with_dense = PagedAttention(kv, slots, positions, tables[:, :nb],
                                dense=DenseDecode(dense, slots, positions, nb * bs))
    kv_before = kv.data.clone()
    out_dense = with_dense.attend(1, q, k, v)
    kv.data.copy_(kv_before)
    out_paged = paged.attend(1, q, k, v)

    torch.testing.assert_close(out_dense[:2], out_paged[:2], rtol=1e-6, atol=1e-6)
    assert torch.equal(dense.data[:, :, 2], before)  # the pad wrote to the scratch row only
    for row in range(2):
        dense.check(row, tables[row].tolist(), int(positions[row]) + 1)  # this step's k/v in both copies
