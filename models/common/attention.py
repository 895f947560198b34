"""The attention contract between the model definitions and whoever runs them.

A model never decides *which* tokens attend to which: it computes q, k, v per layer (with
RoPE and qk-norm already applied) and hands them to an `AttentionContext`. The trainer passes a
context for causal or packed (document-masked) training rows; the inference engine passes its
own context that writes k, v into its KV cache (one slot per sequence today, paged later)
and attends over the cached prefix. The
same model code therefore serves both, and the engine never forks the model file.

A context object lives for one forward pass. Anything derived from the batch layout (masks,
cache slots) is built on the first `attend` call and reused by every layer.

Softmax scale is always 1 / sqrt(head_dim) (Qwen3, Llama); a family that needs another scale
would add it to the protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionContext(Protocol):
    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, Hq, T, D); k, v (B, Hkv, T, D), RoPE and qk-norm already applied. Returns (B, Hq, T, D)."""
        ...


class OutputHead(Protocol):
    def __call__(self, hidden: Tensor, weight: Tensor) -> Any:
        """hidden (B, T, dim) final-normed states; weight (V, dim) the LM head. Returns anything.

        A model's `forward(tokens, positions, attn, head)` calls this instead of computing the
        (B, T, V) logits, so a caller can compute what it needs (e.g. logprobs of targets in
        chunks) while the LM head is unsharded inside the model's forward.
        """
        ...


class CausalAttention:
    """Plain causal attention over the whole row (one document per row, no padding inside)."""

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # enable_gqa keeps k, v un-repeated, which the flash kernel supports (no mask here).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class DocumentCausalAttention:
    """Causal attention restricted to tokens of the same document (packed rows).

    doc_ids (B, T) int64: token i attends to token j iff j <= i and doc_ids[b, i] == doc_ids[b, j].
    Give each padding token its own id (or one id for a padding tail): the diagonal is always
    allowed, so no row is fully masked and no NaN can appear.

    The (B, 1, T, T) boolean mask is built on the first `attend` call and cached for the other
    layers. It costs B * T^2 bytes; for very long rows a FlexAttention / varlen context can
    replace this class without touching the model.
    """

    def __init__(self, doc_ids: Tensor) -> None:
        assert doc_ids.dim() == 2, f"doc_ids must be (B, T), got {tuple(doc_ids.shape)}"
        self.doc_ids = doc_ids  # (B, T)
        self._mask: Tensor | None = None

    @classmethod
    def from_positions(cls, positions: Tensor) -> DocumentCausalAttention:
        """Documents inferred from positions (B, T): a new document starts wherever position == 0."""
        return cls(document_ids_from_positions(positions))

    def mask(self, device: torch.device) -> Tensor:
        """(B, 1, T, T) bool, True where attention is allowed."""
        if self._mask is None:
            doc = self.doc_ids.to(device)
            T = doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            same_doc = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
            self._mask = (same_doc & causal)[:, None]
        return self._mask

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, num_q_heads, T, _ = q.shape
        assert self.doc_ids.shape == (B, T), f"doc_ids {tuple(self.doc_ids.shape)} vs q {tuple(q.shape)}"
        # Repeat k, v rather than enable_gqa: with an explicit mask the CUDA path is the
        # memory-efficient kernel, which does not take enable_gqa (it would fall back to math).
        n_rep = num_q_heads // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.device))


def document_ids_from_positions(positions: Tensor) -> Tensor:
    """positions (B, T) -> doc_ids (B, T): a document starts at each position 0 (ids count from 0).

    Padding laid out with position 0 per pad token becomes one-token documents, which is harmless.
    """
    return (positions == 0).long().cumsum(dim=1) - 1
