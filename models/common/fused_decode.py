"""Fewer kernels per layer in the engine's forward: Triton kernels that each replace a chain of launches.

A small-batch decode step is bound by its launches (an H200's 0.6B step at 8 sequences ran 18
kernels per layer, docs/benchmarks.md). These kernels fold neighbours into one launch:

- `qk_norm_rope`: Qwen3's per-head q_norm and k_norm and RoPE of q and k (4 launches -> 1),
  read straight from the q/k views of the packed q/k/v projection (models/common/gqa.py).
- `add_rms_norm`: a residual add and the RMSNorm after it, h = x + y, n = rmsnorm(h) (2 -> 1),
  both returned (`RMSNorm.add_forward`): the post-attention norm of the Qwen3 and Llama blocks, and,
  through `forward_pending` in `DecoderLM.hidden`, a block's last residual add carried into the
  next block's input norm (the last one into the final norm).
- the engine's k and v cache write in one launch (runtime/engine/kernels.py `kv_write`, 2 -> 1).

Each keeps the eager math: RMSNorm's fp32 statistic, the cast back to the activation dtype before
the weight (models/common/norm.py), RoPE's products rounded to the activation dtype before their
sum and the rotate-half layout with partial rotary (models/common/rope.py), the bf16 residual sum
rounded before the norm. Results agree with eager up to the order of the fp32 reduction and the
compiler's rsqrt (tests/unit/test_fused_decode.py).

One switch for all three, MESHRL_FUSED_DECODE: unset, they serve CUDA bf16/fp16 activations
under `torch.inference_mode()` with triton installed (and MESHRL_FUSED not 0); =0 turns them off
(to compare); =1 forces them under inference mode on CUDA in any dtype, and on the CPU where
TRITON_INTERPRET=1 (the tests). Training and the trainer's no-grad passes never take them (not inference
mode), so gradients never depend on them. No kernel syncs with the host or has a data-dependent
shape: they run under CUDA graph capture.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from meshrl.models.common.fused import _pow2, _triton_ok, triton_cdiv

_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def enabled(x: Tensor) -> bool:
    """Whether the decode fusions serve this activation (module docstring)."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return False  # compiled code is the trainer's (and dynamo would break its graph on the mode query)
    forced = os.environ.get("MESHRL_FUSED_DECODE")
    if forced in ("0", "1"):  # forced on: CUDA, or the CPU where triton interprets (never meta tensors)
        runs = x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
        return forced == "1" and runs and _triton_importable()
    return x.is_cuda and x.dtype in _DTYPES and _triton_ok()


@functools.cache
def _kernels():
    """The Triton kernels, defined and jitted on first use: importing this module never needs triton."""
    return _qk_norm_rope_kernel(), _add_rms_norm_kernel()


