"""MiniMax-M2 (HF model_type "minimax_m2"), written against the `AttentionContext` contract.

One file holds everything a family needs: `MiniMaxM2Args` (to and from an HF `config.json`),
`FLAVORS`, the modules, `INIT_RULES`, `PARALLEL_PLAN` and `KEY_MAP` (applied by
common/state_dict.py).

The architecture, as transformers' `MiniMaxM2ForCausalLM` computes it:

- every layer is a MoE layer (common/moe.py's `MoE`), no shared expert; routing: sigmoid scores
  of the router logits (computed in the activation dtype, scored in fp32), a frozen
  score-correction bias (`moe.expert_bias`) added to choose the top-k but not to weight them,
  weights renormalised to sum 1;
- attention (common/gqa.py's `GQAttention`): no biases; q and k RMSNorm over *all* heads at once
  (qk_norm "full": the weights are (n_heads * head_dim,) and (n_kv_heads * head_dim,)), before
  the split into heads; RoPE on the first `rotary_dim` dims of each head (the hub config's
  rotary_dim, transformers 5's partial_rotary_factor).

The hub checkpoints keep Mixtral's names: `block_sparse_moe.gate.weight`,
`block_sparse_moe.e_score_correction_bias` and per-expert `block_sparse_moe.experts.{j}.w1/w2/w3`
(w1 = gate, w3 = up, w2 = down). transformers 5 renames them on load (`mlp.gate.weight`,
`mlp.e_score_correction_bias`, fused `mlp.experts.gate_up_proj` / `down_proj`); all of those are
read, and the hub names are written.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.gqa import GQAttention, gqa_keys
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL, Constant
from meshrl.models.common.moe import MoE, Routing
from meshrl.models.common.moe_block import expert_parallel_plan
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding
from meshrl.models.common.state_dict import DECODER_KEYS, KeyMap, StateDictAdapter

MODEL_TYPE = "minimax_m2"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MiniMaxM2Args:
    """Shape of a MiniMax-M2 model. Field names are ours; `from_hf_config` maps HF's names.

    `moe_hidden_dim` is each expert's SwiGLU width (HF intermediate_size: there are no dense layers).
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    moe_hidden_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    rotary_dim: int = 8
    rope_theta: float = 5_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 196608
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rotary_dim % 2 != 0 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        self.routing.check(self.num_experts, self.top_k)

    @property
    def routing(self) -> Routing:
        return Routing(score="sigmoid", norm_topk_prob=True, bias=True)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> MiniMaxM2Args:
        """Read an HF MiniMax-M2 `config.json` dict; features this file does not implement raise ValueError."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"MiniMax-M2 hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if (config.get("attention_dropout") or 0.0) > 0 or (config.get("router_jitter_noise") or 0.0) > 0:
            raise ValueError("MiniMax-M2 with attention_dropout or router_jitter_noise > 0 is not supported")
        if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("shared_intermediate_size"):
            raise ValueError("MiniMax-M2 with a scoring_func other than sigmoid or a shared expert is not supported")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or config.get("rope_scaling"):
            raise ValueError(f"only default RoPE is supported, got rope_parameters={rope!r} "
                             f"rope_scaling={config.get('rope_scaling')!r}")
        n_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
        # The hub writes rotary_dim; transformers 5 turns it into rope_parameters' partial_rotary_factor.
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        rotary_dim = config.get("rotary_dim") or (int(head_dim * factor) if factor else head_dim)
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=config.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            moe_hidden_dim=config["intermediate_size"],
            num_experts=config.get("num_local_experts", config.get("num_experts")),
            top_k=config["num_experts_per_tok"], rotary_dim=rotary_dim,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 5_000_000.0))),
            norm_eps=config.get("rms_norm_eps", 1e-6), tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 196608),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' MiniMaxM2ForCausalLM loads (the hub's field names)."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["MiniMaxM2ForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.moe_hidden_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k, "scoring_func": "sigmoid",
            "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
            "rotary_dim": self.rotary_dim, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},
            "router_aux_loss_coef": self.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False, "hidden_act": "silu", "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0,
            "use_cache": True, "initializer_range": 0.02, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }


_M2 = MiniMaxM2Args(vocab_size=200064, dim=3072, n_layers=62, n_heads=48, n_kv_heads=8, head_dim=128,
                    moe_hidden_dim=1536, num_experts=256, top_k=8, rotary_dim=64, rope_theta=5_000_000.0,
                    norm_eps=1e-6, max_seq_len=196608)

FLAVORS: dict[str, MiniMaxM2Args] = {
    "debug": MiniMaxM2Args(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           moe_hidden_dim=32, num_experts=8, top_k=2, rotary_dim=8, max_seq_len=2048),
    # Benchmark shape, not a released model: MiniMax-M2's layer (48 heads on 8 kv heads of 128,
    # rotary on 64 dims, top-8 experts of 1536) at 8 layers and 32 experts: 5.2B parameters,
    # 2.5B active, small enough to train on one GPU.
    "bench-5B": replace(_M2, n_layers=8, num_experts=32),
    "230B-A10B": _M2,
}

# Init scheme (Qwen3-MoE's): embedding, attention, router and expert w1/w3 ~ N(0, 0.02); the
# residual output projections (attention.wo, every expert's w2) ~ N(0, 0.02 / sqrt(2 * n_layers));
# the untied head ~ N(0, 0.02); RMSNorm weights (the q/k norms too) 1; the frozen expert bias 0.
INIT_RULES = (
    ("*norm.weight", ONES),
    ("*moe.expert_bias", Constant(0.0)),
    ("*attention.wo.weight", RESIDUAL),
    ("*moe.experts.w2", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data (Qwen3-MoE's): experts split over ep on dim 0 and wrapped on the
# expert-FSDP mesh, then every block, then the root. No inference TP (the full-width q/k norm
# would need an all-reduce over the heads, and a plan with "ep" is refused there anyway).
PARALLEL_PLAN: dict[str, Any] = expert_parallel_plan()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + moe(norm(.))."""

    def __init__(self, args: MiniMaxM2Args, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GQAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, layer_id, qk_norm="full",
                                     norm_eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, routing=args.routing)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.moe(self.ffn_norm(h))


