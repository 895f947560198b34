"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid Gated DeltaNet + gated full attention.

HF model types "qwen3_next" (Qwen3NextForCausalLM), "qwen3_5" / "qwen3_5_text" (Qwen3.5 dense) and
"qwen3_5_moe" / "qwen3_5_moe_text" (Qwen3.5-MoE). One file, three args classes, one model class:

- `layer_types[i]` is "linear_attention" (most layers) or "full_attention" (every 4th on the
  releases). A linear layer is Gated DeltaNet: projections to q, k, v (key heads Hk, value heads
  Hv, Hv a multiple of Hk), a gate z and per-value-head b, a; a causal depthwise conv (kernel 4,
  SiLU) over [q, k, v]; L2-normalised q, k; the gated delta rule with beta = sigmoid(b) and log
  decay g = -exp(A_log) * softplus(a + dt_bias) (common/linear_attention.py); a per-head
  RMSNorm times silu(z); out_proj. Both recurrences restart at each packed document's start.
- a full layer is GQA with an output gate: q_proj yields [q; gate] per head, q/k RMSNorm per head,
  RoPE on the first head_dim * partial_rotary_factor dims (0.25), out = o_proj(attn * sigmoid(gate)).
- every RMSNorm outside the DeltaNet output norm is zero-centred (weight + 1, common/norm.py's
  `OffsetRMSNorm`).
- the feed-forward is common/moe.py's `MoE` (softmax top-k, norm_topk_prob, a shared expert with a
  sigmoid gate) on Qwen3-Next's MoE layers (HF's decoder_sparse_step / mlp_only_layers rule) and
  on every Qwen3.5-MoE layer; a dense SwiGLU otherwise (all of Qwen3.5 dense).

Qwen3-Next fuses its DeltaNet projections per key head (in_proj_qkvz rows are, per key head,
[q (Dk), k (Dk), v (r*Dv), z (r*Dv)] with r = Hv/Hk, in_proj_ba [b (r), a (r)]); Qwen3.5 has four
separate projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Our parameters keep HF's
layouts, so the key map is a rename.

Qwen3.5's hub folders are the vision-language model (model_type "qwen3_5", the decoder's config in
`text_config`, weights under model.language_model., a vision tower under model.visual.): the text
decoder is read and the vision tower and the MTP module (mtp.*) are dropped; meshrl saves the
text-only model types (qwen3_5_text, qwen3_5_moe_text) that transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM load. Its multimodal RoPE (mrope_section) equals plain RoPE for text, where
the three position streams are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL, Constant
from meshrl.models.common.linear_attention import (GatedRMSNorm, causal_conv, chunk_gated_delta_rule, l2norm,
                                                   linear_attend, recurrent_gated_delta_rule)
from meshrl.models.common.moe import MoE
from meshrl.models.common.norm import OffsetRMSNorm
from meshrl.models.common.rope import RotaryEmbedding, apply_rope
from meshrl.models.common.state_dict import (DECODER_KEYS, EXPERT_KEYS, FUSED_EXPERT_KEYS, SWIGLU_KEYS, KeyMap,
                                             StateDictAdapter)

LINEAR, FULL = "linear_attention", "full_attention"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


