"""Qwen3 dense decoder (0.6B to 8B), written against the `AttentionContext` contract.

One file holds everything a family needs:

- `Qwen3Args` and its conversion to and from an HF `config.json` dict;
- `FLAVORS`: a tiny "debug" model for tests and the real Qwen3 shapes;
- the modules (`TransformerBlock`, a common/decoder.py `DenseBlock`, and `Qwen3`; attention is
  common/gqa.py's `GQAttention` with per-head q/k RMSNorm, the SwiGLU `FeedForward` is shared, in
  common/ffn.py);
- `PARALLEL_PLAN`: which submodules are FSDP units / how tensor parallelism splits them, as data;
- `INIT_RULES`: the init scheme, applied by common/init.py;
- `KEY_MAP`: the explicit key map between our names (torchtitan style) and HF's, applied by
  common/state_dict.py (`Qwen3StateDictAdapter`).

With tied embeddings the model has no `output` module at all: the LM head *is*
`tok_embeddings.weight` (see `Qwen3.output_weight`), so there is one parameter, one gradient
and one FSDP shard to keep in sync, and the state dict carries it once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from meshrl.models.common.decoder import DecoderLM, DenseBlock
from meshrl.models.common.gqa import GQAttention
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL
from meshrl.models.common.rope import RotaryEmbedding
from meshrl.models.common.state_dict import DECODER_KEYS, SWIGLU_KEYS, KeyMap, StateDictAdapter

MODEL_TYPE = "qwen3"


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen3Args:
    """Shape of a Qwen3 model. Field names are ours; `from_hf_config` maps HF's names."""

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_seq_len: int = 40960

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Qwen3Args:
        """Read an HF Qwen3 `config.json` dict; features this file does not implement raise ValueError."""
        return cls(**qwen3_fields_from_hf(config, MODEL_TYPE, "Qwen3"))

    def to_hf_config(
        self,
        dtype: torch.dtype | str = torch.float32,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' Qwen3ForCausalLM loads (4.5x and 5.x)."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
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


def qwen3_fields_from_hf(config: dict[str, Any], model_type: str, label: str) -> dict[str, Any]:
    """The attention/embedding/norm fields shared by Qwen3 and Qwen3-MoE, read from an HF
    `config.json` dict; features neither file implements raise ValueError naming `label`."""
    if config.get("model_type") != model_type:
        raise ValueError(f"expected model_type {model_type!r}, got {config.get('model_type')!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{label} hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
    if config.get("attention_bias", False):
        raise ValueError(f"{label} with attention_bias=true is not supported")
    if config.get("use_sliding_window", False):
        raise ValueError(f"{label} with use_sliding_window=true is not supported")
    # transformers >= 5 nests the theta in rope_parameters; 4.x keeps rope_theta + rope_scaling.
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or config.get("rope_scaling"):
        raise ValueError(f"only default RoPE is supported, got rope_parameters={rope!r} "
                         f"rope_scaling={config.get('rope_scaling')!r}")
    n_heads = config["num_attention_heads"]
    return dict(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        hidden_dim=config["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 40960),
    )


_QWEN3 = Qwen3Args(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6, max_seq_len=40960)

FLAVORS: dict[str, Qwen3Args] = {
    "debug": Qwen3Args(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                       max_seq_len=2048),
    # ~0.8M parameters with a 100-token char vocabulary: the CPU reverse-text demo.
    "tiny": Qwen3Args(vocab_size=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=384,
                      max_seq_len=2048),
    "0.6B": replace(_QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_embeddings=True),
    "1.7B": replace(_QWEN3, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_embeddings=True),
    "4B": replace(_QWEN3, dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_embeddings=True),
    "8B": replace(_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, tie_embeddings=False),
}

# Init scheme: embedding and all linear weights ~ N(0, 0.02), except the two residual output
# projections of every block (attention.wo, feed_forward.w2), which use the depth-scaled std
# 0.02 / sqrt(2 * n_layers) (GPT-2) so the residual stream's variance does not grow with depth;
# the untied LM head ~ N(0, 0.02); all RMSNorm weights = 1. There are no biases.
INIT_RULES = (
    ("*norm.weight", ONES),
    ("*attention.wo.weight", RESIDUAL),
    ("*feed_forward.w2.weight", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data. Module paths are relative to `Qwen3`; "*" matches one path component.
# "fsdp_units" records what parallel/parallelize.py wraps (every block, then the root, which
# holds the embedding, final norm and untied output; a tied LM head stays in the root unit with
# its embedding). "tp" is read by parallel/tensor_parallel.py to split an inference replica
# Megatron-style (wq/wk/wv, w1/w3 colwise; wo, w2 rowwise with an all-reduce); attention reshapes
# with -1 heads so it runs on the local heads. tests/dist/test_tp_engine.py checks a two-rank TP
# engine against the one-process engine (same greedy tokens, logprobs to 1e-5, weight updates).
PARALLEL_PLAN: dict[str, Any] = {
    "fsdp_units": ["layers.*"],
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


def attention(args: Qwen3Args, layer_id: int) -> GQAttention:
    """Qwen3's attention: GQA without biases, RMSNorm over each head's q and k before RoPE
    (common/gqa.py; also Qwen3-MoE's)."""
    return GQAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, layer_id, qk_norm="head",
                       norm_eps=args.norm_eps)


class TransformerBlock(DenseBlock):
    """Pre-norm block (models/common/decoder.py `DenseBlock`). The unit FSDP2 wraps."""

    def __init__(self, args: Qwen3Args, layer_id: int) -> None:
        super().__init__(args.dim, args.hidden_dim, args.norm_eps, attention(args, layer_id))


class Qwen3(DecoderLM):
    """Qwen3 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load.

    `forward(tokens, positions, attn)` -> logits; `hidden(...)` -> final-normed hidden states and
    `output_weight` for callers that compute logprobs in chunks without materialising (B, T, V).
    """

    init_rules = INIT_RULES

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, RotaryEmbedding(args.head_dim, args.rope_theta),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Per-block names, relative to layers.{i}. and model.layers.{i}.; Qwen3-MoE shares them.
ATTENTION_KEYS: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Top level: tok_embeddings <-> model.embed_tokens, norm <-> model.norm, output <-> lm_head
# (absent when embeddings are tied); every block: attention plus the SwiGLU feed_forward <-> mlp
# (w1 <-> gate_proj, w2 <-> down_proj, w3 <-> up_proj).
KEY_MAP = KeyMap(label="Qwen3", hf_label="Qwen3", top=DECODER_KEYS, block={**ATTENTION_KEYS, **SWIGLU_KEYS})


class Qwen3StateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py): keys are renamed, values
    pass through untouched (DTensors and gradients too); unknown keys raise ValueError."""

    key_map = KEY_MAP