class MiniMaxM2(DecoderLM):
    """MiniMax-M2 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load."""

    init_rules = INIT_RULES

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__(args, RotaryEmbedding(args.rotary_dim, args.rope_theta),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Block-relative names (hub spelling; transformers 5's in-memory names are read as aliases):
#
#   attention.wq/wk/wv/wo.weight            self_attn.q_proj/k_proj/v_proj/o_proj.weight
#   attention.q_norm/k_norm.weight          self_attn.q_norm/k_norm.weight  ((H * D,), (Hkv * D,))
#   moe.router.weight               (E, D)  block_sparse_moe.gate.weight            (mlp.gate.weight)
#   moe.expert_bias                   (E,)  block_sparse_moe.e_score_correction_bias (mlp.e_score_correction_bias)
#   moe.experts.w1 / w3          (E, I, D)  block_sparse_moe.experts.{j}.w1 / w3.weight
#   moe.experts.w2               (E, D, I)  block_sparse_moe.experts.{j}.w2.weight
#   (read only, transformers 5)             mlp.experts.gate_up_proj (E, 2I, D) = [w1; w3], mlp.experts.down_proj
KEY_MAP = KeyMap(
    label="MiniMax-M2",
    hf_label="MiniMaxM2",
    top=DECODER_KEYS,
    block={"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           **gqa_keys(qk_norm="full"),
           "moe.router.weight": "block_sparse_moe.gate.weight",
           "moe.expert_bias": "block_sparse_moe.e_score_correction_bias"},
    experts={
        "moe.experts.w1": "block_sparse_moe.experts.{j}.w1.weight",
        "moe.experts.w2": "block_sparse_moe.experts.{j}.w2.weight",
        "moe.experts.w3": "block_sparse_moe.experts.{j}.w3.weight",
    },
    fused_experts={
        "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
        "mlp.experts.down_proj": ("moe.experts.w2",),
    },
    hf_aliases={
        "mlp.gate.weight": "block_sparse_moe.gate.weight",
        "mlp.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias",
    },
)


class MiniMaxM2StateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py)."""

    key_map = KEY_MAP
