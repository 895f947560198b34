"""Triton kernels for the element-wise part of the chunked logprob head (runtime/train/logprob_head.py).

Per chunk the torch path makes ~10 full passes over fp32 (n, V) tensors around its two matmuls
(cast, divide, logsumexp, gather, exp, multiply, sum; in backward exp, scatter, scale, cast): at
V = 151936 and 16k tokens that was ~60 of 274 ms of GPU time in a 0.6B step (docs/benchmarks.md).
These two kernels read the input-dtype logits of `hidden @ weight.T` (cuBLAS, unchanged) instead:

- `forward_stats`: one pass per row, fp32 throughout: z = logits * (1 / T), lse = logsumexp(z)
  (online over V: per-lane running max, sum of exp and sum of exp * z, merged at the end),
  logprob = z[target] - lse, entropy = lse - sum_v softmax(z)_v z_v. Writes three (n,) vectors,
  no (n, V) tensor.
- `dlogits_`: dlogits = (onehot(target) - exp(z - lse)) * grad * (1 / T), rounded to the logits'
  dtype and written over the logits buffer in place; the two backward matmuls follow as before.

The math is the torch path's (z scaled by the fp32 reciprocal of T, as torch's CUDA division by a
scalar does); results differ from it by the reduction order and the compiler's exp/log: ~1e-6 in
the logprobs, the entropy within the torch path's own cancellation error (~1e-5 at |lse| ~ 16;
ours is closer to the fp64 value), dlogits by at most one spacing of their dtype
(tests/unit/test_logprob_kernels.py).

Why here and not in models/common: the kernels serve only the trainer's logprob head (this room,
layer 3 of tests/unit/test_layout_rules.py); models/common holds model building blocks that the
engine uses too, and the engine's sampler reads full logits with its own kernels
(runtime/engine/). Only `triton_cdiv` comes from models/common/fused.py, which this layer may import.

Switch, MESHRL_FUSED_LOGPROBS: unset, the kernels serve CUDA logits (bf16, fp16 or fp32) when
triton is installed and MESHRL_FUSED (every fused kernel's switch) is not 0; =0 keeps the torch
path (the reference; CPU always uses it unless forced); =1 forces them on CUDA and, with TRITON_INTERPRET=1, on the CPU (the tests); never on other devices
(meta tensors keep the torch path).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from meshrl.models.common.fused import triton_cdiv

__all__ = ["enabled", "forward_stats", "dlogits_"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Columns per program step. Forward: one program per row loops over V in these blocks (16
# elements a thread at 8 warps: two 16-byte bf16 loads); backward: one program per block.
_BLOCK_FWD, _BLOCK_BWD, _WARPS = 4096, 4096, 8


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def enabled(x: Tensor) -> bool:
    """Whether the chunked head's element-wise work runs in these kernels for logits like `x` (module docstring)."""
    if x.dtype not in _DTYPES:
        return False
    forced = os.environ.get("MESHRL_FUSED_LOGPROBS")
    if forced in ("0", "1"):  # forced on: CUDA, or the CPU where triton interprets (never meta tensors)
        runs = x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
        return forced == "1" and runs and _triton_importable()
    return x.is_cuda and os.environ.get("MESHRL_FUSED", "1") != "0" and _triton_importable()


def _inv(temperature: float) -> float:
    """1 / T rounded as fp32 arithmetic rounds it (torch's CUDA division by a scalar multiplies by this)."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(temperature, dtype=torch.float32))


@functools.cache
def _kernels():
    """The Triton kernels, jitted on first use: importing this module never needs triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def stats(logits_ptr, targets_ptr, lse_ptr, logprob_ptr, entropy_ptr, V, stride, inv_t,
              BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max of z
        s = tl.zeros([BLOCK], dtype=tl.float32)  # sum exp(z - m)
        t = tl.zeros([BLOCK], dtype=tl.float32)  # sum exp(z - m) * z
        for start in range(0, V, BLOCK):
            c = start + cols
            mask = c < V
            z = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, z)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only padding
            alpha = tl.exp(m - shift)
            e = tl.exp(z - shift)
            s = s * alpha + e
            t = t * alpha + e * tl.where(mask, z, 0.0)  # padding: e = 0, z = -inf
            m = m_new
        big = tl.max(m, axis=0)
        scale = tl.exp(m - big)
        total = tl.sum(s * scale, axis=0)
        lse = big + tl.log(total)
        target = tl.load(targets_ptr + row)
        zt = tl.load(base + target).to(tl.float32) * inv_t
        tl.store(lse_ptr + row, lse)
        tl.store(logprob_ptr + row, zt - lse)
        tl.store(entropy_ptr + row, lse - tl.sum(t * scale, axis=0) / total)

    @triton.jit
    def dlogits(logits_ptr, targets_ptr, lse_ptr, grad_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < V
        ptr = logits_ptr + row.to(tl.int64) * stride + c
        z = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(z - tl.load(lse_ptr + row))
        d = tl.where(c == tl.load(targets_ptr + row), 1.0 - p, -p) * (tl.load(grad_ptr + row) * inv_t)
        tl.store(ptr, d.to(logits_ptr.dtype.element_ty), mask=mask)

    return stats, dlogits


def _check(logits: Tensor, targets: Tensor, *vectors: Tensor) -> None:
    n = logits.shape[0]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits need (n, V) rows with a contiguous last dim"
    assert targets.shape == (n,) and targets.is_contiguous()
    assert all(v.shape == (n,) and v.dtype == torch.float32 and v.is_contiguous() for v in vectors)


def forward_stats(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor, logprobs: Tensor,
                  entropy: Tensor) -> None:
    """Fill lse, logprobs, entropy, each (n,) fp32, from logits (n, V) and targets (n,) int64."""
    _check(logits, targets, lse, logprobs, entropy)
    if logits.shape[0] == 0:
        return
    stats = _kernels()[0]
    stats[(logits.shape[0],)](logits, targets, lse, logprobs, entropy, logits.shape[1], logits.stride(0),
                              _inv(temperature), BLOCK=_BLOCK_FWD, num_warps=_WARPS)


def dlogits_(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """Overwrite logits (n, V) with d(sum grad * logprob) / d logits in their dtype; returns logits.
    targets (n,) int64, lse and grad (n,) fp32 (lse from `forward_stats` at the same temperature)."""
    _check(logits, targets, lse, grad)
    if logits.shape[0] == 0:
        return logits
    kernel = _kernels()[1]
    n, V = logits.shape
    kernel[(n, triton_cdiv(V, _BLOCK_BWD))](logits, targets, lse, grad, V, logits.stride(0), _inv(temperature),
                                            BLOCK=_BLOCK_BWD, num_warps=_WARPS)
    return logits
