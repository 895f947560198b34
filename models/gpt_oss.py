"""gpt-oss (HF model_type "gpt_oss": gpt-oss-20b, gpt-oss-120b), written against `AttentionContext`.

One file holds everything a family needs: `GptOssArgs` (to and from an HF `config.json`),
`FLAVORS`, the modules, `INIT_RULES`, `PARALLEL_PLAN` and `KEY_MAP` (applied by
common/state_dict.py).

The architecture, as transformers' `GptOssForCausalLM` computes it:

- attention (common/gqa.py's `GQAttention`): q/k/v and output biases; one learned sink logit per
  query head (`attention.sinks`) that joins every softmax with a zero value; layers alternate
  sliding-window (`sliding_window` tokens, layer_types "sliding_attention") and full attention;
  RoPE over the whole head with YaRN scaling (common/rope.py's `YarnRopeScaling`);
- every layer is a MoE layer (common/moe.py's `MoE`): a router with a bias, softmax over the k
  best logits (= the renormalised top-k of the full softmax), experts with biases on all three
  projections and a clamped SwiGLU (`ClampedSwiGLU`: alpha 1.702, limit 7), no shared expert;
- RMSNorm multiplies by its weight in fp32 before casting back (`weight_in_fp32`).

HF keeps every layer's experts as four packed tensors, which the adapter converts (`Packed`):
`mlp.experts.gate_up_proj` (E, D, 2I) with gate and up interleaved along the last dim (gate at
even columns) <-> our w1, w3 (E, I, D); `gate_up_proj_bias` (E, 2I) <-> b1, b3; `down_proj`
(E, I, D) <-> w2 (E, D, I); `down_proj_bias` <-> b2. The released checkpoints store the expert
weights MXFP4-quantized (`*_blocks`, `*_scales`); those are refused: dequantize to bf16 first
(transformers: `Mxfp4Config(dequantize=True)`, then `save_pretrained`).

Trainer attention: sinks and windows run on the "sdpa" backend (an exact fp32-softmax reference
that materialises (B, H, T, T) scores); "flex" and "varlen" refuse them for now. The engine masks
the window (it keeps every block) and takes its torch path for these layers.
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
from meshrl.models.common.moe import ClampedSwiGLU, MoE, Routing
from meshrl.models.common.moe_block import expert_parallel_plan
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding, YarnRopeScaling
from meshrl.models.common.state_dict import DECODER_KEYS, KeyMap, Packed, StateDictAdapter

MODEL_TYPE = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"


def _alternating(n_layers: int) -> tuple[str, ...]:
    """transformers' default layer_types: sliding on even layers, full on odd ones."""
    return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n_layers))


_GPT_OSS_YARN = YarnRopeScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptOssArgs:
    """Shape of a gpt-oss model. Field names are ours; `from_hf_config` maps HF's names.

    `moe_hidden_dim` is each expert's width (HF intermediate_size); `layer_types[i]` is
    "sliding_attention" or "full_attention"; `rope_scaling` None is plain RoPE.
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
    sliding_window: int = 4
    layer_types: tuple[str, ...] = (SLIDING, FULL)
    rope_theta: float = 150_000.0
    rope_scaling: YarnRopeScaling | None = _GPT_OSS_YARN
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {self.n_layers} layers, "
                             f"got {list(self.layer_types)}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        self.routing.check(self.num_experts, self.top_k)

    @property
    def routing(self) -> Routing:
        return Routing(score="softmax", norm_topk_prob=True, router_bias=True)

    def window(self, layer_id: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> GptOssArgs:
        """Read an HF gpt-oss `config.json` dict; features this file does not implement raise ValueError."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
        if config.get("quantization_config"):
            raise ValueError(f"quantized gpt-oss checkpoints ({config['quantization_config'].get('quant_method')}) are "
                             "not supported: dequantize to bf16 first (transformers Mxfp4Config(dequantize=True), "
                             "then save_pretrained)")
        if (config.get("attention_dropout") or 0.0) > 0:
            raise ValueError("gpt-oss with attention_dropout > 0 is not supported")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"gpt-oss RoPE {rope_type!r} is not supported (default or yarn)")
        n_layers = config["num_hidden_layers"]
        n_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            moe_hidden_dim=config["intermediate_size"],
            num_experts=config.get("num_local_experts", config.get("num_experts")),
            top_k=config["num_experts_per_tok"], sliding_window=config.get("sliding_window") or 128,
            layer_types=tuple(config.get("layer_types") or _alternating(n_layers)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 150_000.0))),
            rope_scaling=YarnRopeScaling.from_hf(rope) if rope_type == "yarn" else None,
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            attention_bias=config.get("attention_bias", True), norm_eps=config.get("rms_norm_eps", 1e-5),
            tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 131072),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' GptOssForCausalLM loads."""
        dtype_name = str(dtype).removeprefix("torch.")
        rope = ({"rope_type": "default", "rope_theta": self.rope_theta} if self.rope_scaling is None
                else self.rope_scaling.to_hf(self.rope_theta))
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.moe_hidden_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k,
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
            "rope_theta": self.rope_theta, "rope_parameters": rope, "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit, "attention_bias": self.attention_bias,
            "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": False, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
            "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id, "torch_dtype": dtype_name, "dtype": dtype_name,
        }


