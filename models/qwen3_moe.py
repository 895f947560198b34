"""Qwen3-MoE decoder (30B-A3B, 235B-A22B), written against the `AttentionContext` contract.

One file holds everything a family needs:

- `Qwen3MoeArgs` and its conversion to and from an HF `config.json` dict (model_type "qwen3_moe");
- `FLAVORS`: a tiny "debug" model, a few-billion-parameter benchmark shape and the real shapes;
- the modules (`TransformerBlock`, `Qwen3Moe`); attention is Qwen3's (qwen3.Attention), the
  routed experts are common/moe.py's `MoE`, dense layers use the shared SwiGLU `FeedForward`;
- `PARALLEL_PLAN`: FSDP units, expert sharding and TP as data;
- `Qwen3MoeStateDictAdapter`: the explicit key map between our names and HF's.

Against dense Qwen3 the only change is the feed-forward: layer i is a MoE layer unless it is
listed in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (HF's rule).
Routing: softmax over all experts in fp32, top-k, and with `norm_topk_prob` the k weights are
renormalised to sum to 1; no shared expert.

Our parameter names and their HF counterparts (attention, norms and embeddings as in qwen3.py):

    layers.{i}.feed_forward.w1.weight    model.layers.{i}.mlp.gate_proj.weight     (dense layers)
    layers.{i}.feed_forward.w2.weight    model.layers.{i}.mlp.down_proj.weight
    layers.{i}.feed_forward.w3.weight    model.layers.{i}.mlp.up_proj.weight
    layers.{i}.moe.router.weight         model.layers.{i}.mlp.gate.weight          (MoE layers)
    layers.{i}.moe.experts.w1  (E, I, D) model.layers.{i}.mlp.experts.{j}.gate_proj.weight, j < E
    layers.{i}.moe.experts.w2  (E, D, I) model.layers.{i}.mlp.experts.{j}.down_proj.weight
    layers.{i}.moe.experts.w3  (E, I, D) model.layers.{i}.mlp.experts.{j}.up_proj.weight

One grouped tensor of ours is E per-expert tensors on the hub (the layout of the released
checkpoints, of transformers 4.x, and of what transformers 5 writes by default: in memory it
fuses experts into `mlp.experts.gate_up_proj` (E, 2I, D) = [gate; up] and
`mlp.experts.down_proj` (E, D, I), and converts back on save). We write the per-expert layout
and read both. Reading per-expert keys one call at a time (as models/hf.py does) works because
the adapter keeps the experts of a grouped tensor until all E have arrived.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext
from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.moe import MoE, GroupedExperts
from meshrl.models.common.decoder import DecoderLM
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding
from meshrl.models.qwen3 import Attention, qwen3_fields_from_hf

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

# Sharding plan as data, consumed by parallel/. Module paths are relative to `Qwen3Moe`; "*"
# matches one path component. FSDP2 wraps the expert groups (on the expert-FSDP mesh once EP has
# split them), then every block, then the root. EP splits each grouped expert tensor on dim 0.
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
        self.attention = Attention(args, layer_id)
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

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args.vocab_size, args.dim, args.norm_eps, args.tie_embeddings, RotaryEmbedding(args.head_dim, args.rope_theta),
                         [TransformerBlock(args, i) for i in range(args.n_layers)])
        self.args = args

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place (call after `to_empty()` when built on meta).

        Scheme (Qwen3's, extended to experts): embedding, attention, dense SwiGLU, router and
        expert w1/w3 weights ~ N(0, 0.02); the residual output projections (attention.wo, the
        dense feed_forward.w2 and every expert's w2) ~ N(0, 0.02 / sqrt(2 * n_layers)); the untied
        LM head ~ N(0, 0.02); RMSNorm weights = 1. No biases. With `seed`, a private generator
        on the parameters' device makes the result reproducible without touching the global
        RNG. Initialise before `apply_expert_parallel` (as before FSDP): every rank then holds
        the same full model and keeps its slice of it.
        """
        device = self.tok_embeddings.weight.device
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.init_weights(std, out_std, gen)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_residual_out else std, generator=gen)


# --------------------------------------------------------------------------------------------
# HF state-dict adapter
# --------------------------------------------------------------------------------------------

_ATTENTION_KEYS: dict[str, str] = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_KEYS: dict[str, str] = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROUTER_KEYS: dict[str, str] = {"moe.router.weight": "mlp.gate.weight"}
# Grouped expert tensor of ours -> per-expert HF name ("{j}" = expert index).
_EXPERT_KEYS: dict[str, str] = {
    "moe.experts.w1": "mlp.experts.{j}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{j}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{j}.up_proj.weight",
}
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight")
_HF_EXPERT_PROJ = {"gate_proj": "moe.experts.w1", "down_proj": "moe.experts.w2", "up_proj": "moe.experts.w3"}
# transformers 5's in-memory layout (written with save_pretrained(save_original_format=False)).
_HF_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_HF_FUSED_DOWN = "mlp.experts.down_proj"
_TOP_KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


