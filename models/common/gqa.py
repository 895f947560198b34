"""Grouped-query self-attention with the options the MoE families need, over `AttentionContext`.

    q = wq x (+ bias), k = wk x (+ bias), v = wv x (+ bias)       heads of head_dim
    qk_norm "head": RMSNorm over each head's head_dim (Qwen3, GLM-4.5 with use_qk_norm)
            "full": RMSNorm over all heads at once, before the split (MiniMax-M2)
    RoPE on q and k (the first R dims of each head when cos/sin are R < head_dim wide)
    out = wo attn.attend(layer_id, q, k, v[, window=W][, sinks=s]) (+ bias)

`window` (a sliding window of W tokens) and `sinks` (a learned logit per query head, gpt-oss) are
passed to the context only when set: common/attention.py describes both.

Parameter names: `wq`, `wk`, `wv`, `wo` (`.weight`, `.bias` where enabled), `q_norm`, `k_norm`,
`sinks` (n_heads,).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common import fused_decode
from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.packed_projections import Packed
from meshrl.models.common.rope import apply_rope

QKNorm = Literal["none", "head", "full"]


class GQAttention(nn.Module):
    """GQA self-attention: optional q/k/v and output biases, optional q/k RMSNorm, partial RoPE.
    In the native engine q/k/v are one matmul (`packed["qkv"]`, models/common/packed_projections.py)
    and a per-head q/k norm with RoPE one kernel (`fused_decode.qk_norm_rope`, inference only)."""

    packs = {"qkv": ("wq", "wk", "wv")}

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, layer_id: int, *,
                 qkv_bias: bool = False, out_bias: bool = False, qk_norm: QKNorm = "none",
                 norm_eps: float = 1e-6, window: int | None = None, sinks: bool = False) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.qk_norm = qk_norm
        self.packed: dict[str, Packed] = {}  # set by packed_projections.bind (the engine), empty in training
        self.window = window
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=out_bias)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(n_heads * head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, eps=norm_eps)
        elif qk_norm != "none":
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {qk_norm!r}")

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> q (B, Hq, T, D), k and v (B, Hkv, T, D), norms and RoPE applied."""
        B, T, _ = x.shape
        if "qkv" in self.packed and not self.wq.weight.requires_grad:  # never on a path that trains
            weight, bias, sizes = self.packed["qkv"]
            q, k, v = F.linear(x, weight, bias).split(sizes, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        if self.qk_norm == "head" and self._fused_qk(q, cos):  # one launch for both norms and RoPE
            q, k = fused_decode.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
            return q, k, v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.view(B, T, -1, self.head_dim).transpose(1, 2)

    def _fused_qk(self, q: Tensor, cos: Tensor) -> bool:
        """Whether q_norm, k_norm and RoPE can be one kernel (models/common/fused_decode.py): inference,
        norms in q's dtype with the default numerics and one eps, cos/sin in q's dtype."""
        return (fused_decode.enabled(q) and q.stride(-1) == 1 and cos.dtype == q.dtype
                and type(self.q_norm) is type(self.k_norm) is RMSNorm
                and self.q_norm.weight.dtype == q.dtype == self.k_norm.weight.dtype
                and not self.q_norm.weight_in_fp32 and not self.k_norm.weight_in_fp32
                and self.q_norm.eps == self.k_norm.eps and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim); cos, sin: (B, T, R) -> (B, T, dim)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        extra = {}
        if self.window is not None:
            extra["window"] = self.window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        out = attn.attend(self.layer_id, q, k, v, **extra)  # (B, Hq, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


# HF's names of `GQAttention` as a block's `attention` (relative to layers.{i}. / model.layers.{i}.).
def gqa_keys(qkv_bias: bool = False, out_bias: bool = False, qk_norm: QKNorm = "none",
             sinks: bool = False) -> dict[str, str]:
    """The key map of a block's `attention` <-> HF's `self_attn`, for the enabled parameters."""
    keys = {f"attention.w{a}.weight": f"self_attn.{b}_proj.weight" for a, b in zip("qkvo", "qkvo")}
    if sinks:
        keys["attention.sinks"] = "self_attn.sinks"
    if qkv_bias:
        keys.update({f"attention.w{a}.bias": f"self_attn.{a}_proj.bias" for a in "qkv"})
    if out_bias:
        keys["attention.wo.bias"] = "self_attn.o_proj.bias"
    if qk_norm != "none":
        keys.update({"attention.q_norm.weight": "self_attn.q_norm.weight",
                     "attention.k_norm.weight": "self_attn.k_norm.weight"})
    return keys
