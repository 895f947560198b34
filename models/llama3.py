"""Llama 3 dense decoder (3.1 8B/70B, 3.2 1B/3B), written against the `AttentionContext` contract.

One file holds everything a family needs:

- `Llama3Args` and its conversion to and from an HF `config.json` dict (model_type "llama");
- `FLAVORS`: a tiny "debug" model for tests and the real Llama 3.1 / 3.2 shapes;
- the modules (`TransformerBlock`, a common/decoder.py `DenseBlock`, and `Llama3`; attention is
  common/gqa.py's `GQAttention` without biases or q/k norms, the SwiGLU `FeedForward` is shared);
- `PARALLEL_PLAN`: which submodules are FSDP units / how tensor parallelism splits them, as data;
- `INIT_RULES`: the init scheme, applied by common/init.py;
- `KEY_MAP`: the explicit key map between our names and HF's, applied by common/state_dict.py
  (`Llama3StateDictAdapter`).

Against Qwen3 the differences are: no RMSNorm on q and k, head_dim = dim // n_heads unless the
config names one, and the Llama 3.1 "llama3" RoPE frequency scaling (common/rope.py).

With tied embeddings (Llama 3.2 1B and 3B) the model has no `output` module: the LM head *is*
`tok_embeddings.weight` (see `Llama3.output_weight`), stored and sharded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.models.common.decoder import DecoderLM, DenseBlock
from meshrl.models.common.gqa import GQAttention
from meshrl.models.common.init import NORMAL, ONES, RESIDUAL
from meshrl.models.common.rope import Llama3RopeScaling, RotaryEmbedding
from meshrl.models.common.state_dict import DECODER_KEYS, SWIGLU_KEYS, KeyMap, StateDictAdapter

MODEL_TYPE = "llama"
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


# --------------------------------------------------------------------------------------------
# Args and flavors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Llama3Args:
    """Shape of a Llama 3 model. Field names are ours; `from_hf_config` maps HF's names.

    `head_dim=None` means dim // n_heads (resolved on construction, so two args that describe
    the same model compare equal). `rope_scaling=None` is plain RoPE.
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    hidden_dim: int = 128
    rope_theta: float = 500_000.0
    rope_scaling: Llama3RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(f"dim ({self.dim}) is not a multiple of n_heads ({self.n_heads}); set head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Llama3Args:
        """Read an HF Llama `config.json` dict; features this file does not implement raise ValueError."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {config.get('model_type')!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Llama hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("attention_bias", False):
            raise ValueError("Llama with attention_bias=true is not supported")
        if config.get("mlp_bias", False):
            raise ValueError("Llama with mlp_bias=true is not supported")
        if config.get("attention_dropout", 0.0):
            raise ValueError(f"Llama with attention_dropout={config['attention_dropout']} is not supported")
        rope_theta, rope_scaling = _rope_from_hf(config)
        n_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            hidden_dim=config["intermediate_size"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # transformers' LlamaConfig defaults, for keys a config leaves out.
            norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_embeddings=config.get("tie_word_embeddings", False),
            max_seq_len=config.get("max_position_embeddings", 2048),
        )

    def to_hf_config(
        self,
        dtype: torch.dtype | str = torch.float32,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' LlamaForCausalLM loads (4.5x and 5.x)."""
        dtype_name = str(dtype).removeprefix("torch.")
        # transformers 4.x reads rope_theta + rope_scaling; 5.x reads rope_parameters, but lets a
        # rope_scaling key override it (filling rope_theta from the top level), so both agree.
        rope_scaling = None
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_seq_len,
            }
            rope_parameters = {**rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": ["LlamaForCausalLM"],
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
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "use_cache": True,
            "initializer_range": 0.02,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            # 4.x reads torch_dtype, 5.x reads dtype.
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }


