"""RMSNorm with the numerics of HF's Qwen3RMSNorm / LlamaRMSNorm.

The statistic is computed in fp32 whatever the activation dtype (bf16 squares lose too much),
the normalised activations are cast back to the input dtype, and only then multiplied by the
weight. Keeping this exact order is what lets our logits match transformers to ~1e-6 in fp32
and bit-for-bit in the common bf16 cases.

`OffsetRMSNorm` is the zero-centred variant (Gemma, Qwen3-Next, Qwen3.5): weight stored as an
offset from 1, normalised and scaled in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from meshrl.models.common import fused, fused_decode
from meshrl.models.common.fused import use_fused


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistic in fp32, over the last dim.

    `weight_in_fp32` (gpt-oss): multiply by the weight in fp32, then cast (HF's GptOssRMSNorm);
    the default casts first (Qwen3, Llama). The two agree in fp32.
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if use_fused(x) and self.weight.dtype == x.dtype and not self.weight_in_fp32:
            return fused.rms_norm(x, self.weight, self.eps)  # one kernel, same numerics (inference only)
        if x.dtype == torch.float32 and self.weight.dtype == x.dtype and not x.is_cuda \
                and not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            # torch's own op: bit-identical to the lines below in fp32 on CPU (not in bf16, whose
            # cast order differs) and one dispatch instead of eight (the CPU engine's decode steps)
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(input_dtype)
        return self.weight * h.to(input_dtype)

    def add_forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(h, self(h)) with h = x + y: a residual add and the norm after it, one kernel where the
        decode fusions are on (models/common/fused_decode.py), the same math."""
        if (fused_decode.enabled(x) and x.shape == y.shape and self.weight.dtype == x.dtype == y.dtype
                and not self.weight_in_fp32):
            return fused_decode.add_rms_norm(x, y, self.weight, self.eps)
        h = x + y
        return h, self(h)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class OffsetRMSNorm(nn.Module):
    """y = (1 + weight) * (x / sqrt(mean(x^2) + eps)), all in fp32, cast back at the end.

    The zero-centred RMSNorm of Gemma and Qwen3-Next / Qwen3.5 (HF's Qwen3NextRMSNorm): the stored
    weight is an offset from 1, so a fresh norm has weight 0 (init rule `Constant(0.0)`).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
