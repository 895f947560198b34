"""Triton kernels of the native engine (GPU; they also run under TRITON_INTERPRET=1 on CPU):
paged decode attention and the sampler's one pass over the logits (`chunk_stats`).

Paged decode attention (`paged_decode_attention`): one new query token per row attends over
that row's cached keys, read straight from the paged cache by block table (no gather copy).

    grid (rows, kv heads, splits); program (r, h, s) owns the query heads of kv head h (the GQA
    group, padded to 16 rows so both products run on tensor cores) and the key range
    [s * span, (s + 1) * span) of row r, in tiles of TILE keys, where span is row r's own length
    over the split count rounded up to whole tiles (so a row's splits share its keys evenly, at
    every length, and those past its last tile do nothing).
    A tile may span several cache blocks: each key's block comes from the table, so the tile
    size does not depend on block_size.

An FP8 cache (e4m3 keys and values with one fp32 scale per key and head) is read as e4m3 and
widened in registers: the key scale multiplies the key's score, the value scale its softmax
weight, so the products still run in q's dtype on tensor cores and the cache bytes halve.

Decode is bound by reading the cache, so what matters is keeping enough loads in flight: enough
programs to fill the SMs, each with its next tile's loads issued while it computes on this one.
With many rows (a full decode batch) one split per row suffices; with few rows and long contexts
the key range is split (flash-decoding) and a second kernel merges the splits' partial softmax
states. The split count is a function of (rows, table width) only, so a CUDA graph captured for
a batch shape stays valid as the rows grow.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
from torch import Tensor

# The decode kernel's launch settings, from a sweep on an H200 (docs/benchmarks.md, 2026-12-02
# evening: tiles 32/64/128 x warps 2/4/8 x stages 1/2/3 x 4/8/16 programs per SM over eight
# (rows, context) shapes of the engine matrix): the best overall, 0.6B shape (16 q / 8 kv heads,
# head dim 128). Small tiles in two warps keep more tiles in flight per SM.
TILE = 32  # keys per tile
_MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows
_PROGRAMS_PER_SM = 4  # decode programs (row, kv head, split) wanted per SM
_DECODE_WARPS, _DECODE_STAGES = 2, 2


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """The Triton kernels (decode, merge, chunk_stats, fp8 write, kv write), defined and jitted on
    first use: importing this module never needs triton. Callers index the tuple."""
    return (_decode_kernel(), _merge_kernel(), _chunk_stats_kernel(), _fp8_write_kernel(), _kv_write_kernel())


def _kv_write_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kv_write(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, T, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                 stride_vt, stride_cs, stride_ch, D: tl.constexpr, D_PAD: tl.constexpr):
        token = tl.program_id(0)  # b * T + t
        head = tl.program_id(1)
        b = token // T
        t = token % T
        slot = tl.load(slot_ptr + token).to(tl.int64)
        d = tl.arange(0, D_PAD)
        m = d < D
        k = tl.load(k_ptr + b * stride_kb + head * stride_kh + t * stride_kt + d, mask=m)
        v = tl.load(v_ptr + b * stride_vb + head * stride_vh + t * stride_vt + d, mask=m)
        dst = head * stride_ch + slot * stride_cs + d
        tl.store(kc_ptr + dst, k, mask=m)
        tl.store(vc_ptr + dst, v, mask=m)

    return kv_write


def _fp8_write_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_write(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, T,
                  stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                  stride_cs, stride_ch, stride_ss, stride_sh, D: tl.constexpr):
        token = tl.program_id(0)  # b * T + t
        head = tl.program_id(1)
        b = token // T
        t = token % T
        slot = tl.load(slot_ptr + token).to(tl.int64)
        d = tl.arange(0, D)
        k = tl.load(k_ptr + b * stride_kb + head * stride_kh + t * stride_kt + d).to(tl.float32)
        v = tl.load(v_ptr + b * stride_vb + head * stride_vh + t * stride_vt + d).to(tl.float32)
        k_scale = tl.maximum(tl.max(tl.abs(k), axis=0), 1e-12) / 448.0
        v_scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / 448.0
        dst = head * stride_ch + slot * stride_cs + d
        tl.store(kc_ptr + dst, tl.clamp(k / k_scale, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(vc_ptr + dst, tl.clamp(v / v_scale, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(ks_ptr + head * stride_sh + slot * stride_ss, k_scale)
        tl.store(vs_ptr + head * stride_sh + slot * stride_ss, v_scale)

    return fp8_write


def fp8_kv_write(k: Tensor, v: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor, k_scales: Tensor,
                 v_scales: Tensor) -> None:
    """Quantise one layer's new k/v (B, Hkv, T, D) per (token, head) into an FP8 cache at the flat
    slots (B * T,) and store their scales: one launch (the torch path is ~8 kernels per tensor).
    Caches (num_blocks, bs, Hkv, D) e4m3 and scales (num_blocks, bs, Hkv) fp32, head-major views."""
    kernel = _kernels()[3]
    B, H, T, D = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    bs = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == bs * k_cache.stride(1)
    assert k_scales.stride() == v_scales.stride() and k_scales.stride(0) == bs * k_scales.stride(1)
    kernel[(B * T, H)](k, v, slots, k_cache, v_cache, k_scales, v_scales, T, k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), k_cache.stride(1), k_cache.stride(2),
                       k_scales.stride(1), k_scales.stride(2), D=D, num_warps=1)


def kv_write(k: Tensor, v: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Store one layer's new k and v (B, Hkv, T, D), any strides with a contiguous last dim, at the
    flat slots (B * T,) of a cache in their dtype: one launch for what `write_slots` does in two
    index_copy_ (and their copies). Caches (num_blocks, bs, Hkv, D), views of one head-major storage
    (KVCache.layer); the caller checks the shapes (kv_cache.check_fits)."""
    kernel = _kernels()[4]
    B, H, T, D = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    bs = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == bs * k_cache.stride(1)
    assert k_cache.stride(3) == 1 and k_cache.dtype == k.dtype == v.dtype == v_cache.dtype
    kernel[(B * T, H)](k, v, slots, k_cache, v_cache, T, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                       v.stride(1), v.stride(2), k_cache.stride(1), k_cache.stride(2), D=D,
                       D_PAD=1 << (D - 1).bit_length(), num_warps=1)


