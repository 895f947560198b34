"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (HF model_type "glm4_moe"), written against `AttentionContext`.

One file holds everything a family needs:

- `Glm4MoeArgs` and its conversion to and from an HF `config.json` dict;
- `FLAVORS`: a tiny "debug" model that exercises every code path, a one-GPU benchmark shape and
  the released shapes;
- the modules: attention is common/gqa.py's `GQAttention` (q/k/v biases, optional per-head q/k
  RMSNorm, RoPE on the first half of each head), the feed-forward is a dense SwiGLU in the first
  `first_dense` layers and common/moe.py's `MoE` after them;
- `INIT_RULES`, `PARALLEL_PLAN` (FSDP units and expert sharding as data) and `KEY_MAP` (the
  explicit key map to HF's names, applied by common/state_dict.py).

What differs from Qwen3-MoE, all of it HF's `Glm4MoeForCausalLM`:

- routing (`Routing`): sigmoid scores computed in fp32 (x.float() @ router.float()); a frozen
  score-correction bias (`moe.expert_bias`, HF `mlp.gate.e_score_correction_bias`) is added to
  choose the experts but not to weight them; grouped top-k (`n_group` groups, each scored by the
  sum of its two best experts, only the `topk_group` best groups eligible); the k weights are
  renormalised (sum + 1e-20) and multiplied by `routed_scaling_factor`;
- `num_shared_experts` shared experts, one SwiGLU of width moe_hidden_dim * num_shared_experts
  added without a gate;
- partial rotary (`partial_rotary_factor`, 0.5 on every release): RoPE on the first
  head_dim * factor dims of each head, the rest pass through;
- attention biases on q, k and v (not o); `use_qk_norm` (GLM-4.5, 4.6) normalises each head.

Checkpoints carry the multi-token-prediction layer(s) as layers n_layers.. (e.g. layer 92 of
GLM-4.5); `num_mtp_layers` of them are dropped on load, as transformers drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.gqa import GQAttention, gqa_keys
from meshrl.models.common.moe import Routing
from meshrl.models.common.moe_block import SHARED_EXPERT_INIT_RULES, SharedExpertBlock, expert_parallel_plan
from meshrl.models.common.rope import RotaryEmbedding
from meshrl.models.common.state_dict import (DECODER_KEYS, EXPERT_KEYS, FUSED_EXPERT_KEYS, ROUTED_MOE_KEYS, SWIGLU_KEYS,
                                             KeyMap, StateDictAdapter)

MODEL_TYPE = "glm4_moe"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Glm4MoeArgs:
    """Shape of a GLM-4.5 model. Field names are ours; `from_hf_config` maps HF's names.

    `hidden_dim` is the dense layers' SwiGLU width (HF intermediate_size), `moe_hidden_dim` each
    routed expert's (moe_intermediate_size); layers < `first_dense` (first_k_dense_replace) are dense.
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    moe_hidden_dim: int = 32
    num_experts: int = 8
    num_shared_experts: int = 1
    top_k: int = 2
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_dense: int = 1
    attention_bias: bool = True
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    num_mtp_layers: int = 0
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rotary_dim % 2 != 0 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} must "
                             f"give an even rotary dim in (0, head_dim], got {self.rotary_dim}")
        if self.num_shared_experts < 1:
            # transformers builds zero-width shared experts then; no release has none.
            raise ValueError(f"GLM-4.5 needs n_shared_experts >= 1, got {self.num_shared_experts}")
        if not 0 <= self.first_dense <= self.n_layers:
            raise ValueError(f"first_dense (first_k_dense_replace) must be in [0, {self.n_layers}]")
        self.routing.check(self.num_experts, self.top_k)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def routing(self) -> Routing:
        return Routing(score="sigmoid", norm_topk_prob=self.norm_topk_prob, bias=True, num_groups=self.n_group,
                       topk_groups=self.topk_group, scale=self.routed_scaling_factor, norm_eps=1e-20, fp32=True)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Glm4MoeArgs:
        """Read an HF GLM-4.5 `config.json` dict; features this file does not implement raise ValueError."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"GLM-4.5 hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if (config.get("attention_dropout") or 0.0) > 0:
            raise ValueError("GLM-4.5 with attention_dropout > 0 is not supported")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or config.get("rope_scaling"):
            raise ValueError(f"only default RoPE is supported, got rope_parameters={rope!r} "
                             f"rope_scaling={config.get('rope_scaling')!r}")
        n_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            hidden_dim=config["intermediate_size"], moe_hidden_dim=config["moe_intermediate_size"],
            num_experts=config.get("n_routed_experts", config.get("num_local_experts")),
            num_shared_experts=config.get("n_shared_experts", 1), top_k=config["num_experts_per_tok"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            n_group=config.get("n_group", 1), topk_group=config.get("topk_group", 1),
            first_dense=config.get("first_k_dense_replace", 1), attention_bias=config.get("attention_bias", False),
            use_qk_norm=config.get("use_qk_norm", False),
            # transformers 5 keeps the factor in rope_parameters, 4.x and the hub at the top (default 0.5).
            partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
            norm_eps=config.get("rms_norm_eps", 1e-5), tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 131072),
            num_mtp_layers=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' Glm4MoeForCausalLM loads (4.5x and 5.x)."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["Glm4MoeForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.hidden_dim,
            "moe_intermediate_size": self.moe_hidden_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "n_routed_experts": self.num_experts, "n_shared_experts": self.num_shared_experts,
            "num_experts_per_tok": self.top_k, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "n_group": self.n_group,
            "topk_group": self.topk_group, "first_k_dense_replace": self.first_dense,
            "attention_bias": self.attention_bias, "use_qk_norm": self.use_qk_norm,
            "num_nextn_predict_layers": self.num_mtp_layers, "router_aux_loss_coef": self.router_aux_loss_coef,
            "hidden_act": "silu", "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
            # Both spellings: 4.x reads the top-level fields, 5.x rope_parameters.
            "partial_rotary_factor": self.partial_rotary_factor, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
            "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id, "torch_dtype": dtype_name, "dtype": dtype_name,
        }


