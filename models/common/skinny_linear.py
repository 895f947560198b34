"""A matmul for the few rows of a small decode batch: y = x @ W^T with x of at most 64 rows.

At 8 sequences a decode step's four projections per layer read every weight once for a handful of
rows, and cuBLAS ran them at a fraction of the HBM bandwidth (docs/benchmarks.md, 2026-12-02
evening: ~0.63 ms of a 0.6B step against ~0.18 ms to read the weights). This kernel streams W
once: each program owns BN output columns and walks K in BK chunks, multiplying the (rows, BK)
activations by the (BN, BK) weight tile in fp32 (a broadcast product and a sum for up to 16 rows,
`tl.dot` for more) and rounds once into the output dtype, as cuBLAS's fp32 accumulation does.

`linear(x, weight, bias)` takes `nn.Linear`'s layout (weight (N, K), row-major). Settings per row
bucket come from `benchmarks/gpu/skinny_linear_sweep.py`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from meshrl.models.common.fused import _pow2, triton_cdiv


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.arange(0, M_PAD)
        n_ok = n < N
        m_ok = m < M
        acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            if EVEN_K:
                xk = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=m_ok[:, None], other=0.0)
                wk = tl.load(w_ptr + n[:, None].to(tl.int64) * swn + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = k < K
                xk = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wk = tl.load(w_ptr + n[:, None].to(tl.int64) * swn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                             other=0.0)
            if DOT:
                acc = tl.dot(xk, tl.trans(wk), acc)
            else:
                acc += tl.sum(xk[:, None, :].to(tl.float32) * wk[None, :, :].to(tl.float32), axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * sym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return skinny


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, bn: int = 8, bk: int = 128, warps: int = 4,
           stages: int = 3, dot: bool | None = None) -> Tensor:
    """x (..., K) with at most 64 rows in all, weight (N, K) -> (..., N) in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], weight.shape[0]
    assert M <= 64 and weight.shape[1] == K and weight.stride(-1) == 1
    m_pad = max(1, _pow2(M))
    dot = m_pad >= 16 if dot is None else dot
    if dot:
        m_pad = max(m_pad, 16)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _kernel()[(triton_cdiv(N, bn),)](x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0),
                                     weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, M_PAD=m_pad, BN=bn,
                                     BK=bk, DOT=dot, EVEN_K=K % bk == 0, num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], N)
