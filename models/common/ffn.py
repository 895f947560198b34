"""SwiGLU feed-forward block shared by the dense families (Qwen3, Llama 3)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common import fused
from meshrl.models.common.fused import use_fused
from meshrl.models.common.packed_projections import Packed


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate_proj, w3 = up_proj, w2 = down_proj in HF.

    w1 and w3 are registered one after the other, so that in the colocated engine's flat weight
    buffer they are neighbours and stay one matmul (`packed["gate_up"]`, models/common/packed_projections.py)."""

    packs = {"gate_up": ("w1", "w3")}

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.packed: dict[str, Packed] = {}  # set by packed_projections.bind (the engine), empty in training

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., dim) -> (..., dim)
        if "gate_up" in self.packed and not self.w1.weight.requires_grad:  # never on a path that trains
            weight, _, sizes = self.packed["gate_up"]
            gate, up = F.linear(x, weight).split(sizes, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        if use_fused(x):
            return self.w2(fused.silu_mul(gate, up))  # inference only, same numerics
        return self.w2(F.silu(gate) * up)