def default_layer_types(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """HF's default: every `interval`-th layer (1-based) is full attention, the others linear."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


@dataclass(frozen=True)
class HybridArgs:
    """Shape of a hybrid Qwen model (the three subclasses differ in model type and layout).

    `hidden_dim` is the dense SwiGLU width (HF intermediate_size), `moe_hidden_dim` each expert's,
    `shared_hidden_dim` the shared expert's (0: none). `layer_types` empty means HF's default (every
    4th layer full). The linear layers have `linear_k_heads` key/query heads of `linear_k_dim` and
    `linear_v_heads` value heads of `linear_v_dim`, and a conv kernel of `conv_kernel`.
    """

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    LABEL: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""
    fused_projections: ClassVar[bool] = False  # Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    partial_rotary_factor: float = 0.25
    layer_types: tuple[str, ...] = ()
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 16
    linear_v_dim: int = 16
    conv_kernel: int = 4
    hidden_dim: int = 128
    moe_hidden_dim: int = 32
    shared_hidden_dim: int = 32
    num_experts: int = 0
    top_k: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 10_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 262144

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.n_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"{self.LABEL}: layer_types must be {self.n_layers} of {LINEAR!r} / {FULL!r}, "
                             f"got {list(self.layer_types)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.linear_v_heads % self.linear_k_heads != 0:
            raise ValueError(f"linear_num_value_heads ({self.linear_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_k_heads})")
        if self.rotary_dim % 2 != 0 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                             f"must give an even rotary dim in (0, head_dim]")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k (num_experts_per_tok) must be in [1, {self.num_experts}], got {self.top_k}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    def is_moe_layer(self, layer_id: int) -> bool:
        """HF's rule (Qwen3-Next): MoE unless in mlp_only_layers or off the decoder_sparse_step grid."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> HybridArgs:
        """Read an HF config dict (Qwen3.5's `text_config` when present); unimplemented features raise ValueError."""
        if config.get("model_type") not in cls.MODEL_TYPES:
            raise ValueError(f"expected model_type in {list(cls.MODEL_TYPES)}, got {config.get('model_type')!r}")
        text = {**config, **(config.get("text_config") or {})}
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cls.LABEL} hidden_act {text['hidden_act']!r} is not supported (only 'silu')")
        if text.get("attention_bias"):
            raise ValueError(f"{cls.LABEL} with attention_bias is not supported")
        if (text.get("attention_dropout") or 0.0) > 0:
            raise ValueError(f"{cls.LABEL} with attention_dropout > 0 is not supported")
        rope = text.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or text.get("rope_scaling"):
            raise ValueError(f"{cls.LABEL}: only default RoPE is supported, got rope_parameters={rope!r}")
        n_heads = text["num_attention_heads"]
        n_layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types") or default_layer_types(n_layers, text.get("full_attention_interval", 4))
        return cls(
            vocab_size=text["vocab_size"], dim=text["hidden_size"], n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=text.get("num_key_value_heads") or n_heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // n_heads,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            layer_types=tuple(layer_types),
            linear_k_heads=text["linear_num_key_heads"], linear_v_heads=text["linear_num_value_heads"],
            linear_k_dim=text["linear_key_head_dim"], linear_v_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4), **cls._ffn_from_hf(text),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
            norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_embeddings=config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            max_seq_len=text.get("max_position_embeddings", 262144),
        )

    @classmethod
    def _ffn_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _ffn_to_hf(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32, bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' causal LM class of this family loads."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPES[-1],
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "layer_types": list(self.layer_types), "linear_num_key_heads": self.linear_k_heads,
            "linear_num_value_heads": self.linear_v_heads, "linear_key_head_dim": self.linear_k_dim,
            "linear_value_head_dim": self.linear_v_dim, "linear_conv_kernel_dim": self.conv_kernel,
            **self._ffn_to_hf(), "hidden_act": "silu", "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
            "use_cache": True, "initializer_range": 0.02, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "dtype": dtype_name,
        }


