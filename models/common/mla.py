"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5), over `AttentionContext`.

    q       = wq x                      or  wq_b(q_norm(wq_a x))       (q_lora_rank)     (B, H, T, Dn + Dr)
    c, k_r  = split(wkv_a x, [R, Dr]);  c = kv_norm(c)                 latent (B, T, R), rope key (B, 1, T, Dr)
    q_r, k_r rotated (DeepSeek's interleaved pairs, or HF's halves)    k_r is shared by all heads
    k_n, v  = split(wkv_b c, [Dn, Dv]) per head                        (B, H, T, Dn), (B, H, T, Dv)
    out     = wo attend(cat(q_n, q_r), cat(k_n, k_r), v)               softmax scale 1/sqrt(Dn + Dr)
                                                                       (times YaRN's mscale^2, folded into q)

The keys have Dn + Dr dims and the values Dv: contexts must keep both (the engine's KV cache
does, common to every layer shape).

Latent attention. A context that has `attend_latent` is handed the compressed latent instead
(the native engine: it caches c and k_r, R + Dr numbers per token and layer instead of
H * (Dn + Dr + Dv)). With W_uk / W_uv the key / value halves of wkv_b per head, the same
attention is, exactly up to round-off,

    q_lat = q_n W_uk                      (B, H, T, R)
    score = q_lat . c + q_r . k_r         one kv "head" of R + Dr dims shared by all H heads
    out   = (softmax(score * scale) c) W_uv^T

`attend_latent(layer_id, q_nope, q_rope, latent, k_rope, wkv_b, v_head_dim)` returns
(B, H, T, Dv); contexts without it (every trainer context) get the expanded k and v.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import apply_rope, apply_rope_interleaved


class MLAttention(nn.Module):
    """DeepSeek-V3's attention. Parameters: `wq` (or `wq_a`, `q_norm`, `wq_b` with a q LoRA rank),
    `wkv_a`, `kv_norm`, `wkv_b`, `wo`; with `bias`, wq_a / wkv_a / wo have biases (HF attention_bias).
    The low-rank norms use eps 1e-6 whatever the model's, as transformers' DeepseekV3RMSNorm does."""

    def __init__(self, dim: int, n_heads: int, layer_id: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool = False,
                 rope_interleave: bool = True, softmax_scale: float = 1.0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = n_heads
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.rope_interleave = rope_interleave
        # YaRN's extra softmax factor (DeepSeek-V3: mscale^2), folded into q: the contract's scale
        # is 1/sqrt(q/k head dim).
        self.softmax_scale = softmax_scale
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.wq = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=bias)

    def latent(self, x: Tensor, cos: Tensor, sin: Tensor,
               q_resid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> q_nope (B, H, T, Dn), q_rope (B, H, T, Dr), latent (B, T, R), k_rope (B, 1, T, Dr).
        `q_resid`: q_norm(wq_a x) when the caller has it already (GLM-5's indexer reads it too)."""
        B, T, _ = x.shape
        if hasattr(self, "wq"):
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)) if q_resid is None else q_resid)
        if self.softmax_scale != 1.0:
            q = q * self.softmax_scale
        q = q.view(B, T, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        rope = apply_rope_interleaved if self.rope_interleave else apply_rope
        q_rope, k_rope = rope(q_rope, k_rope.view(B, 1, T, self.rope_dim), cos, sin)
        return q_nope, q_rope, self.kv_norm(c), k_rope

    def expand(self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The per-head q, k (B, H, T, Dn + Dr) and v (B, H, T, Dv) of the latent."""
        B, T, _ = c.shape
        kv = self.wkv_b(c).view(B, T, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        return torch.cat([q_nope, q_rope], dim=-1), k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim); cos, sin: (B, T, Dr) -> (B, T, dim)
        B, T, _ = x.shape
        q_nope, q_rope, c, k_rope = self.latent(x, cos, sin)
        if hasattr(attn, "attend_latent"):
            out = attn.attend_latent(self.layer_id, q_nope, q_rope, c, k_rope, self.wkv_b.weight, self.v_dim)
        else:
            out = attn.attend(self.layer_id, *self.expand(q_nope, q_rope, c, k_rope))  # (B, H, T, Dv)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


def mla_keys(q_lora: bool = True, bias: bool = False) -> dict[str, str]:
    """The key map of a block's `attention` (MLAttention) <-> HF's DeepSeek `self_attn`."""
    keys = {
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
    }
    keys.update({"attention.wq_a.weight": "self_attn.q_a_proj.weight",
                 "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
                 "attention.wq_b.weight": "self_attn.q_b_proj.weight"} if q_lora else
                {"attention.wq.weight": "self_attn.q_proj.weight"})
    if bias:
        keys.update({"attention.wkv_a.bias": "self_attn.kv_a_proj_with_mqa.bias",
                     "attention.wo.bias": "self_attn.o_proj.bias"})
        if q_lora:
            keys["attention.wq_a.bias"] = "self_attn.q_a_proj.bias"
    return keys
