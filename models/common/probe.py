"""One throw-away forward that records what each attention layer of a model would cache.

`ShapeProbe` stands in for the attention context of a native model's `hidden(tokens, positions,
attn)` (models/common/attention.py): every layer reports itself, and the probe records

- softmax attention: (layer id, k/v heads, k head dim, v head dim); MLA: one "head" of latent +
  rope key (+ index key), no values;
- linear attention (Gated DeltaNet): the shapes of its conv state (C, K-1) and delta-rule state
  (Hv, Dk, Dv) per sequence.

The native engine sizes its paged KV cache and its recurrent-state slots from these
(runtime/engine/native.py). The colocated memory plan (runtime/memory.py) counts the state slots
with `recurrent_state_bytes`, from the linear-attention layers' own `state_shapes()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ShapeProbe:
    """The attention context of one probe forward (module docstring)."""

    def __init__(self) -> None:
        self.layers: list[tuple[int, int, int, int]] = []
        self.linear: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # layer -> (conv, delta-rule) state shapes

    def attend(self, layer_id, q, k, v, window=None, sinks=None):
        self.layers.append((layer_id, k.shape[1], k.shape[3], v.shape[3]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def attend_latent(self, layer_id, q_nope, q_rope, latent, k_rope, wkv_b, v_head_dim, index=None, keep=None,
                      index_dim=0):
        # MLA (models/common/mla.py): one kv "head" of latent + rope key (+ index key) per token, no values.
        self.layers.append((layer_id, 1, latent.shape[-1] + k_rope.shape[-1] + index_dim, 0))
        return q_nope.new_zeros(*q_nope.shape[:-1], v_head_dim)  # a throw-away forward

    def attend_linear(self, layer_id, qkv, g, beta, mix):
        # A linear-attention layer (models/common/linear_attention.py): recurrent state, no k/v.
        starts = torch.ones(qkv.shape[:2], dtype=torch.bool, device=qkv.device)
        o, conv_state, state = mix(qkv, g, beta, starts, None, None)
        self.linear[layer_id] = (tuple(conv_state.shape[1:]), tuple(state.shape[1:]))
        return o


def probe(model: nn.Module) -> ShapeProbe:
    """Run one single-token forward of `model` (on the device its parameters are on) through a probe."""
    p = ShapeProbe()
    device = next(model.parameters()).device
    with torch.inference_mode():
        one = torch.zeros((1, 1), dtype=torch.long, device=device)
        model.hidden(one, one, p)
    return p


def recurrent_state_bytes(model: nn.Module, num_rows: int, dtype: torch.dtype) -> int:
    """Bytes of the recurrent-state slots a native engine allocates for `num_rows` rows of `model`
    beside its KV cache (runtime/engine/recurrent_state.py: conv states in `dtype`, delta-rule
    states in fp32); 0 without linear-attention layers. Read from the layers' `state_shapes()`, not
    a probe forward: `model` may be a meta skeleton, on which MoE dispatch cannot run."""
    shapes = [m.state_shapes() for m in model.modules() if hasattr(m, "state_shapes")]
    return num_rows * sum(math.prod(conv) * dtype.itemsize + math.prod(state) * 4 for conv, state in shapes)
