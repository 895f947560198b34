"""The decoder-only LM skeleton every native family shares.

    tokens -> tok_embeddings -> blocks (each: x, cos, sin, attn -> x) -> norm -> hidden
    hidden -> head(hidden, output_weight)   (default head: logits = hidden @ output_weight.T)

A family subclasses `DecoderLM` and passes its blocks and RoPE; everything else (the
`hidden` / `forward` / `output_weight` contract of models/qwen3.py, tied embeddings, the
"0".."n-1" ModuleDict of blocks that parallel/ shards) lives here once. The families keep
their own blocks, args, init scheme and HF key map.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common.attention import AttentionContext, CausalAttention, OutputHead
from meshrl.models.common.norm import RMSNorm


class DecoderLM(nn.Module):
    """Embedding, blocks, final RMSNorm and an optional untied LM head.

    With `tie_embeddings` there is no `output` module at all: the LM head *is*
    `tok_embeddings.weight` (one parameter, one gradient, one FSDP shard).
    """

    def __init__(self, vocab_size: int, dim: int, norm_eps: float, tie_embeddings: bool, rope: nn.Module,
                 blocks: list[nn.Module]) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.rope = rope
        # A ModuleDict keyed "0".."n-1" keeps the HF-like key names and lets a pipeline stage
        # delete blocks without renumbering the rest.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.output = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)

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
        for block in self.layers.values():
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