def _decode_kernel():
    import triton
    import triton.language

    global tl
    tl = triton.language  # what the module-level kernel below reads
    return triton.jit(_paged_decode)


# triton.language, bound by _decode_kernel on first use (importing this module never needs triton).
# The decode kernel is a module-level function so that its annotations can name tl.constexpr.
tl = None


def _paged_decode(q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, out_ptr, m_ptr, l_ptr, ks_ptr, vs_ptr,
                  stride_qb, stride_qh, stride_kb, stride_kp, stride_kh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_sb, stride_sp, stride_sh, scale,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                  D: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + row)
    span = tl.cdiv(tl.cdiv(ctx, tl.num_programs(2)), TILE) * TILE  # the row's keys in equal whole tiles
    start = split * span
    end = tl.minimum(ctx, start + span)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, TILE)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None],
                other=0.0)  # (G, D)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for i in range(0, tl.cdiv(end - start, TILE)):
        t = start + i * TILE + n
        t_mask = t < end
        block = tl.load(table_ptr + row * stride_tb + t // BS, mask=t_mask, other=0).to(tl.int64)
        offs = block[:, None] * stride_kb + (t % BS)[:, None] * stride_kp + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offs, mask=t_mask[:, None], other=0.0)  # (TILE, D)
        if FP8:  # e4m3 keys and values, one scale per key: widened in registers
            s_offs = block * stride_sb + (t % BS) * stride_sp + kv_head * stride_sh
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if FP8:  # the key's scale multiplies its score
            s = s * tl.load(ks_ptr + s_offs, mask=t_mask, other=0.0)[None, :]
        s = tl.where(t_mask[None, :], s * scale, float("-inf"))  # (G, TILE)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offs, mask=t_mask[:, None], other=0.0)
        denom = denom * alpha + tl.sum(p, axis=1)
        if FP8:  # the value scale folds into the weights: sum_t p_t s_t v8_t
            v = v.to(q.dtype)
            p = p * tl.load(vs_ptr + s_offs, mask=t_mask, other=0.0)[None, :]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SPLIT:  # partial state of this key range: unnormalised output, running max and sum
        base = row * stride_mb + heads * stride_mh + split
        tl.store(m_ptr + base, m, mask=g_mask)
        tl.store(l_ptr + base, denom, mask=g_mask)
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], acc,
                 mask=g_mask[:, None])
    else:
        out = acc / denom[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def _merge_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge(part_ptr, m_ptr, l_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_mb, stride_mh,
              stride_ob, stride_oh, S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        s_mask = s < S
        m = tl.load(m_ptr + row * stride_mb + head * stride_mh + s, mask=s_mask, other=float("-inf"))
        denom = tl.load(l_ptr + row * stride_mb + head * stride_mh + s, mask=s_mask, other=0.0)
        weight = tl.exp(m - tl.max(m, axis=0))  # splits past the row's length hold m = -inf: weight 0
        part = tl.load(part_ptr + row * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                       mask=s_mask[:, None], other=0.0)
        out = tl.sum(part * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    return merge


def _chunk_stats_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_stats(x_ptr, div_ptr, max_ptr, sum_ptr, arg_ptr, V, stride_x, n_chunks, C: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        i = chunk * C + tl.arange(0, C)
        x = tl.load(x_ptr + row * stride_x + i, mask=i < V, other=float("-inf")).to(tl.float32)
        x = x / tl.load(div_ptr + row)
        m = tl.max(x, axis=0)
        out = row * n_chunks + chunk
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - m), axis=0))
        tl.store(arg_ptr + out, tl.argmax(x, axis=0).to(tl.int64))  # first index of the max

    return chunk_stats


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Key-range splits per (row, kv head): enough programs for `_PROGRAMS_PER_SM` per SM, at most
    one tile each. A function of the batch and the table width only (not of the rows' lengths: each
    program cuts its own row's keys), so a CUDA graph captured for a batch shape stays valid."""
    sms = _multiprocessors(device) if device.type == "cuda" else 8
    wanted = math.ceil(_PROGRAMS_PER_SM * sms / (batch * num_kv_heads))
    return max(1, min(wanted, math.ceil(max_len / TILE)))


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, context_lens: Tensor,
                           splits: int | None = None, k_scales: Tensor | None = None,
                           v_scales: Tensor | None = None) -> Tensor:
    """One new token per row over the paged cache. q (B, Hq, 1, D); k_cache/v_cache
    (num_blocks, block_size, Hkv, D); tables (B, nb) int32 covering every row's keys;
    context_lens (B,) int32 (>= 1: keys 0..len-1 are visible) -> (B, Hq, 1, D).
    splits: key-range splits (default: `num_splits` of the batch and nb * block_size); each row's
    keys are cut into `splits` equal runs of whole tiles.
    An FP8 (e4m3) cache passes k_scales / v_scales (num_blocks, block_size, Hkv) fp32, one per
    key: keys and values are read as e4m3 (half the bytes) and widened to q's dtype in registers."""
    decode, merge = _kernels()[:2]
    B, num_q_heads, T, D = q.shape
    assert T == 1, "the decode kernel takes one token per row"
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if splits is None:
        splits = num_splits(B, num_kv_heads, tables.shape[1] * block_size, q.device)
    q2 = q[:, :, 0, :].contiguous()  # (B, Hq, D)
    out = torch.empty_like(q2)
    common = dict(GROUP=group, GROUP_PAD=max(_MIN_GROUP_ROWS, 1 << (group - 1).bit_length()), BS=block_size,
                  TILE=TILE, D=D, IEEE=q.dtype == torch.float32, FP8=k_scales is not None,
                  num_warps=_DECODE_WARPS, num_stages=_DECODE_STAGES)
    args = (q2.stride(0), q2.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0))
    scales, s_strides = (q2, q2), (0, 0, 0)  # unread without an FP8 cache
    if k_scales is not None:  # the e4m3 variant: the scales and their strides
        assert k_scales.stride() == v_scales.stride()
        scales, s_strides = (k_scales, v_scales), k_scales.stride()
    if splits == 1:
        decode[(B, num_kv_heads, 1)](q2, k_cache, v_cache, tables, context_lens, out, out, out, *scales,
                                     *args, out.stride(0), out.stride(1), 0, 0, 0, *s_strides, D ** -0.5,
                                     SPLIT=False, **common)
        return out[:, :, None, :]
    part = torch.empty((B, num_q_heads, splits, D), dtype=torch.float32, device=q.device)
    m = torch.empty((B, num_q_heads, splits), dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    decode[(B, num_kv_heads, splits)](q2, k_cache, v_cache, tables, context_lens, part, m, denom, *scales,
                                      *args, part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
                                      *s_strides, D ** -0.5, SPLIT=True, **common)
    merge[(B, num_q_heads)](part, m, denom, out, part.stride(0), part.stride(1), part.stride(2), m.stride(0),
                            m.stride(1), out.stride(0), out.stride(1), S=splits,
                            S_PAD=max(2, 1 << (splits - 1).bit_length()), D=D)
    return out[:, :, None, :]


def chunk_stats(logits: Tensor, divisor: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per chunk of `chunk` vocabulary entries of x = logits / divisor (one read of the logits):
    max (B, n) fp32, sum of exp(x - max) (B, n) fp32, index of the first max in the chunk (B, n)."""
    kernel = _kernels()[2]
    B, V = logits.shape
    n = math.ceil(V / chunk)
    cmax = torch.empty((B, n), dtype=torch.float32, device=logits.device)
    csum = torch.empty_like(cmax)
    carg = torch.empty((B, n), dtype=torch.int64, device=logits.device)
    kernel[(B, n)](logits, divisor, cmax, csum, carg, V, logits.stride(0), n, C=chunk, num_warps=4)
    return cmax, csum, carg
