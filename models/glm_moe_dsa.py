"""GLM-5 (HF model_type "glm_moe_dsa"): MLA plus DeepSeek sparse attention, over `AttentionContext`.

One file holds everything a family needs: `GlmMoeDsaArgs` (to and from an HF `config.json`),
`FLAVORS`, the modules, `INIT_RULES`, `PARALLEL_PLAN` and `KEY_MAP` (applied by
common/state_dict.py).

The architecture, as transformers' `GlmMoeDsaForCausalLM` computes it, is DeepSeek-V3's (MLA
through a q LoRA with interleaved RoPE, `deepseek_v3.py`'s MoE block after `first_dense` dense
layers) with one change: each query attends only to the `index_topk` keys that a lightweight
indexer scores highest (DeepSeek sparse attention):

    q_i     = wq_b_i(q_resid)                       q_resid = q_norm(wq_a x), (B, T, Hi, Di)
    k_i     = LayerNorm(wk_i x)                     one key per token, (B, T, Di)
              (RoPE, interleaved, on the first Dr dims of q_i and k_i)
    score   = sum_h w_h * relu(q_i[h] . k_i / sqrt(Di)),  w = weights_proj(x) / sqrt(Hi)
    keep    = top index_topk keys of score among the allowed (causal, same document) ones

computed without gradient, as transformers does (the indexer's weights are frozen here:
requires_grad=False). Layers of indexer type "shared" reuse the selection of the last "full"
layer before them. The selection is made by the attention context (`index=(k_i, select)`,
models/common/attention.py), which knows the key layout: the row in training, the gathered row
under context parallelism, the cached blocks in the engine, whose latent cache rows then hold
[latent, rope key, index key] (R + Dr + Di numbers per token and layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext, CausalAttention
from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.mla import MLAttention, mla_keys
from meshrl.models.common.moe import Routing
from meshrl.models.common.moe_block import SHARED_EXPERT_INIT_RULES, SharedExpertBlock, expert_parallel_plan
from meshrl.models.common.rope import RotaryEmbedding, YarnRopeScaling, apply_rope_interleaved
from meshrl.models.common.state_dict import (DECODER_KEYS, EXPERT_KEYS, FUSED_EXPERT_KEYS, ROUTED_MOE_KEYS, SWIGLU_KEYS,
                                             KeyMap, StateDictAdapter)

MODEL_TYPE = "glm_moe_dsa"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlmMoeDsaArgs:
    """Shape of a GLM-5 model. Field names are ours (HF's for the MLA and indexer dims)."""

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    index_n_heads: int = 8
    index_head_dim: int = 16
    index_topk: int = 4
    indexer_types: tuple[str, ...] = ("full", "shared", "full")
    hidden_dim: int = 128
    moe_hidden_dim: int = 32
    num_experts: int = 8
    num_shared_experts: int = 1
    top_k: int = 2
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    first_dense: int = 1
    attention_bias: bool = False
    rope_theta: float = 10_000.0
    rope_scaling: YarnRopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 202752
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2 != 0 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim must be even and <= index_head_dim, got {self.qk_rope_head_dim}")
        if len(self.indexer_types) != self.n_layers or set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"indexer_types must be 'full' or 'shared' for each of {self.n_layers} layers")
        if self.indexer_types[0] != "full":
            raise ValueError("the first layer's indexer type must be 'full' (a 'shared' layer reuses an earlier one)")
        if self.num_shared_experts < 1 or not 0 <= self.first_dense <= self.n_layers or self.index_topk < 1:
            raise ValueError("GLM-5 needs n_shared_experts >= 1, first_k_dense_replace in [0, n_layers], index_topk >= 1")
        self.routing.check(self.num_experts, self.top_k)

    @property
    def routing(self) -> Routing:
        return Routing(score="sigmoid", norm_topk_prob=self.norm_topk_prob, bias=True, num_groups=self.n_group,
                       topk_groups=self.topk_group, scale=self.routed_scaling_factor, norm_eps=1e-20, fp32=True)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> GlmMoeDsaArgs:
        """Read an HF GLM-5 `config.json` dict; features this file does not implement raise ValueError."""
        _check_hf_config(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        yarn = rope.get("rope_type", rope.get("type", "default")) == "yarn"
        n_layers = config["num_hidden_layers"]
        mlp_types = config.get("mlp_layer_types")
        first_dense = mlp_types.count("dense") if mlp_types else config.get("first_k_dense_replace", 3)
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=n_layers,
            n_heads=config["num_attention_heads"], q_lora_rank=config["q_lora_rank"],
            kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
            index_n_heads=config["index_n_heads"], index_head_dim=config["index_head_dim"],
            index_topk=config["index_topk"],
            indexer_types=tuple(config.get("indexer_types") or ["full"] * n_layers),
            hidden_dim=config["intermediate_size"], moe_hidden_dim=config["moe_intermediate_size"],
            num_experts=config.get("n_routed_experts", config.get("num_local_experts")),
            num_shared_experts=config.get("n_shared_experts", 1), top_k=config["num_experts_per_tok"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1, first_dense=first_dense,
            attention_bias=config.get("attention_bias", False),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
            rope_scaling=YarnRopeScaling.from_hf(rope) if yarn else None, norm_eps=config.get("rms_norm_eps", 1e-5),
            tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 202752),
            num_mtp_layers=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' GlmMoeDsaForCausalLM loads."""
        dtype_name = str(dtype).removeprefix("torch.")
        rope = ({"rope_type": "default", "rope_theta": self.rope_theta} if self.rope_scaling is None
                else self.rope_scaling.to_hf(self.rope_theta))
        n_dense = min(self.first_dense, self.n_layers)
        return {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.hidden_dim,
            "moe_intermediate_size": self.moe_hidden_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "indexer_types": list(self.indexer_types), "layer_types": ["indexed_attention"] * self.n_layers,
            "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (self.n_layers - n_dense),
            "first_k_dense_replace": self.first_dense, "n_routed_experts": self.num_experts,
            "n_shared_experts": self.num_shared_experts, "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group, "topk_group": self.topk_group, "attention_bias": self.attention_bias,
            "num_nextn_predict_layers": self.num_mtp_layers, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": rope, "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0,
            "use_cache": True, "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id, "torch_dtype": dtype_name, "dtype": dtype_name,
        }


def _check_hf_config(config: dict[str, Any]) -> None:
    """ValueError for what this file does not implement."""
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise ValueError("GLM-5 with a hidden_act other than 'silu' or mlp_bias is not supported")
    if (config.get("attention_dropout") or 0.0) > 0:
        raise ValueError("GLM-5 with attention_dropout > 0 is not supported")
    if (config.get("num_key_value_heads") or config["num_attention_heads"]) != config["num_attention_heads"]:
        raise ValueError("GLM-5 with num_key_value_heads != num_attention_heads is not supported")
    if set(config.get("layer_types") or ["indexed_attention"]) != {"indexed_attention"}:
        raise ValueError(f"GLM-5 layer types {sorted(set(config['layer_types']))} are not supported")
    mlp_types = config.get("mlp_layer_types")
    if mlp_types and mlp_types != sorted(mlp_types):  # "dense" < "sparse": dense layers first
        raise ValueError("GLM-5 with dense layers after sparse ones (mlp_layer_types) is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "yarn"):
        raise ValueError(f"GLM-5 RoPE {rope!r} is not supported (default or yarn)")


_GLM5 = GlmMoeDsaArgs(vocab_size=154880, dim=6144, n_layers=78, n_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                      qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
                      index_head_dim=128, index_topk=2048, indexer_types=("full",) * 78, hidden_dim=12288,
                      moe_hidden_dim=2048, num_experts=256, top_k=8, routed_scaling_factor=2.5, first_dense=3,
                      num_mtp_layers=1)

FLAVORS: dict[str, GlmMoeDsaArgs] = {
    # index_topk 4: prompts longer than 4 tokens attend sparsely; layer 1 reuses layer 0's selection.
    "debug": GlmMoeDsaArgs(max_seq_len=2048),
    # Benchmark shape, not a released model: GLM-5's attention (64 heads, latent 512, indexer
    # 32 x 128 choosing 2048 keys) and MoE layer at 4 layers and 16 experts (4.7B parameters).
    "bench-dsa-5B": replace(_GLM5, n_layers=4, num_experts=16, first_dense=1, indexer_types=("full",) * 4),
    # The published configuration's shape (transformers' GlmMoeDsaConfig defaults).
    "744B-A40B": _GLM5,
}

# Init scheme (DeepSeek-V3's): N(0, 0.02) for the embedding, projections (the indexer's too),
# router and expert / dense w1/w3; the residual output projections ~ N(0, 0.02 / sqrt(2 *
# n_layers)); RMSNorm and the indexer's LayerNorm weights 1, its bias 0; the frozen expert bias 0.
INIT_RULES = SHARED_EXPERT_INIT_RULES

# Sharding plan as data (DeepSeek-V3's). No inference TP.
PARALLEL_PLAN: dict[str, Any] = expert_parallel_plan()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class Indexer(nn.Module):
    """GLM-5's sparse-attention indexer (frozen; see the module docstring). Parameters: `wq_b`,
    `wk`, `k_norm` (LayerNorm with bias, eps 1e-6), `weights_proj`."""

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.topk = args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.requires_grad_(False)

    def forward(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Any, list[Tensor]]:
        """x (B, T, dim), q_resid (B, T, q_lora_rank) -> (index keys (B, T, Di), `select`, a list that
        `select` appends its keep (B, T, L) to): the `index=(keys, select)` of the attention contract."""
        B, T, _ = x.shape
        with torch.no_grad():
            q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hi, T, Di)
            k = self.k_norm(self.wk(x))[:, None]  # (B, 1, T, Di)
            r = self.rope_dim
            q_rot, k_rot = apply_rope_interleaved(q[..., :r], k[..., :r], cos, sin)
            q = torch.cat([q_rot, q[..., r:]], dim=-1).transpose(1, 2)  # (B, T, Hi, Di)
            k = torch.cat([k_rot, k[..., r:]], dim=-1)[:, 0]  # (B, T, Di)
            weights = self.weights_proj(x).float() * self.n_heads**-0.5  # (B, T, Hi)
        chosen: list[Tensor] = []

        def select(index_keys: Tensor, allowed: Tensor) -> Tensor:
            # index_keys (B, L, Di) in the context's key layout, allowed (B or 1, T, L) -> keep (B, T, L)
            with torch.no_grad():
                scores = F.relu(q.float() @ index_keys.float().transpose(-1, -2)[:, None] * self.head_dim**-0.5)
                index_scores = (weights[..., None, :] @ scores).squeeze(-2).masked_fill(~allowed, float("-inf"))
                top = index_scores.topk(min(self.topk, index_scores.shape[-1]), dim=-1).indices
                keep = torch.zeros_like(index_scores, dtype=torch.bool).scatter_(-1, top, True)
            chosen.append(keep)
            return keep

        return k, select, chosen


class DSAttention(MLAttention):
    """MLA whose queries see only the indexer's selected keys; `indexer` is None on a "shared" layer."""

    def __init__(self, args: GlmMoeDsaArgs, layer_id: int) -> None:
        super().__init__(args.dim, args.n_heads, layer_id, q_lora_rank=args.q_lora_rank,
                         kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
                         qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
                         bias=args.attention_bias, rope_interleave=True,
                         softmax_scale=1.0 if args.rope_scaling is None else args.rope_scaling.softmax_scale)
        self.index_dim = args.index_head_dim
        self.indexer = Indexer(args) if args.indexer_types[layer_id] == "full" else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
                keep: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        # x: (B, T, dim); keep: an earlier layer's selection (B, T, L) -> ((B, T, dim), this layer's selection)
        B, T, _ = x.shape
        q_resid = self.q_norm(self.wq_a(x))
        q_nope, q_rope, c, k_rope = self.latent(x, cos, sin, q_resid)
        index, chosen = None, []
        if self.indexer is not None:
            index_keys, select, chosen = self.indexer(x, q_resid, cos, sin)
            index, keep = (index_keys, select), None
        if hasattr(attn, "attend_latent"):
            out = attn.attend_latent(self.layer_id, q_nope, q_rope, c, k_rope, self.wkv_b.weight, self.v_dim,
                                     index=index, keep=keep, index_dim=self.index_dim)
        else:
            out = attn.attend(self.layer_id, *self.expand(q_nope, q_rope, c, k_rope), index=index, keep=keep)
        if chosen:  # the context selected (the engine's probe does not)
            keep = chosen[-1]
        return self.wo(out.transpose(1, 2).reshape(B, T, -1)), keep


class TransformerBlock(SharedExpertBlock):
    """Pre-norm block: x + dsa(norm(x)), then + ffn(norm(.)) (common/moe_block.py); passes the key
    selection on."""

    def __init__(self, args: GlmMoeDsaArgs, layer_id: int) -> None:
        super().__init__(args, layer_id, DSAttention(args, layer_id))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
                keep: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        # x: (B, T, dim) -> (B, T, dim), the selection of this (or the last full) layer
        a, keep = self.attention(self.attention_norm(x), cos, sin, attn, keep)
        h = x + a
        return h + self.ffn(h), keep


class GlmMoeDsa(DecoderLM):
    """GLM-5 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load."""

    init_rules = INIT_RULES

    def __init__(self, args: GlmMoeDsaArgs) -> None:
        super().__init__(args, RotaryEmbedding(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])

    def hidden(self, tokens: Tensor, positions: Tensor, attn: AttentionContext | None = None) -> Tensor:
        """As `DecoderLM.hidden`, with each block handing its key selection to the next."""
        assert tokens.shape == positions.shape, f"tokens {tuple(tokens.shape)} vs positions {tuple(positions.shape)}"
        attn = CausalAttention() if attn is None else attn
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(positions, dtype=h.dtype)
        keep = None
        for block in self.layers.values():
            h, keep = block(h, cos, sin, attn, keep)
        return self.norm(h)


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Block-relative names: DeepSeek-V3's (MLA with the q LoRA, MoE layers with GLM-4.5's keys), plus
# on "full" layers the indexer, attention.indexer.* <-> self_attn.indexer.* (wq_b, wk, k_norm
# weight and bias, weights_proj). An indexer key for a "shared" layer has no place in the model
# and fails the load, naming the key.
INDEXER_KEYS = {f"attention.indexer.{name}": f"self_attn.indexer.{name}"
                for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}
KEY_MAP = KeyMap(
    label="GLM-5",
    hf_label="GlmMoeDsa",
    top=DECODER_KEYS,
    block={"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           **mla_keys(q_lora=True, bias=True), **INDEXER_KEYS},
    layer_keys={
        "dense": SWIGLU_KEYS,
        "MoE": ROUTED_MOE_KEYS,
    },
    layer_kind=lambda args, i: "MoE" if args.is_moe_layer(i) else "dense",
    experts=EXPERT_KEYS,
    fused_experts=FUSED_EXPERT_KEYS,
    expert_kind="MoE",
)


class GlmMoeDsaStateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py)."""

    key_map = KEY_MAP