_GLM = Glm4MoeArgs(vocab_size=151552, n_heads=96, n_kv_heads=8, head_dim=128, num_shared_experts=1, top_k=8,
                   attention_bias=True, partial_rotary_factor=0.5, rope_theta=1_000_000.0, norm_eps=1e-5,
                   max_seq_len=131072, num_mtp_layers=1)

FLAVORS: dict[str, Glm4MoeArgs] = {
    # Grouped routing (2 groups, 1 eligible), routed scaling, q/k norm, a dense first layer.
    "debug": Glm4MoeArgs(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                         moe_hidden_dim=32, num_experts=8, num_shared_experts=1, top_k=2, n_group=2, topk_group=1,
                         routed_scaling_factor=2.5, first_dense=1, use_qk_norm=True, max_seq_len=2048),
    # Benchmark shape, not a released model: GLM-4.5-Air's layer (head_dim 128, partial rotary,
    # biases, 1 shared + top-8 routed experts) scaled to one GPU: 5.2B parameters, 1.5B active.
    "bench-air-5B": replace(_GLM, dim=2048, n_layers=16, n_heads=32, n_kv_heads=4, hidden_dim=5632,
                            moe_hidden_dim=704, num_experts=64, first_dense=1),
    # Benchmark shape, not a released model: GLM-4.5-Air's layers unchanged (hidden 4096, 96 heads
    # of 128 / 8 kv, half rotary, biases, 128 experts of 1408 top-8 + 1 shared, dense layer 0 of
    # 10944), only 3 of its 46 layers: 6.17B parameters (2.02B active), trains on one H200.
    "air-like-3L": replace(_GLM, dim=4096, n_layers=3, hidden_dim=10944, moe_hidden_dim=1408, num_experts=128,
                           first_dense=1, routed_scaling_factor=1.0, use_qk_norm=False, num_mtp_layers=0),
    "air-106B-A12B": replace(_GLM, dim=4096, n_layers=46, hidden_dim=10944, moe_hidden_dim=1408, num_experts=128,
                             first_dense=1, routed_scaling_factor=1.0, use_qk_norm=False),
    "355B-A32B": replace(_GLM, dim=5120, n_layers=92, hidden_dim=12288, moe_hidden_dim=1536, num_experts=160,
                         first_dense=3, routed_scaling_factor=2.5, use_qk_norm=True),
}

# Init scheme (Qwen3-MoE's): embedding, attention, dense SwiGLU, router, routed and shared
# expert w1/w3 ~ N(0, 0.02); the residual output projections (attention.wo, feed_forward.w2,
# the experts' and shared experts' w2) ~ N(0, 0.02 / sqrt(2 * n_layers)); the untied head
# ~ N(0, 0.02); RMSNorm weights 1; attention biases 0; the frozen expert bias 0.
INIT_RULES = SHARED_EXPERT_INIT_RULES

# Sharding plan as data (Qwen3-MoE's): the expert groups on the expert-FSDP mesh once EP has
# split them on dim 0, then every block, then the root. No inference TP (a plan with "ep").
PARALLEL_PLAN: dict[str, Any] = expert_parallel_plan()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TransformerBlock(SharedExpertBlock):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)), ffn = `moe` or `feed_forward`
    (common/moe_block.py); attention is GQA with q/k/v biases and optional per-head q/k norms."""

    def __init__(self, args: Glm4MoeArgs, layer_id: int) -> None:
        super().__init__(args, layer_id, GQAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, layer_id, qkv_bias=args.attention_bias,
            qk_norm="head" if args.use_qk_norm else "none", norm_eps=args.norm_eps))


class Glm4Moe(DecoderLM):
    """GLM-4.5 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load.

    Same contract as `Qwen3Moe` (forward, hidden, output_weight, layers "0".."n-1", moe_aux_loss).
    """

    init_rules = INIT_RULES

    def __init__(self, args: Glm4MoeArgs) -> None:
        super().__init__(args, RotaryEmbedding(args.rotary_dim, args.rope_theta),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Block-relative names. Every block: GQAttention (biases and q/k norms where the config has them)
# and the two norms. Dense layers: the SwiGLU. MoE layers:
#
#   moe.router.weight                 (E, D)  mlp.gate.weight
#   moe.expert_bias                     (E,)  mlp.gate.e_score_correction_bias
#   moe.shared_expert.w1/w2/w3.weight         mlp.shared_experts.gate_proj/down_proj/up_proj.weight
#   moe.experts.w1/w3              (E, I, D)  mlp.experts.{j}.gate_proj/up_proj.weight, j < E
#   moe.experts.w2                 (E, D, I)  mlp.experts.{j}.down_proj.weight
#   (read only, transformers 5)               mlp.experts.gate_up_proj (E, 2I, D), mlp.experts.down_proj
KEY_MAP = KeyMap(
    label="GLM-4.5",
    hf_label="Glm4Moe",
    top=DECODER_KEYS,
    block={"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           **gqa_keys(qkv_bias=True, qk_norm="head")},
    layer_keys={
        "dense": SWIGLU_KEYS,
        "MoE": ROUTED_MOE_KEYS,
    },
    layer_kind=lambda args, i: "MoE" if args.is_moe_layer(i) else "dense",
    experts=EXPERT_KEYS,
    fused_experts=FUSED_EXPERT_KEYS,
    expert_kind="MoE",
)


class Glm4MoeStateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py)."""

    key_map = KEY_MAP