class Qwen3MoeStateDictAdapter:
    """Maps state dicts between our layout and HF's (see the module docstring for the key map).

    Non-expert values pass through untouched. `to_hf` splits each grouped expert tensor into E
    per-expert copies (copies, not views: safetensors refuses tensors that share memory).
    `from_hf` stacks per-expert tensors into grouped ones; it is stateful: the experts of one
    grouped tensor may arrive over several calls and the grouped tensor is returned by the call
    that completes it (`pending()` lists incomplete ones). It also reads transformers 5's fused
    `gate_up_proj` / `down_proj`. Unknown keys, keys that do not fit the layer's kind (dense or
    MoE) and out-of-range layer or expert indices raise ValueError naming the key.
    """

    def __init__(self, args: Qwen3MoeArgs) -> None:
        self.args = args
        self._from_hf_attention = {v: k for k, v in _ATTENTION_KEYS.items()}
        self._from_hf_dense = {v: k for k, v in _DENSE_KEYS.items()}
        self._from_hf_router = {v: k for k, v in _ROUTER_KEYS.items()}
        self._from_hf_top = {v: k for k, v in _TOP_KEYS.items()}
        self._partial: dict[str, dict[int, Tensor]] = {}  # our grouped key -> {expert index: tensor}

    def _layer(self, index: str, key: str) -> int:
        if int(index) >= self.args.n_layers:
            raise ValueError(f"state-dict key {key!r} names layer {index}, but the model has {self.args.n_layers}")
        return int(index)

    def _check_kind(self, layer: int, moe_key: bool, key: str) -> None:
        if moe_key != self.args.is_moe_layer(layer):
            kind = "MoE" if self.args.is_moe_layer(layer) else "dense"
            raise ValueError(f"state-dict key {key!r} does not fit layer {layer}, which is a {kind} layer")

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if key == "output.weight" and self.args.tie_embeddings:
                raise ValueError("state dict has 'output.weight' but the model ties its embeddings")
            m = _OURS_BLOCK.fullmatch(key)
            if key in _TOP_KEYS:
                out[_TOP_KEYS[key]] = value
            elif m is None:
                raise ValueError(f"unknown Qwen3-MoE state-dict key {key!r}")
            elif (name := m.group(2)) in _ATTENTION_KEYS:
                out[f"model.layers.{self._layer(m.group(1), key)}.{_ATTENTION_KEYS[name]}"] = value
            elif name in _DENSE_KEYS or name in _ROUTER_KEYS:
                layer = self._layer(m.group(1), key)
                self._check_kind(layer, name in _ROUTER_KEYS, key)
                out[f"model.layers.{layer}.{_DENSE_KEYS.get(name) or _ROUTER_KEYS[name]}"] = value
            elif name in _EXPERT_KEYS:
                layer = self._layer(m.group(1), key)
                self._check_kind(layer, True, key)
                if value.shape[0] != self.args.num_experts:
                    raise ValueError(f"{key!r} holds {value.shape[0]} experts, the model has {self.args.num_experts} "
                                     f"(gather expert-parallel shards before converting)")
                for j in range(self.args.num_experts):
                    out[f"model.layers.{layer}.{_EXPERT_KEYS[name].format(j=j)}"] = value[j].clone()
            else:
                raise ValueError(f"unknown Qwen3-MoE state-dict key {key!r}")
        return out

    def from_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if key == "lm_head.weight" and self.args.tie_embeddings:
                continue  # the tied head is tok_embeddings.weight itself
            m = _HF_BLOCK.fullmatch(key)
            if key in self._from_hf_top:
                out[self._from_hf_top[key]] = value
            elif m is None:
                raise ValueError(f"unknown HF Qwen3-MoE state-dict key {key!r}")
            elif (name := m.group(2)) in self._from_hf_attention:
                out[f"layers.{self._layer(m.group(1), key)}.{self._from_hf_attention[name]}"] = value
            elif name in self._from_hf_dense or name in self._from_hf_router:
                layer = self._layer(m.group(1), key)
                self._check_kind(layer, name in self._from_hf_router, key)
                out[f"layers.{layer}.{self._from_hf_dense.get(name) or self._from_hf_router[name]}"] = value
            elif (e := _HF_EXPERT.fullmatch(name)) is not None:
                layer = self._layer(m.group(1), key)
                self._check_kind(layer, True, key)
                out.update(self._add_expert(f"layers.{layer}.{_HF_EXPERT_PROJ[e.group(2)]}", int(e.group(1)), value,
                                            key))
            elif name in (_HF_FUSED_GATE_UP, _HF_FUSED_DOWN):
                layer = self._layer(m.group(1), key)
                self._check_kind(layer, True, key)
                if name == _HF_FUSED_DOWN:
                    out[f"layers.{layer}.moe.experts.w2"] = value
                else:  # (E, 2I, D): gate rows first, then up rows
                    gate, up = value.chunk(2, dim=1)
                    out[f"layers.{layer}.moe.experts.w1"] = gate
                    out[f"layers.{layer}.moe.experts.w3"] = up
            else:
                raise ValueError(f"unknown HF Qwen3-MoE state-dict key {key!r}")
        return out

    def _add_expert(self, grouped_key: str, expert: int, value: Tensor, key: str) -> dict[str, Tensor]:
        if expert >= self.args.num_experts:
            raise ValueError(f"state-dict key {key!r} names expert {expert}, but the model has "
                             f"{self.args.num_experts}")
        parts = self._partial.setdefault(grouped_key, {})
        if expert in parts:
            raise ValueError(f"state-dict key {key!r} appears twice")
        parts[expert] = value
        if len(parts) < self.args.num_experts:
            return {}
        del self._partial[grouped_key]
        return {grouped_key: torch.stack([parts[j] for j in range(self.args.num_experts)])}

    def pending(self) -> list[str]:
        """Grouped keys with some but not all of their experts seen by `from_hf`."""
        return sorted(self._partial)