def _qk_norm_rope_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, Hq,
                     sqb, sqt, sqh, skb, skt, skh, sob, sot, soh, skob, skot, skoh, scb, sct, eps,
                     D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr,
                     REST_PAD: tl.constexpr):
        # program (token, head): heads [0, Hq) are q's, [Hq, Hq + Hkv) k's; one head vector of D
        token = tl.program_id(0)
        head = tl.program_id(1)
        b = token // T
        t = token % T
        if head < Hq:
            src = q_ptr + b * sqb + t * sqt + head * sqh
            dst = qo_ptr + b * sob + t * sot + head * soh
            w_ptr = qw_ptr
        else:
            src = k_ptr + b * skb + t * skt + (head - Hq) * skh
            dst = ko_ptr + b * skob + t * skot + (head - Hq) * skoh
            w_ptr = kw_ptr
        dt = qo_ptr.dtype.element_ty
        d = tl.arange(0, HALF_PAD)
        m = d < HALF
        x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if REST > 0:  # partial rotary: dims [2 * HALF, D) pass through RoPE
            r = tl.arange(0, REST_PAD)
            mr = r < REST
            x3 = tl.load(src + 2 * HALF + r, mask=mr, other=0.0).to(tl.float32)
            ss += tl.sum(x3 * x3, axis=0)
        inv = tl.rsqrt(ss / D + eps)
        # RMSNorm: normalise in fp32, cast to the activation dtype, then times the weight (rounded)
        n1 = ((x1 * inv).to(dt).to(tl.float32) * tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)).to(dt)
        n2 = ((x2 * inv).to(dt).to(tl.float32)
              * tl.load(w_ptr + HALF + d, mask=m, other=0.0).to(tl.float32)).to(dt)
        n1 = n1.to(tl.float32)
        n2 = n2.to(tl.float32)
        cp = b * scb + t * sct + d
        c1 = tl.load(cos_ptr + cp, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cp + HALF, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cp, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cp + HALF, mask=m, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded as eager does
        o1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
        o2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
        tl.store(dst + d, o1.to(dt), mask=m)
        tl.store(dst + HALF + d, o2.to(dt), mask=m)
        if REST > 0:
            w3 = tl.load(w_ptr + 2 * HALF + r, mask=mr, other=0.0).to(tl.float32)
            tl.store(dst + 2 * HALF + r, ((x3 * inv).to(dt).to(tl.float32) * w3).to(dt), mask=mr)

    return qk_norm_rope


def _add_rms_norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(x_ptr, y_ptr, w_ptr, h_ptr, n_ptr, rows, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK)
        mask = (r < rows)[:, None] & (c < N)[None, :]
        off = r.to(tl.int64)[:, None] * N + c[None, :]
        dt = h_ptr.dtype.element_ty
        h = (tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
             + tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(h_ptr + off, h, mask=mask)
        hf = h.to(tl.float32)
        y = hf * tl.rsqrt(tl.sum(hf * hf, axis=1) / N + eps)[:, None]
        y = y.to(dt).to(tl.float32)  # eager casts back before the weight
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(n_ptr + off, (y * w[None, :]).to(dt), mask=mask)

    return add_rms_norm


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """q (B, T, Hq, D), k (B, T, Hkv, D) with contiguous last dims (any other strides: the views of a
    packed q/k/v output), RMSNorm weights (D,), cos/sin (B, T, R), R even and <= D ->
    apply_rope(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin): q (B, Hq, T, D)
    and k (B, Hkv, T, D), transposed views of new (B, T, H, D) tensors (what apply_rope returns)."""
    kernel = _kernels()[0]
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    R = cos.shape[-1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and R % 2 == 0 and R <= D
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, Hkv, D), dtype=k.dtype, device=k.device)
    rest = D - R
    kernel[(B * T, Hq + Hkv)](q, k, q_weight, k_weight, cos, sin, qo, ko, T, Hq, q.stride(0), q.stride(1),
                              q.stride(2), k.stride(0), k.stride(1), k.stride(2), qo.stride(0), qo.stride(1),
                              qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), cos.stride(0), cos.stride(1),
                              eps, D=D, HALF=R // 2, HALF_PAD=_pow2(R // 2), REST=rest,
                              REST_PAD=_pow2(rest) if rest else 1, num_warps=1)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """h = x + y, n = RMSNorm(h) over the last dim (weight in x's dtype) in one pass -> (h, n), both
    contiguous in x's shape."""
    kernel = _kernels()[1]
    N = x.shape[-1]
    x2, y2 = x.reshape(-1, N).contiguous(), y.reshape(-1, N).contiguous()
    rows = x2.shape[0]
    h, n = torch.empty_like(x2), torch.empty_like(x2)
    block = _pow2(N)
    rows_per = max(1, min(64, 4096 // block))
    kernel[(triton_cdiv(rows, rows_per),)](x2, y2, weight, h, n, rows, N, eps, ROWS=rows_per, BLOCK=block,
                                          num_warps=4)
    return h.view(x.shape), n.view(x.shape)
