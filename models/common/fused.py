"""Fused Triton kernels for the inference forward: RMSNorm, RoPE, SwiGLU's silu(a) * b.

A decode step of a small model is a chain of tiny kernels: eager RMSNorm alone is six (cast,
square, mean, add, rsqrt, scale) and RoPE ten, each reading and writing the activations. These
kernels do each in one pass with the same numerics as the eager modules (fp32 statistics,
products rounded to the activation dtype where the eager code rounds them), so their outputs
agree with eager up to the last bit of a reduction.

They are used only under `torch.inference_mode()` on a CUDA tensor with triton installed: the
native engine runs there; training, the trainer's no-grad passes and CPU runs keep the eager
code, so gradients and the trainer's logprobs never depend on these kernels. Agreement is not
bitwise: the reduction order, the compiler's exp/rsqrt and its fusing of a product into a sum
(RoPE) move results by about a bf16 spacing of the operands (measured on an H200; tests/unit/test_fused.py). MESHRL_FUSED=0
turns them off (to compare).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor


@functools.cache
def _triton_ok() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("MESHRL_FUSED", "1") != "0"


def use_fused(x: Tensor) -> bool:
    """Whether the fused kernels serve this activation (see the module docstring).

    False while compiling, asked first: compiled code is the trainer's, and on torch 2.11 dynamo
    breaks the graph on the inference-mode query, which on CUDA split every compiled block at each
    norm, RoPE and SwiGLU."""
    if torch.compiler.is_compiling():
        return False
    return x.is_cuda and torch.is_inference_mode_enabled() and _triton_ok()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm(x_ptr, w_ptr, out_ptr, rows, inner, stride_outer, stride_inner, stride_o, N, eps,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # row r of x is at (r // inner) * stride_outer + (r % inner) * stride_inner
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK)
        mask = (r < rows)[:, None] & (c < N)[None, :]
        x_rows = (r // inner).to(tl.int64) * stride_outer + (r % inner).to(tl.int64) * stride_inner
        x = tl.load(x_ptr + x_rows[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # eager casts back before the weight
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + r[:, None] * stride_o + c[None, :], (y * w[None, :]).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def rope(x_ptr, cos_ptr, sin_ptr, out_ptr, T, H, sxb, sxh, sxt, sob, soh, sot, scb, sct,
             HALF: tl.constexpr, H_PAD: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HALF)
        mask = (h < H)[:, None]
        xp = x_ptr + b * sxb + t * sxt + h[:, None] * sxh + d[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        cp = b * scb + t * sct + d
        c1 = tl.load(cos_ptr + cp).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + cp + HALF).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + cp).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + cp + HALF).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded as eager does.
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        op = out_ptr + b * sob + t * sot + h[:, None] * soh + d[None, :]
        tl.store(op, o1.to(dt), mask=mask)
        tl.store(op + HALF, o2.to(dt), mask=mask)

    @triton.jit
    def silu_mul(a_ptr, b_ptr, out_ptr, n, H, stride_a, stride_b, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        row, col = (i // H).to(tl.int64), i % H
        a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        tl.store(out_ptr + i, (s * b).to(dt), mask=mask)

    return rms_norm, rope, silu_mul


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with RMSNorm's numerics; weight in x's dtype -> a contiguous result.
    x needs a contiguous last dim and rows on at most two strides (read in place: the per-head
    q/k of a packed q/k/v projection, models/common/packed_projections.py); other layouts are copied first."""
    kernel = _kernels()[0]
    N = x.shape[-1]
    x3 = _two_level_rows(x)
    if x3 is None:
        x3 = x.contiguous().view(1, -1, N)
    outer, inner, _ = x3.shape
    rows = outer * inner
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    block = _pow2(N)
    rows_per = max(1, min(64, 4096 // block))
    kernel[(triton_cdiv(rows, rows_per),)](x3, weight, out, rows, inner, x3.stride(0), x3.stride(1), out.stride(0), N,
                                          eps, ROWS=rows_per, BLOCK=block, num_warps=4)
    return out.view(x.shape)


def _two_level_rows(x: Tensor) -> Tensor | None:
    """x (..., N) as an (outer, inner, N) view with a contiguous last dim, or None if its rows need
    more than two strides."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    sizes, strides = [], []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:  # merges with the dim before it
            sizes[-1], strides[-1] = sizes[-1] * size, stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > 2:
        return None
    sizes, strides = [1] * (2 - len(sizes)) + sizes, [0] * (2 - len(strides)) + strides
    return x.as_strided((*sizes, x.shape[-1]), (*strides, 1))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, D) any strides, cos/sin (B, T, D) -> x * cos + rotate_half(x) * sin, in x's layout."""
    kernel = _kernels()[1]
    B, H, T, D = x.shape
    out = torch.empty_like(x)  # keeps x's strides: (B, T, H, D) memory stays a free transpose
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel[(B * T,)](x, cos, sin, out, T, H, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
                     out.stride(2), cos.stride(0), cos.stride(1), HALF=D // 2, H_PAD=_pow2(H), num_warps=4)
    return out


def silu_mul(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b for same-shape a, b, rounded like the eager pair of ops -> contiguous. a and b
    may be row-strided views (the halves of a packed gate/up projection, models/common/packed_projections.py)."""
    kernel = _kernels()[2]
    H = a.shape[-1]
    a2, b2 = (t.reshape(-1, H) for t in (a, b))  # views for the packed halves
    if a2.stride(-1) != 1 or b2.stride(-1) != 1:
        a2, b2 = a2.contiguous(), b2.contiguous()
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n = a2.numel()
    kernel[(triton_cdiv(n, 1024),)](a2, b2, out, n, H, a2.stride(0), b2.stride(0), BLOCK=1024, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
