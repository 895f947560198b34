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
    """Whether the fused kernels serve this activation (see the module docstring)."""
    return x.is_cuda and torch.is_inference_mode_enabled() and _triton_ok()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm(x_ptr, w_ptr, out_ptr, rows, stride_x, stride_o, N, eps,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK)
        mask = (r < rows)[:, None] & (c < N)[None, :]
        x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
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
    def silu_mul(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        a = tl.load(a_ptr + i, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + i, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        tl.store(out_ptr + i, (s * b).to(dt), mask=mask)

    return rms_norm, rope, silu_mul


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with RMSNorm's numerics; weight in x's dtype."""
    kernel = _kernels()[0]
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    block = _pow2(N)
    rows_per = max(1, min(64, 4096 // block))
    kernel[(triton_cdiv(x2.shape[0], rows_per),)](x2, weight, out, x2.shape[0], x2.stride(0), out.stride(0), N, eps,
                                                 ROWS=rows_per, BLOCK=block, num_warps=4)
    return out.view(x.shape)


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
    """silu(a) * b for same-shape contiguous a, b, rounded like the eager pair of ops."""
    kernel = _kernels()[2]
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    kernel[(triton_cdiv(n, 1024),)](a, b, out, n, BLOCK=1024, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