_OSS = GptOssArgs(vocab_size=201088, dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, moe_hidden_dim=2880,
                  top_k=4, sliding_window=128, rope_theta=150_000.0, rope_scaling=_GPT_OSS_YARN, max_seq_len=131072)

FLAVORS: dict[str, GptOssArgs] = {
    # A window of 4 tokens, so test prompts cross it; sinks, biases, yarn RoPE.
    "debug": GptOssArgs(vocab_size=128, max_seq_len=2048),
    # Benchmark shape, not a released model: gpt-oss-20b's layer (64 heads on 8 of 64 dims, top-4
    # experts of 2880, window 128 / full alternating) at 8 layers and 16 experts: 4.6B parameters.
    "bench-5B": replace(_OSS, n_layers=8, num_experts=16, layer_types=_alternating(8)),
    "20b": replace(_OSS, n_layers=24, num_experts=32, layer_types=_alternating(24)),
    "120b": replace(_OSS, n_layers=36, num_experts=128, layer_types=_alternating(36)),
}

# Init scheme: N(0, 0.02) for the embedding, attention projections, sinks, router and expert
# w1/w3; the residual output projections (attention.wo, every expert's w2) ~ N(0, 0.02 /
# sqrt(2 * n_layers)); every bias 0; RMSNorm weights 1; the untied head N(0, 0.02).
INIT_RULES = (
    ("*norm.weight", ONES),
    ("*.bias", Constant(0.0)),
    ("*moe.experts.b?", Constant(0.0)),
    ("*attention.wo.weight", RESIDUAL),
    ("*moe.experts.w2", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data: every expert tensor (weights and biases) split over ep on dim 0 and
# wrapped on the expert-FSDP mesh, then every block, then the root. No inference TP.
PARALLEL_PLAN: dict[str, Any] = expert_parallel_plan()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + moe(norm(.))."""

    def __init__(self, args: GptOssArgs, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps, weight_in_fp32=True)
        self.attention = GQAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, layer_id,
                                     qkv_bias=args.attention_bias, out_bias=args.attention_bias,
                                     window=args.window(layer_id), sinks=True)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps, weight_in_fp32=True)
        self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, routing=args.routing,
                       expert_biases=True, activation=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.moe(self.ffn_norm(h))


class GptOss(DecoderLM):
    """gpt-oss causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load."""

    init_rules = INIT_RULES

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args, RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, weight_in_fp32=True)


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------


def _interleave(a: Tensor, b: Tensor) -> Tensor:
    """(..., n) and (..., n) -> (..., 2n) with a at even and b at odd positions."""
    return torch.stack([a, b], dim=-1).flatten(-2)


# Block-relative names:
#
#   attention.wq/wk/wv/wo.weight, .bias    self_attn.q_proj/k_proj/v_proj/o_proj.weight, .bias
#   attention.sinks               (H,)     self_attn.sinks
#   moe.router.weight, .bias      (E, D)   mlp.router.weight, .bias
#   moe.experts.w1, w3        (E, I, D)    mlp.experts.gate_up_proj (E, D, 2I): [:, :, 0::2] = w1^T, [:, :, 1::2] = w3^T
#   moe.experts.b1, b3           (E, I)    mlp.experts.gate_up_proj_bias (E, 2I), interleaved the same way
#   moe.experts.w2            (E, D, I)    mlp.experts.down_proj (E, I, D) = w2^T
#   moe.experts.b2               (E, D)    mlp.experts.down_proj_bias
KEY_MAP = KeyMap(
    label="gpt-oss",
    hf_label="GptOss",
    top=DECODER_KEYS,
    block={"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           **gqa_keys(qkv_bias=True, out_bias=True, sinks=True),
           "moe.router.weight": "mlp.router.weight", "moe.router.bias": "mlp.router.bias"},
    packed={
        "mlp.experts.gate_up_proj": Packed(
            ("moe.experts.w1", "moe.experts.w3"),
            unpack=lambda t: (t[..., 0::2].transpose(1, 2), t[..., 1::2].transpose(1, 2)),
            pack=lambda w1, w3: _interleave(w1.transpose(1, 2), w3.transpose(1, 2))),
        "mlp.experts.gate_up_proj_bias": Packed(
            ("moe.experts.b1", "moe.experts.b3"), unpack=lambda t: (t[..., 0::2], t[..., 1::2]), pack=_interleave),
        "mlp.experts.down_proj": Packed(
            ("moe.experts.w2",), unpack=lambda t: (t.transpose(1, 2),), pack=lambda w2: w2.transpose(1, 2).contiguous()),
        "mlp.experts.down_proj_bias": Packed(("moe.experts.b2",), unpack=lambda t: (t,), pack=lambda b2: b2),
    },
)


class GptOssStateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py)."""

    key_map = KEY_MAP
