"""DeepSeek-V3 (HF model_type "deepseek_v3"), written against the `AttentionContext` contract.

One file holds everything a family needs: `DeepseekV3Args` (to and from an HF `config.json`),
`FLAVORS`, the modules, `INIT_RULES`, `PARALLEL_PLAN` and `KEY_MAP` (applied by
common/state_dict.py).

The architecture, as transformers' `DeepseekV3ForCausalLM` computes it:

- attention is multi-head latent attention (common/mla.py's `MLAttention`): queries through a
  LoRA (q_lora_rank) or one projection, keys and values from a compressed latent of
  kv_lora_rank dims plus one rotary key shared by all heads; q/k head dim nope + rope, v head
  dim its own; RoPE on the rope part only, in DeepSeek's interleaved layout (rope_interleave).
  The native engine caches the latent and the rotary key (common/mla.py, "latent attention");
  trainer contexts get expanded per-head k and v;
- the feed-forward is a dense SwiGLU in the first `first_dense` layers, then GLM-4.5's MoE block
  (the same `Routing`: sigmoid in fp32, frozen score-correction bias for the choice only,
  grouped top-k, renormalised + 1e-20, times routed_scaling_factor; ungated shared experts).

RoPE is plain or YaRN (the released DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1), whose
softmax factor mscale(factor, mscale_all_dim)^2 the attention folds into q, as transformers'
`yarn_apply_mscale` does. Checkpoints carry the multi-token-prediction module as layer n_layers
(61 in DeepSeek-V3); `num_mtp_layers` of them are dropped on load, as transformers drops them.
Refused: other RoPE scalings and any topk_method other than "noaux_tc".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.mla import MLAttention, mla_keys
from meshrl.models.common.moe import Routing
from meshrl.models.common.moe_block import SHARED_EXPERT_INIT_RULES, SharedExpertBlock, expert_parallel_plan
from meshrl.models.common.rope import RotaryEmbedding, YarnRopeScaling
from meshrl.models.common.state_dict import (DECODER_KEYS, EXPERT_KEYS, FUSED_EXPERT_KEYS, ROUTED_MOE_KEYS, SWIGLU_KEYS,
                                             KeyMap, StateDictAdapter)

MODEL_TYPE = "deepseek_v3"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeepseekV3Args:
    """Shape of a DeepSeek-V3 model. Field names are ours (HF's for the MLA dims); `from_hf_config`
    maps HF's names. `hidden_dim` is the dense layers' SwiGLU width, `moe_hidden_dim` each routed
    expert's; layers < `first_dense` (first_k_dense_replace) are dense."""

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    hidden_dim: int = 128
    moe_hidden_dim: int = 32
    num_experts: int = 8
    num_shared_experts: int = 1
    top_k: int = 2
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = 2
    topk_group: int = 1
    first_dense: int = 1
    attention_bias: bool = False
    rope_interleave: bool = True
    rope_theta: float = 10_000.0
    rope_scaling: YarnRopeScaling | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if self.num_shared_experts < 1:
            raise ValueError(f"DeepSeek-V3 needs n_shared_experts >= 1, got {self.num_shared_experts}")
        if not 0 <= self.first_dense <= self.n_layers:
            raise ValueError(f"first_dense (first_k_dense_replace) must be in [0, {self.n_layers}]")
        self.routing.check(self.num_experts, self.top_k)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def routing(self) -> Routing:
        return Routing(score="sigmoid", norm_topk_prob=self.norm_topk_prob, bias=True, num_groups=self.n_group,
                       topk_groups=self.topk_group, scale=self.routed_scaling_factor, norm_eps=1e-20, fp32=True)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DeepseekV3Args:
        """Read an HF DeepSeek-V3 `config.json` dict; features this file does not implement raise ValueError."""
        _check_hf_config(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        yarn = rope.get("rope_type", rope.get("type", "default")) == "yarn"
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"], q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
            hidden_dim=config["intermediate_size"], moe_hidden_dim=config["moe_intermediate_size"],
            num_experts=config.get("n_routed_experts", config.get("num_local_experts")),
            num_shared_experts=config.get("n_shared_experts", 1), top_k=config["num_experts_per_tok"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
            first_dense=config.get("first_k_dense_replace", 0), attention_bias=config.get("attention_bias", False),
            rope_interleave=config.get("rope_interleave", True),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
            rope_scaling=YarnRopeScaling.from_hf(rope) if yarn else None,
            norm_eps=config.get("rms_norm_eps", 1e-6), tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 4096),
            num_mtp_layers=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' DeepseekV3ForCausalLM loads (4.5x and 5.x)."""
        dtype_name = str(dtype).removeprefix("torch.")
        rope = ({"rope_type": "default", "rope_theta": self.rope_theta} if self.rope_scaling is None
                else self.rope_scaling.to_hf(self.rope_theta))
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.hidden_dim,
            "moe_intermediate_size": self.moe_hidden_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "n_routed_experts": self.num_experts,
            "n_shared_experts": self.num_shared_experts, "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group, "topk_group": self.topk_group, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "first_k_dense_replace": self.first_dense,
            "attention_bias": self.attention_bias, "rope_interleave": self.rope_interleave,
            "num_nextn_predict_layers": self.num_mtp_layers, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
            # Both spellings: transformers 4.x reads rope_scaling, 5.x rope_parameters.
            "rope_parameters": rope, "rope_scaling": None if self.rope_scaling is None else rope,
            "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
            "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id, "torch_dtype": dtype_name, "dtype": dtype_name,
        }


def _check_hf_config(config: dict[str, Any]) -> None:
    """ValueError for what this file does not implement."""
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DeepSeek-V3 hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
    if (config.get("attention_dropout") or 0.0) > 0:
        raise ValueError("DeepSeek-V3 with attention_dropout > 0 is not supported")
    if config.get("topk_method", "noaux_tc") != "noaux_tc" or config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"DeepSeek-V3 routing topk_method={config.get('topk_method')!r} scoring_func="
                         f"{config.get('scoring_func')!r} is not supported (only noaux_tc with sigmoid scores)")
    n_heads = config["num_attention_heads"]
    if (config.get("num_key_value_heads") or n_heads) != n_heads:
        raise ValueError("DeepSeek-V3 with num_key_value_heads != num_attention_heads is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "yarn"):
        raise ValueError(f"DeepSeek-V3 RoPE {rope!r} is not supported (default or yarn)")


_V3 = DeepseekV3Args(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_dim=18432, moe_hidden_dim=2048,
                     num_experts=256, num_shared_experts=1, top_k=8, routed_scaling_factor=2.5, n_group=8,
                     topk_group=4, first_dense=3, max_seq_len=163840, num_mtp_layers=1,
                     rope_scaling=YarnRopeScaling(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
                                                  mscale=1.0, mscale_all_dim=1.0))

FLAVORS: dict[str, DeepseekV3Args] = {
    # q LoRA, v narrower than q/k, grouped routing with scaling, a dense first layer.
    "debug": DeepseekV3Args(vocab_size=128, max_seq_len=2048),
    # Benchmark shape, not a released model: DeepSeek-V3's MLA (q LoRA 1536, latent 512, rope 64,
    # nope 128, v 128) with 64 heads at dim 4096 and its MoE layer (1 shared + top-8 routed, 4
    # groups of which 2 eligible) with 32 experts: 5.75B parameters, 2.84B active, one GPU.
    "bench-mla-6B": replace(_V3, dim=4096, n_layers=8, n_heads=64, hidden_dim=11264, moe_hidden_dim=1408,
                            num_experts=32, n_group=4, topk_group=2, first_dense=1),
    # Benchmark shape, not a released model: DeepSeek-V3's layers unchanged (dim 7168, 128 MLA heads:
    # q LoRA 1536, latent 512, nope 128 / rope 64 / v 128, YaRN; dense layer 0 of 18432; MoE of
    # 2048-wide experts, 1 shared, top-8, 8 groups of which 4 eligible, scaling 2.5) on 3 of its 61
    # layers and 32 of its 256 experts: 5.72B parameters (3.60B active), trains on one H200.
    "v3-like-3L": replace(_V3, n_layers=3, num_experts=32, first_dense=1, num_mtp_layers=0),
    # The released shape and RoPE (YaRN, factor 40).
    "671B-A37B": _V3,
}

# Init scheme (GLM-4.5's): N(0, 0.02) for the embedding, attention projections, router and
# expert / dense w1/w3; the residual output projections (attention.wo, feed_forward.w2, the
# experts' and shared experts' w2) ~ N(0, 0.02 / sqrt(2 * n_layers)); RMSNorm weights (the
# latent norms too) 1; biases 0; the frozen expert bias 0.
INIT_RULES = SHARED_EXPERT_INIT_RULES

# Sharding plan as data (Qwen3-MoE's): experts split over ep on dim 0, wrapped on the expert-FSDP
# mesh, then every block, then the root. No inference TP.
PARALLEL_PLAN: dict[str, Any] = expert_parallel_plan()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TransformerBlock(SharedExpertBlock):
    """Pre-norm block: x + mla(norm(x)), then + ffn(norm(.)), ffn = `moe` or `feed_forward`
    (common/moe_block.py)."""

    def __init__(self, args: DeepseekV3Args, layer_id: int) -> None:
        super().__init__(args, layer_id, MLAttention(
            args.dim, args.n_heads, layer_id, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
            bias=args.attention_bias, rope_interleave=args.rope_interleave,
            softmax_scale=1.0 if args.rope_scaling is None else args.rope_scaling.softmax_scale))


class DeepseekV3(DecoderLM):
    """DeepSeek-V3 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load."""

    init_rules = INIT_RULES

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__(args, RotaryEmbedding(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Block-relative names. Attention (MLA; with or without the q LoRA, biases where attention_bias):
#
#   attention.wq.weight | wq_a.weight, q_norm.weight, wq_b.weight
#                      self_attn.q_proj.weight | q_a_proj.weight, q_a_layernorm.weight, q_b_proj.weight
#   attention.wkv_a    self_attn.kv_a_proj_with_mqa    (R + Dr, D)
#   attention.kv_norm  self_attn.kv_a_layernorm        (R,)
#   attention.wkv_b    self_attn.kv_b_proj             (H * (Dn + Dv), R)
#   attention.wo       self_attn.o_proj                (D, H * Dv)
#
# Dense layers: the SwiGLU. MoE layers: GLM-4.5's (router, e_score_correction_bias, shared_experts,
# per-expert keys; transformers 5's fused experts read).
KEY_MAP = KeyMap(
    label="DeepSeek-V3",
    hf_label="DeepseekV3",
    top=DECODER_KEYS,
    block={"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           **mla_keys(q_lora=True, bias=True), **mla_keys(q_lora=False, bias=True)},
    layer_keys={
        "dense": SWIGLU_KEYS,
        "MoE": ROUTED_MOE_KEYS,
    },
    layer_kind=lambda args, i: "MoE" if args.is_moe_layer(i) else "dense",
    experts=EXPERT_KEYS,
    fused_experts=FUSED_EXPERT_KEYS,
    expert_kind="MoE",
)


class DeepseekV3StateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py)."""

    key_map = KEY_MAP
