"""The decoder-only LM skeleton every native family shares.

    tokens -> tok_embeddings -> blocks (each: x, cos, sin, attn -> x) -> norm -> hidden
    hidden -> head(hidden, output_weight)   (default head: logits = hidden @ output_weight.T)

A family subclasses `DecoderLM`, passes its args, blocks and RoPE and sets `init_rules`;
everything else (the `hidden` / `forward` / `output_weight` contract of models/qwen3.py, tied
embeddings, the "0".."n-1" ModuleDict of blocks that parallel/ shards, `init_weights`) lives
here once. The families keep their own blocks, args, init rules and HF key map.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common import fused_decode
from meshrl.models.common.attention import AttentionContext, CausalAttention, OutputHead
from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.init import InitRules, init_parameters
from meshrl.models.common.norm import RMSNorm


class DenseBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)) with a SwiGLU `FeedForward`. The unit
    FSDP2 wraps. Families with this block (Qwen3, Llama 3) subclass it and build their attention."""

    def __init__(self, dim: int, hidden_dim: int, norm_eps: float, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        h, n = self.ffn_norm.add_forward(x, self.attention(self.attention_norm(x), cos, sin, attn))
        return h + self.feed_forward(n)

    def forward_pending(self, x: Tensor, pending: Tensor | None, cos: Tensor, sin: Tensor,
                        attn: AttentionContext) -> tuple[Tensor, Tensor]:
        """forward(x + pending) as (h, ffn out), the two terms of its sum, left for the next norm to add
        in its kernel (DecoderLM.hidden under the decode fusions; the same math)."""
        x, n = (x, self.attention_norm(x)) if pending is None else self.attention_norm.add_forward(x, pending)
        h, n = self.ffn_norm.add_forward(x, self.attention(n, cos, sin, attn))
        return h, self.feed_forward(n)


class DecoderLM(nn.Module):
    """Embedding, blocks, final RMSNorm and an optional untied LM head.

    `args` is the family's args dataclass; it needs `vocab_size`, `dim`, `norm_eps`,
    `tie_embeddings` and `n_layers`. With `tie_embeddings` there is no `output` module at all:
    the LM head *is* `tok_embeddings.weight` (one parameter, one gradient, one FSDP shard).
    """

    # The family's init scheme as (parameter-name pattern, init) rules (common/init.py).
    init_rules: InitRules = ()

    def __init__(self, args: Any, rope: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = rope
        # A ModuleDict keyed "0".."n-1" keeps the HF-like key names and lets a pipeline stage
        # delete blocks without renumbering the rest.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place by the family's `init_rules`, whose comment states
        the scheme (call after `to_empty()` when built on meta). With `seed`, a private generator
        on the parameters' device makes the result reproducible without touching the global RNG;
        without it the global RNG is used."""
        init_parameters(self, self.init_rules, self.args.n_layers, self.tok_embeddings.weight.device, seed)

    @property
    def output_weight(self) -> Tensor:
        """The LM head matrix (V, dim): `tok_embeddings.weight` when embeddings are tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden(self, tokens: Tensor, positions: Tensor, attn: AttentionContext | None = None) -> Tensor:
        """tokens, positions (B, T) int64 -> final-normed hidden states (B, T, dim).

        `positions` are explicit (each packed document restarts at 0); `attn` decides the
        attention pattern, plain causal over the row when None.
        """
        assert tokens.shape == positions.shape, f"tokens {tuple(tokens.shape)} vs positions {tuple(positions.shape)}"
        attn = CausalAttention() if attn is None else attn
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(positions, dtype=h.dtype)  # (B, T, head_dim), once for all layers
        blocks = list(self.layers.values())
        if fused_decode.enabled(h) and blocks and all(
                hasattr(b, "forward_pending") and not b._forward_hooks and not b._forward_pre_hooks for b in blocks):
            # a block's last residual add runs inside the next norm's kernel (models/common/fused_decode.py)
            pending = None
            for block in blocks:
                h, pending = block.forward_pending(h, pending, cos, sin, attn)
            return self.norm.add_forward(h, pending)[1]
        for block in blocks:
            h = block(h, cos, sin, attn)
        return self.norm(h)

    def forward(self, tokens: Tensor, positions: Tensor, attn: AttentionContext | None = None,
                head: OutputHead | None = None) -> Any:
        """tokens, positions (B, T) int64 -> logits (B, T, vocab_size) in the parameter dtype.

        With `head`, returns `head(hidden, output_weight)` instead: the trainer's chunked
        logprob head runs here, inside the root FSDP unit, where the LM head is unsharded.
        """
        h = self.hidden(tokens, positions, attn)
        return F.linear(h, self.output_weight) if head is None else head(h, self.output_weight)
