"""GPU matmuls for FP8 block-scaled weights (models/common/fp8.py's format); triton imported on first use.

`block_fp8_linear(x, w8, scale_inv)`: one Triton kernel. Program (m, n) owns a BM x BN tile of
the output and walks K in slices of 128 (the scale groups): it loads the slice of x (bf16),
quantises it in registers to e4m3 with one scale per row (the 1x128 recipe, the same formula as
`fp8.quantize_groups`), multiplies it with the e4m3 weight slice on FP8 tensor cores and adds the
product times (row scale x weight block scale) to an fp32 accumulator (per-128 promotion, as
DeepSeek-V3's recipe). Every n-program re-quantises its rows of x: x is small in decode (rows =
sequences) and this saves a kernel launch and a round trip of x8 through memory per linear.
Tile sizes follow the row count (`_config`): decode batches of 16-512 rows need enough programs
to fill the SMs with narrow weights (N = 1024 for k/v projections).

`scaled_mm_linear`: a Triton kernel quantises x (x8 and outer-dim-major scales, as cuBLAS wants
them), then `torch._scaled_mm` with BlockWise1x128 x BlockWise128x128 scales (CUDA >= 12.9, sm90).

Both are checked against `fp8.emulated_linear` (tests/unit/test_fp8.py, marked gpu). Measured on
one H200 (2026-12-01, docs/benchmarks.md) at the Qwen3-8B shapes, one decoder layer's seven
linears: bf16 173 / 282 us at 256 / 512 rows, `scaled_mm_linear` 168 / 213 us, this Triton kernel
751 / 758 us (its best tile per shape ~2.5x bf16). So the engine uses `scaled_mm_linear` on sm90
(fp8.hardware_backend) and the Triton kernel on sm89 and for the weight shapes cuBLAS refuses or
computes wrong (`cublas_is_right`).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

BLOCK = 128  # = fp8.BLOCK (not imported: fp8 imports this module)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
             HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        # Grouped order: GROUP_M row tiles sweep the same weight columns together (L2 reuse).
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_mask = rm < M
        n_mask = rn < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        ws_ptrs = ws_ptr + (rn // BK) * stride_wsn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k_mask = rk < K - kb * BK
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            xs = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
            x8 = tl.clamp(x / xs[:, None], -448.0, 448.0).to(tl.float8e4nv)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            ws = tl.load(ws_ptrs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(x8, w) * (xs[:, None] * ws[None, :])
            x_ptrs += BK
            w_ptrs += BK
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def quant(x_ptr, q_ptr, s_ptr, M, Mp, K, stride_xm, stride_qm, stride_sm, stride_sk,
              G: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        c = kb * G + tl.arange(0, G)
        mask = (r < M)[:, None] & (c < K)[None, :]
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_xm + c[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        q = tl.clamp(x / s[:, None], -448.0, 448.0).to(tl.float8e4nv)
        out_mask = (r < Mp)[:, None] & (c < K)[None, :]  # padding rows (M <= r < Mp) get zeros
        tl.store(q_ptr + r[:, None].to(tl.int64) * stride_qm + c[None, :], q, mask=out_mask)
        tl.store(s_ptr + r * stride_sm + kb * stride_sk, s, mask=r < Mp)

    return gemm, quant


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# (BM, BN, num_warps, num_stages) by row count; overridable for the benchmark's sweep.
CONFIGS: dict[str, tuple[int, int, int, int]] = {"small": (16, 64, 4, 4), "mid": (32, 64, 4, 4),
                                                 "large": (64, 128, 4, 3), "prefill": (128, 128, 8, 3)}


def _config(M: int, N: int, device: torch.device) -> tuple[int, int, int, int]:
    if M <= 16:
        return CONFIGS["small"]
    if M <= 64:
        return CONFIGS["mid"]
    if M <= 512:
        bm, bn, warps, stages = CONFIGS["large"]
        # narrow weights: halve the column tile so the grid still covers the SMs
        if (M + bm - 1) // bm * ((N + bn - 1) // bn) < _multiprocessors(device):
            return CONFIGS["mid"]
        return bm, bn, warps, stages
    return CONFIGS["prefill"]


def block_fp8_linear(x: Tensor, w8: Tensor, scale_inv: Tensor, bias: Tensor | None = None,
                     config: tuple[int, int, int, int] | None = None) -> Tensor:
    """x (M, K) bf16/fp16 contiguous rows, w8 (N, K) e4m3, scale_inv (ceil(N/128), ceil(K/128)) -> (M, N) in x's dtype."""
    gemm, _ = _kernels()
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w8.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, warps, stages = config or _config(M, N, x.device)
    grid = (((M + bm - 1) // bm) * ((N + bn - 1) // bn),)
    gemm[grid](x, w8, scale_inv, bias if bias is not None else out, out, M, N, K, x.stride(0), w8.stride(0),
               scale_inv.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=BLOCK, GROUP_M=8,
               num_warps=warps, num_stages=stages)
    return out


def quantize_act(x: Tensor, pad_rows: int = 1) -> tuple[Tensor, Tensor]:
    """x (M, K) -> (x8 (Mp, K) e4m3, scales (Mp, ceil(K/128)) fp32 with strides (1, Mp)), one launch;
    Mp = M rounded up to `pad_rows` (the padding rows are zeros)."""
    _, quant = _kernels()
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    Mp = -(-M // pad_rows) * pad_rows
    kb = (K + BLOCK - 1) // BLOCK
    q = torch.empty((Mp, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((kb, Mp), dtype=torch.float32, device=x.device).t()  # outer-dim-major
    rows = 16
    quant[((Mp + rows - 1) // rows, kb)](x, q, s, M, Mp, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                         G=BLOCK, ROWS=rows, num_warps=4)
    return q, s


_UNSUPPORTED: set[tuple[int, int, int]] = set()  # (M, N, K) that cuBLAS refused: Triton serves them
_CUBLAS_RIGHT: dict[tuple[int, int, int | None], bool] = {}  # (N, K, device) -> probe result
log = logging.getLogger("meshrl.fp8")


def _probe_cublas(N: int, K: int, device: torch.device) -> bool:
    """Whether `torch._scaled_mm`'s blockwise path computes an (N, K) weight right: one small
    product of random operands (a private generator: the global RNG is left alone) against the
    Triton kernel. On an H200 (torch 2.11, CUDA 13, 2026-12-01) it returned garbage (errors of
    25x to 1e36 the output) for every N whose count of 128-blocks is neither 1 nor a multiple of
    4 (N = 256, 384, 640, 768), for any K and M, with no error raised."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, K, device=device, dtype=torch.bfloat16, generator=g)
    w8 = (torch.randn(N, K, device=device, generator=g) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // BLOCK), -(-K // BLOCK), device=device, generator=g) + 0.5
    ref = block_fp8_linear(x, w8, scale).float()
    try:
        out = _scaled_mm(x, w8, scale).float()
    except RuntimeError:
        return False
    return bool(((out - ref).abs().max() <= 2e-2 * ref.abs().max()).item())


def cublas_is_right(N: int, K: int, device: torch.device) -> bool:
    """`_probe_cublas` once per weight shape and device. During CUDA graph capture (no probe
    possible) an unprobed shape falls back to the rule measured on the H200: the count of
    128-blocks along N is 1 or a multiple of 4."""
    key = (N, K, device.index)
    if key not in _CUBLAS_RIGHT:
        if torch.cuda.is_current_stream_capturing():
            return N // BLOCK == 1 or (N // BLOCK) % 4 == 0
        _CUBLAS_RIGHT[key] = _probe_cublas(N, K, device)
        if not _CUBLAS_RIGHT[key]:
            log.info("FP8: torch._scaled_mm's blockwise path is wrong or refused for %dx%d weights on this GPU; "
                     "the Triton FP8 kernel serves them", N, K)
    return _CUBLAS_RIGHT[key]


def _scaled_mm(x: Tensor, w8: Tensor, scale_inv: Tensor) -> Tensor:
    x8, xs = quantize_act(x, pad_rows=4)
    return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=scale_inv.t(), out_dtype=x.dtype)[:x.shape[0]]


def scaled_mm_linear(x: Tensor, w8: Tensor, scale_inv: Tensor, bias: Tensor | None = None) -> Tensor:
    """As `block_fp8_linear`, through `torch._scaled_mm` (BlockWise1x128 x BlockWise128x128).

    Rows are padded to a multiple of 4 (the outer-dim-major activation scales then have a 16-byte
    aligned stride; on an H200 cuBLAS refused M = 1 and 7 unpadded, 2026-12-01). A weight shape
    that cuBLAS computes wrong (`cublas_is_right`, probed once per shape) and a shape it refuses
    (CUBLAS_STATUS_NOT_SUPPORTED, raised on the host before any launch) go to the Triton kernel
    from then on; engines meet every decode shape once before capturing graphs."""
    M, K = x.shape
    N = w8.shape[0]
    if (M, N, K) in _UNSUPPORTED or not cublas_is_right(N, K, x.device):
        return block_fp8_linear(x, w8, scale_inv, bias)
    try:
        out = _scaled_mm(x, w8, scale_inv)
    except RuntimeError as e:
        if "NOT_SUPPORTED" not in str(e):
            raise
        _UNSUPPORTED.add((M, N, K))
        return block_fp8_linear(x, w8, scale_inv, bias)
    return out if bias is None else out.add_(bias)
