"""Rotary position embedding from explicit per-token positions.

Positions are passed in, never derived from the sequence index, because packed rows hold
several documents and each one restarts at position 0 (and the inference engine decodes at
arbitrary offsets). The numerics follow HF Qwen3 / Llama ("default" rope type) exactly:

    inv_freq = 1 / theta ** (arange(0, D, 2).float() / D)      # fp32, computed on the CPU
    freqs    = positions.float()[..., None] * inv_freq          # fp32
    cos, sin = cos(cat(freqs, freqs)), sin(cat(freqs, freqs))   # then cast to the activation dtype
    x'       = x * cos + rotate_half(x) * sin                   # in the activation dtype

`inv_freq` is deliberately *not* a buffer: a buffer would be garbage after `to_empty()` on a
meta-built model, would be cast to bf16 by `model.to(torch.bfloat16)`, and would need special
handling in every state-dict path. Instead it is computed on the CPU (the same kernel HF uses, so
the values are bit-identical) and cached per device on first use.

A family with scaled frequencies passes its settings in as a frozen dataclass
(`Llama3RopeScaling`, `YarnRopeScaling`); `scaling=None` is the default path above, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meshrl.models.common import fused
from meshrl.models.common.fused import use_fused


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling (HF rope_type "llama3"), used to stretch the context.

    Wavelengths shorter than original_max_seq_len / high_freq_factor keep their frequency,
    wavelengths longer than original_max_seq_len / low_freq_factor are slowed down by `factor`,
    and the band in between is interpolated linearly in original_max_seq_len / wavelength.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"llama3 rope scaling factor must be positive, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.original_max_seq_len <= 0:
            raise ValueError(f"llama3 rope original_max_seq_len must be positive, got {self.original_max_seq_len}")


def _llama3_scale(inv_freq: Tensor, s: Llama3RopeScaling) -> Tensor:
    # Same fp32 operations in the same order as transformers' llama3 init, so the result is
    # bit-identical (the medium band is sensitive to rounding of the smoothing weight).
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (HF rope_type "yarn": gpt-oss, DeepSeek-V3): frequencies blended between the original
    (fast dims, extrapolated) and `factor` times slower (slow dims, interpolated) over a linear
    ramp between the dims that turn beta_fast and beta_slow times in original_max_seq_len;
    cos and sin are multiplied by `attention_factor` (HF's default from factor, mscale and
    mscale_all_dim). DeepSeek-V3 also scales its softmax by `softmax_scale` (= mscale(factor,
    mscale_all_dim)^2), which its attention applies, not the embedding."""

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_seq_len <= 0:
            raise ValueError(f"yarn rope scaling needs factor > 0 and original_max_position_embeddings > 0, got "
                             f"{self.factor} and {self.original_max_seq_len}")

    @staticmethod
    def _mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (HF's attention_factor)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim))
        return self._mscale(self.factor)

    @property
    def softmax_scale(self) -> float:
        """DeepSeek's extra softmax factor (HF yarn_apply_mscale): mscale(factor, mscale_all_dim)^2, or 1."""
        if not self.mscale_all_dim:
            return 1.0
        return self._mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_hf(cls, rope: dict) -> YarnRopeScaling:
        """From an HF rope_parameters / rope_scaling dict of rope_type "yarn"."""
        return cls(factor=float(rope["factor"]), original_max_seq_len=int(rope["original_max_position_embeddings"]),
                   beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                   mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                   attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))

    def to_hf(self, theta: float) -> dict:
        out = {"rope_type": "yarn", "rope_theta": theta, "factor": self.factor,
               "original_max_position_embeddings": self.original_max_seq_len, "beta_fast": self.beta_fast,
               "beta_slow": self.beta_slow, "truncate": self.truncate}
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _yarn_inv_freq(dim: int, theta: float, s: YarnRopeScaling) -> Tensor:
    # The fp32 operations of transformers' _compute_yarn_parameters, in its order.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


RopeScaling = Llama3RopeScaling | YarnRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """Inverse frequencies (head_dim // 2,) in fp32 on the CPU, exactly as HF computes them."""
    assert head_dim % 2 == 0, f"rotary head_dim must be even, got {head_dim}"
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq if scaling is None else _llama3_scale(inv_freq, scaling)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim (the HF/NeoX layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hkv, T, D) with cos, sin (B, T, R).

    R < D is partial rotary (GLM-4.5, MiniMax-M2: HF's partial_rotary_factor): the first R dims
    of every head are rotated, the other D - R pass through, as transformers does.
    """
    rotary = cos.shape[-1]
    if rotary < q.shape[-1]:
        q_rot, k_rot = apply_rope(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)
    half = q.shape[-1] // 2
    if use_fused(q) and half & (half - 1) == 0 and cos.dtype == q.dtype:
        return fused.rope(q, cos, sin), fused.rope(k, cos, sin)  # inference only, same numerics
    cos = cos.unsqueeze(1)  # (B, 1, T, D): broadcast over heads
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rope_interleaved(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """DeepSeek's layout (HF rope_interleave=True): dims (x0, x1), (x2, x3), ... are the rotated
    pairs. q (B, Hq, T, D), k (B, Hkv, T, D), cos/sin (B, T, D) of the usual cat(freqs, freqs)
    form. The result comes out de-interleaved, [x_even', x_odd'], exactly as transformers
    returns it (q and k alike, so their dot products are those of the interleaved rotation)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)  # (B, 1, T, D/2)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


class RotaryEmbedding(nn.Module):
    """Maps positions (B, T) to (cos, sin), each (B, T, head_dim), in the requested dtype.

    Holds no parameters or buffers, so it is safe on the meta device, under `to_empty()`,
    dtype casts and FSDP; `inv_freq` is cached per device outside the state dict.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        """(head_dim // 2,) fp32 on `device`; computed on the CPU once, then copied."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        return self._inv_freq[device]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: (B, T) int64 -> cos, sin: (B, T, head_dim) in `dtype`
        freqs = positions[..., None].float() * self.inv_freq(positions.device)  # (B, T, D/2) fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        if isinstance(self.scaling, YarnRopeScaling) and self.scaling.cos_sin_factor != 1.0:
            factor = self.scaling.cos_sin_factor
            return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, theta={self.theta}{scaling}"
