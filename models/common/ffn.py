"""SwiGLU feed-forward block shared by the dense families (Qwen3, Llama 3)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common import fused
from meshrl.models.common.fused import use_fused


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate_proj, w3 = up_proj, w2 = down_proj in HF."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., dim) -> (..., dim)
        if use_fused(x):
            return self.w2(fused.silu_mul(self.w1(x), self.w3(x)))  # inference only, same numerics
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