def _rope_from_hf(config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either config spelling.

    transformers 4.x: top-level rope_theta plus an optional rope_scaling dict. 5.x: one
    rope_parameters dict holding rope_theta too. Like 5.x, a rope_scaling key wins when present.
    """
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"only 'default' and 'llama3' RoPE are supported, got rope_type {rope_type!r} "
                         f"(rope_scaling={config.get('rope_scaling')!r}, "
                         f"rope_parameters={config.get('rope_parameters')!r})")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported, got partial_rotary_factor={partial}")
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return theta, None
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in rope]
    if missing:
        raise ValueError(f"llama3 RoPE parameters lack {missing}: {rope!r}")
    # transformers' order: a top-level original_max_position_embeddings, then the rope dict's,
    # then max_position_embeddings.
    original = config.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", config.get("max_position_embeddings", 2048))
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(original),
    )
    return theta, scaling


def _llama3_1(**shape: Any) -> Llama3Args:
    return Llama3Args(vocab_size=128256, rope_theta=500_000.0, norm_eps=1e-5, max_seq_len=131072, **shape)


# Llama 3.1 stretches an 8192-token pretraining context 8x; 3.2 (1B, 3B) 32x.
_ROPE_3_1 = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_ROPE_3_2 = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

FLAVORS: dict[str, Llama3Args] = {
    # Scaling with a 256-token original context, so a head_dim of 16 has frequencies in all
    # three bands (kept, interpolated, divided by factor).
    "debug": Llama3Args(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                        rope_theta=500_000.0, max_seq_len=2048, tie_embeddings=True,
                        rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_seq_len=256)),
    "1B": _llama3_1(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192, rope_scaling=_ROPE_3_2,
                    tie_embeddings=True),
    "3B": _llama3_1(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, hidden_dim=8192, rope_scaling=_ROPE_3_2,
                    tie_embeddings=True),
    "8B": _llama3_1(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, rope_scaling=_ROPE_3_1),
    "70B": _llama3_1(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672, rope_scaling=_ROPE_3_1),
}

# Init scheme (Qwen3's): embedding and all linear weights ~ N(0, 0.02), except the two residual
# output projections of every block (attention.wo, feed_forward.w2), which use the depth-scaled
# std 0.02 / sqrt(2 * n_layers) (GPT-2) so the residual stream's variance does not grow with
# depth; the untied LM head ~ N(0, 0.02); all RMSNorm weights = 1. There are no biases.
INIT_RULES = (
    ("*norm.weight", ONES),
    ("*attention.wo.weight", RESIDUAL),
    ("*feed_forward.w2.weight", RESIDUAL),
    ("*", NORMAL),
)

# Sharding plan as data. Module paths are relative to `Llama3`; "*" matches one path component.
# "fsdp_units" records what parallel/parallelize.py wraps (every block, then the root: embedding,
# final norm, untied head). "tp" is read by parallel/tensor_parallel.py to split an inference
# replica Megatron-style; attention reshapes with -1 heads so it runs on a shard's local heads
# (tests/dist/test_tp_engine.py: a two-rank TP engine against the one-process engine).
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


class TransformerBlock(DenseBlock):
    """Pre-norm block (models/common/decoder.py `DenseBlock`). The unit FSDP2 wraps."""

    def __init__(self, args: Llama3Args, layer_id: int) -> None:
        super().__init__(args.dim, args.hidden_dim, args.norm_eps, GQAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, layer_id))


class Llama3(DecoderLM):
    """Llama 3 causal LM. Build on the meta device, then `to_empty()` + `init_weights()` or a load.

    `forward(tokens, positions, attn)` -> logits; `hidden(...)` -> final-normed hidden states and
    `output_weight` for callers that compute logprobs in chunks without materialising (B, T, V).
    """

    init_rules = INIT_RULES

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args, RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

# Per-block names, relative to layers.{i}. and model.layers.{i}.: Qwen3's without q_norm/k_norm.
ATTENTION_KEYS: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Top level: tok_embeddings <-> model.embed_tokens, norm <-> model.norm, output <-> lm_head
# (absent when embeddings are tied); every block: attention plus the SwiGLU feed_forward <-> mlp
# (w1 <-> gate_proj, w2 <-> down_proj, w3 <-> up_proj).
# RoPE needs no weights: HF's `rotary_emb.inv_freq` is a non-persistent buffer.
KEY_MAP = KeyMap(label="Llama 3", hf_label="Llama", top=DECODER_KEYS, block={**ATTENTION_KEYS, **SWIGLU_KEYS})


class Llama3StateDictAdapter(StateDictAdapter):
    """`KEY_MAP` applied by the shared adapter (common/state_dict.py): keys are renamed, values
    pass through untouched (DTensors and gradients too); unknown keys raise ValueError."""

    key_map = KEY_MAP