@dataclass(frozen=True)
class Qwen3NextArgs(HybridArgs):
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_next",)
    LABEL: ClassVar[str] = "Qwen3-Next"
    ARCHITECTURE: ClassVar[str] = "Qwen3NextForCausalLM"
    fused_projections: ClassVar[bool] = True
    num_experts: int = 8

    @classmethod
    def _ffn_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        return dict(hidden_dim=text["intermediate_size"], moe_hidden_dim=text["moe_intermediate_size"],
                    shared_hidden_dim=text.get("shared_expert_intermediate_size") or 0,
                    num_experts=text.get("num_experts", text.get("num_local_experts", 0)),
                    top_k=text["num_experts_per_tok"], norm_topk_prob=text.get("norm_topk_prob", True),
                    decoder_sparse_step=text.get("decoder_sparse_step", 1),
                    mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
                    router_aux_loss_coef=text.get("router_aux_loss_coef", 0.001))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts and self.shared_hidden_dim < 1:
            # transformers builds a shared expert (and its gate) on every MoE layer of Qwen3-Next.
            raise ValueError("Qwen3-Next MoE layers need shared_expert_intermediate_size >= 1")

    def _ffn_to_hf(self) -> dict[str, Any]:
        return {"intermediate_size": self.hidden_dim, "moe_intermediate_size": self.moe_hidden_dim,
                "shared_expert_intermediate_size": self.shared_hidden_dim, "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef}


@dataclass(frozen=True)
class Qwen3_5Args(HybridArgs):
    """Qwen3.5 dense: every feed-forward is a SwiGLU (num_experts stays 0)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5", "qwen3_5_text")
    LABEL: ClassVar[str] = "Qwen3.5"
    ARCHITECTURE: ClassVar[str] = "Qwen3_5ForCausalLM"
    moe_hidden_dim: int = 0
    shared_hidden_dim: int = 0

    @classmethod
    def _ffn_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        return dict(hidden_dim=text["intermediate_size"], num_experts=0, shared_hidden_dim=0, moe_hidden_dim=0)

    def _ffn_to_hf(self) -> dict[str, Any]:
        return {"intermediate_size": self.hidden_dim}


@dataclass(frozen=True)
class Qwen3_5MoeArgs(HybridArgs):
    """Qwen3.5-MoE: every layer's feed-forward is MoE with a gated shared expert, top-k renormalised."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5_moe", "qwen3_5_moe_text")
    LABEL: ClassVar[str] = "Qwen3.5-MoE"
    ARCHITECTURE: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    num_experts: int = 8
    hidden_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts < 1 or self.decoder_sparse_step != 1 or self.mlp_only_layers or not self.norm_topk_prob:
            raise ValueError("Qwen3.5-MoE has MoE on every layer with renormalised top-k weights")

    @classmethod
    def _ffn_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        return dict(hidden_dim=0, moe_hidden_dim=text["moe_intermediate_size"],
                    shared_hidden_dim=text.get("shared_expert_intermediate_size") or 0,
                    num_experts=text["num_experts"], top_k=text["num_experts_per_tok"],
                    router_aux_loss_coef=text.get("router_aux_loss_coef", 0.001))

    def _ffn_to_hf(self) -> dict[str, Any]:
        return {"moe_intermediate_size": self.moe_hidden_dim, "shared_expert_intermediate_size": self.shared_hidden_dim,
                "num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                "router_aux_loss_coef": self.router_aux_loss_coef}


_NEXT = dict(vocab_size=151936, dim=2048, n_heads=16, n_kv_heads=2, head_dim=256, linear_k_heads=16,
             linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, hidden_dim=5120, moe_hidden_dim=512,
             shared_hidden_dim=512, top_k=10, rope_theta=10_000_000.0)
_QWEN35 = dict(vocab_size=248320, linear_k_heads=16, linear_k_dim=128, linear_v_dim=128, head_dim=256,
               rope_theta=10_000_000.0)

NEXT_FLAVORS: dict[str, Qwen3NextArgs] = {
    # Every path: 3 linear + 1 full layer, value heads 2 per key head, a dense layer (mlp_only), a gated shared expert.
    "debug": Qwen3NextArgs(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                           linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16, hidden_dim=128,
                           moe_hidden_dim=32, shared_hidden_dim=32, num_experts=8, top_k=2, mlp_only_layers=(1,),
                           max_seq_len=2048),
    # Benchmark shape, not a release: Qwen3-Next's layer on 12 layers and 64 experts (one GPU).
    "bench-4B": Qwen3NextArgs(**_NEXT, n_layers=12, num_experts=64),
    # Qwen3-Next-80B-A3B (hidden 2048, 48 layers, 512 experts, top-10, shared expert 512).
    "80B-A3B": Qwen3NextArgs(**_NEXT, n_layers=48, num_experts=512),
}
QWEN3_5_FLAVORS: dict[str, Qwen3_5Args] = {
    "debug": Qwen3_5Args(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, linear_k_heads=2,
                         linear_v_heads=4, linear_k_dim=16, linear_v_dim=16, hidden_dim=128, max_seq_len=2048),
    # Benchmark shape, not a released model: Qwen3.5's layer conventions (3 Gated DeltaNet layers of
    # 16 key / 16 value heads of 128, then one gated full-attention layer of 8 / 2 heads of 256,
    # quarter rotary, tied vocabulary 248320) at 2B: hidden 2048, 24 layers, SwiGLU 6144.
    "like-2B-24L": Qwen3_5Args(**_QWEN35, dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, linear_v_heads=16,
                               hidden_dim=6144, tie_embeddings=True),
    # Qwen3.5-27B's text decoder (hidden 5120, 64 layers, 24/4 heads, 48 value heads).
    "27B": Qwen3_5Args(**_QWEN35, dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, linear_v_heads=48,
                       hidden_dim=17408),
}
QWEN3_5_MOE_FLAVORS: dict[str, Qwen3_5MoeArgs] = {
    "debug": Qwen3_5MoeArgs(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                            linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16, hidden_dim=0,
                            moe_hidden_dim=32, shared_hidden_dim=32, num_experts=8, top_k=2, max_seq_len=2048),
    # Qwen3.5-35B-A3B's text decoder (hidden 2048, 40 layers, 256 experts, top-8).
    "35B-A3B": Qwen3_5MoeArgs(**_QWEN35, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, linear_v_heads=32,
                              hidden_dim=0, moe_hidden_dim=512, shared_hidden_dim=512, num_experts=256, top_k=8),
}

# Init scheme: embedding, projections, router, conv and expert w1/w3 ~ N(0, 0.02); the residual
# outputs (attention.wo, linear_attention.out_proj, feed_forward.w2, experts' and shared expert's
# w2) ~ N(0, 0.02 / sqrt(2 * n_layers)); zero-centred norms 0 (a gain of 1); the DeltaNet output
# norm 1; dt_bias 1 and A_log 0 (decay rate A = 1; HF draws A ~ U(0.01, 16)).
INIT_RULES = (
    ("*linear_attention.norm.weight", ONES),
    ("*norm.weight", Constant(0.0)),
    ("*dt_bias", ONES),
    ("*A_log", Constant(0.0)),
    ("*attention.wo.weight", RESIDUAL),
    ("*linear_attention.out_proj.weight", RESIDUAL),
    ("*feed_forward.w2.weight", RESIDUAL),
    ("*moe.experts.w2", RESIDUAL),
    ("*moe.shared_expert.w2.weight", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data (Qwen3-MoE's for the MoE families). `no_cp`: a DeltaNet recurrence runs
# over the whole row, which context parallelism splits over ranks (refused before launch).
_NO_CP = "linear-attention (Gated DeltaNet) layers run a recurrence over the whole row"
PARALLEL_PLAN: dict[str, Any] = {
    "fsdp_units": ["layers.*"],
    "expert_fsdp_units": ["layers.*.moe.experts"],
    "ep": {"layers.*.moe.experts": "shard_dim0"},
    "no_cp": _NO_CP,
}
DENSE_PARALLEL_PLAN: dict[str, Any] = {"fsdp_units": ["layers.*"], "no_cp": _NO_CP}


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """GQA with a sigmoid output gate: wq yields [q; gate] per head; q/k zero-centred RMSNorm; partial RoPE."""

    def __init__(self, args: HybridArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim); cos, sin: (B, T, R) -> (B, T, dim)
        B, T, _ = x.shape
        q, gate = self.wq(x).view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(B, T, -1, self.head_dim))
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        out = attn.attend(self.layer_id, q, k, v).transpose(1, 2)  # (B, T, Hq, D)
        return self.wo((out * torch.sigmoid(gate)).reshape(B, T, -1))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (module docstring); the recurrence runs under `linear_attend`."""

    def __init__(self, args: HybridArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.fused = args.fused_projections
        self.k_heads, self.v_heads = args.linear_k_heads, args.linear_v_heads
        self.k_dim, self.v_dim = args.linear_k_dim, args.linear_v_dim
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = 2 * key + value
        if self.fused:
            self.in_proj_qkvz = nn.Linear(args.dim, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(args.dim, 2 * self.v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(args.dim, 2 * key + value, bias=False)
            self.in_proj_z = nn.Linear(args.dim, value, bias=False)
            self.in_proj_b = nn.Linear(args.dim, self.v_heads, bias=False)
            self.in_proj_a = nn.Linear(args.dim, self.v_heads, bias=False)
        self.conv1d = nn.Module()  # holds `weight` (C, 1, K): nn.Conv1d's depthwise layout and HF's key
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, args.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(value, args.dim, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's (conv state (C, K-1), delta-rule state (Hv, Dk, Dv)): what the engine keeps
        per row for this layer (models/common/probe.py counts them without a forward)."""
        return (self.conv_dim, self.conv1d.weight.shape[-1] - 1), (self.v_heads, self.k_dim, self.v_dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> qkv (B, T, C) as [q heads, k heads, v heads], z (B, T, Hv, Dv), b and a (B, T, Hv)."""
        B, T, _ = x.shape
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(B, T, self.v_heads, self.v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(B, T, self.k_heads, 2 * self.k_dim + 2 * r * self.v_dim)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, self.k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, self.v_heads, self.v_dim), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def mix(self, qkv: Tensor, g: Tensor, beta: Tensor, starts: Tensor, conv_state: Tensor | None = None,
            state: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Conv + delta rule over rows: qkv (B, T, C), g, beta (B, T, Hv), starts (B, T) bool, states
        (B, C, K-1) / (B, Hv, Dk, Dv) or None -> o (B, T, Hv, Dv) fp32, conv state, delta-rule state."""
        B, T, _ = qkv.shape
        y, conv_state = causal_conv(qkv, self.conv1d.weight, starts, conv_state)
        key = self.k_heads * self.k_dim
        q, k, v = y.split([key, key, self.v_heads * self.v_dim], dim=-1)
        r = self.v_heads // self.k_heads
        q, k = (l2norm(t.reshape(B, T, self.k_heads, self.k_dim).float()).repeat_interleave(r, dim=2) for t in (q, k))
        v = v.reshape(B, T, self.v_heads, self.v_dim)
        rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        o, state = rule(q, k, v, g, beta, starts, state)
        return o, conv_state, state

    def forward(self, x: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        B, T, _ = x.shape
        qkv, z, b, a = self.project(x)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (B, T, Hv), <= 0
        o = linear_attend(attn, self.layer_id, qkv, g, beta, self.mix).to(x.dtype)  # (B, T, Hv, Dv)
        return self.out_proj(self.norm(o, z).reshape(B, T, -1))


class HybridBlock(nn.Module):
    """Pre-norm block: x + mixer(norm(x)) (DeltaNet or gated attention), then + ffn(norm(.))."""

    def __init__(self, args: HybridArgs, layer_id: int) -> None:
        super().__init__()
        self.is_linear = args.is_linear(layer_id)
        self.attention_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        if self.is_linear:
            self.linear_attention = GatedDeltaNet(args, layer_id)
        else:
            self.attention = GatedAttention(args, layer_id)
        self.ffn_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k,
                           norm_topk_prob=args.norm_topk_prob, shared_hidden_dim=args.shared_hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        h = self.attention_norm(x)
        h = x + (self.linear_attention(h, attn) if self.is_linear else self.attention(h, cos, sin, attn))
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3Next(DecoderLM):
    """Hybrid Qwen causal LM (Qwen3-Next, Qwen3.5, Qwen3.5-MoE). Build on meta, then `to_empty()` +
    `init_weights()` or a load. Same contract as `Qwen3Moe`; the final norm is zero-centred."""

    init_rules = INIT_RULES

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args, RotaryEmbedding(args.rotary_dim, args.rope_theta),
                         [HybridBlock(args, i) for i in range(args.n_layers)])
        self.norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

_LINEAR_NAMES = ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_qkv.weight", "in_proj_z.weight",
                 "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight", "conv1d.weight", "dt_bias", "A_log",
                 "norm.weight")

# Every block key of every layer kind: a key of the wrong kind has no place in that layer's module
# and load_hf_weights names it. Experts: Qwen3-MoE's per-expert keys (and transformers 5's fused).
KEY_MAP = KeyMap(
    label="Qwen3-Next",
    hf_label="Qwen3Next/Qwen3.5",
    top=DECODER_KEYS,
    block={
        "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        **{f"attention.w{a}.weight": f"self_attn.{a}_proj.weight" for a in "qkvo"},
        "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
        **{f"linear_attention.{n}": f"linear_attn.{n}" for n in _LINEAR_NAMES},
        **SWIGLU_KEYS,
        "moe.router.weight": "mlp.gate.weight",
        "moe.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
        "moe.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
        "moe.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
        "moe.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
    },
    experts=EXPERT_KEYS,
    fused_experts=FUSED_EXPERT_KEYS,
)

# Qwen3.5's vision-language hub layout: the decoder under model.language_model., a vision tower
# and (all three families) an MTP module that a causal LM does not have.
_HF_DECODER_PREFIX = "model.language_model."
_HF_DROPPED_PREFIXES = ("mtp.", "model.visual.")


class Qwen3NextStateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter; `from_hf` also reads Qwen3.5's VLM layout."""

    key_map = KEY_MAP

    def from_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        renamed = {}
        for key, value in state_dict.items():
            if key.startswith(_HF_DROPPED_PREFIXES):
                continue
            if key.startswith(_HF_DECODER_PREFIX):
                key = "model." + key.removeprefix(_HF_DECODER_PREFIX)
            renamed[key] = value
        return super().from_hf(renamed)

