"""What the shared-expert MoE families (GLM-4.5, DeepSeek-V3, GLM-5) build their blocks from, and
the expert-parallel sharding plan every MoE family starts from.

- `SharedExpertBlock`: the pre-norm block x + attention(norm(x)), then + ffn(norm(.)), where the
  family gives the attention module and ffn is, by `args.is_moe_layer(layer_id)`, the routed `MoE`
  with its ungated shared experts (`args.moe_hidden_dim * args.num_shared_experts` wide) or a
  dense SwiGLU of `args.hidden_dim`. Submodules in this order: attention_norm, attention,
  ffn_norm, then moe or feed_forward (the keys of the families' KEY_MAPs).
- `SHARED_EXPERT_INIT_RULES`: N(0, 0.02) for everything but the RMSNorm weights (1), the biases and
  the frozen expert bias (0), and the residual output projections (attention.wo, feed_forward.w2,
  the experts' and shared experts' w2) ~ N(0, 0.02 / sqrt(2 * n_layers)).
- `expert_parallel_plan(**more)`: FSDP units per block, the expert groups split over ep on dim 0
  and wrapped on the expert-FSDP mesh (parallel/), plus a family's own entries.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL, Constant
from meshrl.models.common.moe import MoE
from meshrl.models.common.norm import RMSNorm

SHARED_EXPERT_INIT_RULES = (
    ("*norm.weight", ONES),
    ("*.bias", Constant(0.0)),
    ("*moe.expert_bias", Constant(0.0)),
    ("*attention.wo.weight", RESIDUAL),
    ("*feed_forward.w2.weight", RESIDUAL),
    ("*moe.experts.w2", RESIDUAL),
    ("*moe.shared_expert.w2.weight", RESIDUAL),
    ("*", NORMAL),
)


def expert_parallel_plan(**more: Any) -> dict[str, Any]:
    """A fresh sharding plan (module docstring) with `more` added (e.g. tp=..., no_cp=...)."""
    return {"fsdp_units": ["layers.*"], "expert_fsdp_units": ["layers.*.moe.experts"],
            "ep": {"layers.*.moe.experts": "shard_dim0"}, **more}


class SharedExpertBlock(nn.Module):
    """Pre-norm block around `attention` with a routed MoE (or dense) feed-forward (module docstring).
    `args` needs dim, norm_eps, hidden_dim, moe_hidden_dim, num_experts, top_k, num_shared_experts,
    routing and is_moe_layer(i)."""

    def __init__(self, args: Any, layer_id: int, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k,
                           shared_hidden_dim=args.moe_hidden_dim * args.num_shared_experts, routing=args.routing,
                           shared_gate=False)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def ffn(self, h: Tensor) -> Tensor:
        return (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(h))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.ffn(h)
