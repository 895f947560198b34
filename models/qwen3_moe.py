"""Qwen3-MoE decoder (30B-A3B, 235B-A22B), written against the `AttentionContext` contract.

One file holds everything a family needs:

- `Qwen3MoeArgs` and its conversion to and from an HF `config.json` dict (model_type "qwen3_moe");
- `FLAVORS`: a tiny "debug" model, a few-billion-parameter benchmark shape and the real shapes;
- the modules (`TransformerBlock`, `Qwen3Moe`); attention is Qwen3's (qwen3.attention), the
  routed experts are common/moe.py's `MoE`, dense layers use the shared SwiGLU `FeedForward`;
- `PARALLEL_PLAN`: FSDP units and expert sharding as data;
- `INIT_RULES`: the init scheme, applied by common/init.py;
- `KEY_MAP`: the explicit key map between our names and HF's, applied by common/state_dict.py
  (`Qwen3MoeStateDictAdapter`).

Against dense Qwen3 the only change is the feed-forward: layer i is a MoE layer unless it is
listed in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (HF's rule).
Routing: softmax over all experts in fp32, top-k, and with `norm_topk_prob` the k weights are
renormalised to sum to 1; no shared expert.

One grouped expert tensor of ours (E, ...) is E per-expert tensors on the hub (the layout of the
released checkpoints, of transformers 4.x, and of what transformers 5 writes by default: in
memory it fuses experts into `mlp.experts.gate_up_proj` (E, 2I, D) = [gate; up] and
`mlp.experts.down_proj` (E, D, I), and converts back on save). We write the per-expert layout
and read both; per-expert keys may arrive one call at a time (as models/hf.py loads them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL
from meshrl.models.common.moe import MoE
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding
from meshrl.models.common.state_dict import (DECODER_KEYS, EXPERT_KEYS, FUSED_EXPERT_KEYS, SWIGLU_KEYS, KeyMap,
                                             StateDictAdapter)
from meshrl.models.qwen3 import ATTENTION_KEYS, attention, qwen3_fields_from_hf

MODEL_TYPE = "qwen3_moe"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen3MoeArgs:
    """Shape of a Qwen3-MoE model. Field names are ours; `from_hf_config` maps HF's names.

    `hidden_dim` is the dense layers' SwiGLU width (HF intermediate_size), `moe_hidden_dim` each
    expert's (HF moe_intermediate_size). The attention fields are those of `Qwen3Args`, so
    qwen3.Attention takes these args as they are.
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    moe_hidden_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 40960

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0 and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k (num_experts_per_tok) must be in [1, {self.num_experts}], got {self.top_k}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.n_layers}-layer model")

    def is_moe_layer(self, layer_id: int) -> bool:
        """HF's rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Qwen3MoeArgs:
        """Read an HF Qwen3-MoE `config.json` dict; features this file does not implement raise ValueError."""
        dense = qwen3_fields_from_hf(config, MODEL_TYPE, "Qwen3-MoE")  # checks model_type first
        if config.get("shared_expert_intermediate_size"):
            raise ValueError("Qwen3-MoE with a shared expert (shared_expert_intermediate_size) is not supported")
        # transformers 5 writes the expert count as num_local_experts (its attribute_map), the hub
        # checkpoints and 4.x as num_experts.
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("Qwen3-MoE config has neither num_experts nor num_local_experts")
        return cls(
            **dense,
            moe_hidden_dim=config["moe_intermediate_size"],
            num_experts=num_experts,
            top_k=config["num_experts_per_tok"],
            norm_topk_prob=config.get("norm_topk_prob", False),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )

    def to_hf_config(
        self,
        dtype: torch.dtype | str = torch.float32,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' Qwen3MoeForCausalLM loads (4.5x and 5.x)."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "moe_intermediate_size": self.moe_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            # Both spellings: transformers 4.x reads rope_theta, 5.x reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "use_cache": True,
            "initializer_range": 0.02,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            # 4.x reads torch_dtype, 5.x reads dtype.
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }


_QWEN3_MOE = Qwen3MoeArgs(vocab_size=151936, n_heads=32, n_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                          norm_topk_prob=True, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False,
                          max_seq_len=40960)

FLAVORS: dict[str, Qwen3MoeArgs] = {
    # 8 experts, top-2, a dense layer 1 in the middle: every code path in a ~0.2M-parameter model.
    "debug": Qwen3MoeArgs(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                          moe_hidden_dim=32, num_experts=8, top_k=2, mlp_only_layers=(1,), max_seq_len=2048),
    # Benchmark shape, not a released model: 16 layers of 64 experts (768 wide, top-8) at dim 2048,
    # 5.6B parameters of which 1.4B are active per token (0.6B of them the untied embeddings):
    # large enough to exercise EP, grouped GEMM and FSDP at realistic per-expert sizes on 1-2 GPUs.
    "bench-5B-A1B": replace(_QWEN3_MOE, dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, hidden_dim=6144,
                            moe_hidden_dim=768, num_experts=64, top_k=8),
    "30B-A3B": replace(_QWEN3_MOE, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144,
                       moe_hidden_dim=768),
    "235B-A22B": replace(_QWEN3_MOE, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                         moe_hidden_dim=1536),
}

# Init scheme (Qwen3's, extended to experts): embedding, attention, dense SwiGLU, router and
# expert w1/w3 weights ~ N(0, 0.02); the residual output projections (attention.wo, the dense
# feed_forward.w2 and every expert's w2) ~ N(0, 0.02 / sqrt(2 * n_layers)); the untied LM head
# ~ N(0, 0.02); RMSNorm weights = 1. No biases. Initialise before `apply_expert_parallel` (as
# before FSDP): every rank then holds the same full model and keeps its slice of it.
INIT_RULES = (
    ("*norm.weight", ONES),
    ("*attention.wo.weight", RESIDUAL),
    ("*feed_forward.w2.weight", RESIDUAL),
    ("*moe.experts.w2", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data. Module paths are relative to `Qwen3Moe`; "*" matches one path component.
# "fsdp_units" / "expert_fsdp_units" record what parallel/parallelize.py wraps: the expert groups
# (on the expert-FSDP mesh once EP has split them), then every block, then the root; "ep": EP
# splits each grouped expert tensor on dim 0. The "tp" rows are not used: parallel/
# tensor_parallel.py refuses a plan with "ep" (inference TP exists for the dense families only;
# tests/dist/test_tp_engine.py checks that it refuses this one).
PARALLEL_PLAN: dict[str, Any] = {
    "fsdp_units": ["layers.*"],
    "expert_fsdp_units": ["layers.*.moe.experts"],
    "ep": {"layers.*.moe.experts": "shard_dim0"},
    "tp": {
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    },
}


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)), ffn = `moe` or `feed_forward`."""

    def __init__(self, args: Qwen3MoeArgs, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, args.norm_topk_prob)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3Moe(DecoderLM):
    """Qwen3-MoE causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load.

    Same contract as `Qwen3`: `forward(tokens, positions, attn, head)`, `hidden(...)`,
    `output_weight`, `layers` keyed "0".."n-1". After a forward, `common.moe.moe_aux_loss(model)`
    is the (uncoefficiented) load-balancing loss; the trainer scales it by its own
    `trainer.moe_aux_loss_coef` (default 0: logged, not trained on; `router_aux_loss_coef` is only
    carried through the HF config).
    """

    init_rules = INIT_RULES

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, RotaryEmbedding(args.head_dim, args.rope_theta),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Top level and attention as in qwen3.py. Dense layers have Qwen3's SwiGLU keys, MoE layers the
# router and the grouped experts; a key of the other kind raises. Block-relative names:
#
#   moe.router.weight           (E, D)  mlp.gate.weight
#   moe.experts.w1           (E, I, D)  mlp.experts.{j}.gate_proj.weight, j < E
#   moe.experts.w2           (E, D, I)  mlp.experts.{j}.down_proj.weight
#   moe.experts.w3           (E, I, D)  mlp.experts.{j}.up_proj.weight
#   (read only, transformers 5)         mlp.experts.gate_up_proj (E, 2I, D) = [w1; w3], mlp.experts.down_proj
KEY_MAP = KeyMap(
    label="Qwen3-MoE",
    hf_label="Qwen3-MoE",
    top=DECODER_KEYS,
    block=ATTENTION_KEYS,
    layer_keys={"dense": SWIGLU_KEYS, "MoE": {"moe.router.weight": "mlp.gate.weight"}},
    layer_kind=lambda args, i: "MoE" if args.is_moe_layer(i) else "dense",
    experts=EXPERT_KEYS,
    fused_experts=FUSED_EXPERT_KEYS,
    expert_kind="MoE",
)


class Qwen3MoeStateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py). Non-expert values pass
    through untouched; grouped experts are split into per-expert copies on `to_hf` and stacked on
    `from_hf`, which keeps incomplete ones until all E experts arrive (`pending()`)."""

    key_map = KEY_MAP
