"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), pure PyTorch, over packed rows.

One head, fp32, queries and keys L2-normalised, q scaled by 1/sqrt(Dk), a state S (Dk, Dv):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)   (the delta rule)
    o_t = S_t^T q_t

g_t <= 0 is the log decay, beta_t in (0, 1) the write strength. Before that, the layer runs a
causal depthwise convolution (kernel K, SiLU) over the concatenated [q, k, v] channels.

Packed rows hold several documents, so both recurrences restart where a document starts
(`starts` (B, T) bool, True at each document's first token): the state is zero before such a
token and the convolution sees zeros instead of the previous document. `document_starts(attn, ...)`
reads the documents from the trainer's attention context; the engine passes its own starts and
per-sequence states (`initial` / the returned final states).

`chunk_gated_delta_rule` is the chunked (parallel) form used for rows: chunks of C tokens, and
inside a chunk, with Gamma_i the cumulative log decay since the chunk start and same(i, j) true
iff j <= i and no document starts in (j, i]:

    (I + A) U = beta * V - beta * exp(Gamma) * K S0        A_ij = beta_i exp(Gamma_i - Gamma_j) k_i.k_j, j < i, same
    O = [seg 0] exp(Gamma) Q S0 + (Q K^T * exp(Gamma_i - Gamma_j) * same) U
    S_C = [no start in chunk] exp(Gamma_C) S0 + sum_{j same as C} exp(Gamma_C - Gamma_j) k_j u_j^T

one triangular solve per chunk for the intra-chunk part and a loop over chunks for the state.
`recurrent_gated_delta_rule` is the token-by-token form (the test reference and the decode step);
the two agree to fp32 round-off. Padding a row with k = v = beta = g = 0 leaves the state unchanged,
which is how rows are padded to whole chunks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_starts(attn: Any, batch: int, seq: int, device: torch.device) -> Tensor:
    """(B, T) bool, True at the first token of each document of the rows that `attn` attends over.

    Contexts with `doc_ids` (packed rows: sdpa, split, flex, varlen) give their documents; the plain
    `CausalAttention` is one document per row; any other context is refused. Context parallelism
    splits a row's tokens over ranks, which a recurrence cannot follow: refused.
    """
    from meshrl.models.common.attention import CausalAttention

    doc_ids = getattr(attn, "doc_ids", None)
    if doc_ids is None:
        if hasattr(attn, "doc_ids_full") or hasattr(attn, "local_index"):
            raise ValueError("linear-attention layers (Gated DeltaNet) do not support context parallelism "
                             "(trainer.parallel.cp must be 1)")
        if not isinstance(attn, CausalAttention):
            # A context that hides its documents would make the recurrences run across them.
            raise ValueError(f"linear-attention layers need the documents of the rows: {type(attn).__name__} has "
                             "no doc_ids (and is not CausalAttention)")
        starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
        starts[:, 0] = True
        return starts
    doc_ids = doc_ids.to(device)
    assert doc_ids.shape == (batch, seq), f"doc_ids {tuple(doc_ids.shape)} vs rows {(batch, seq)}"
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def causal_conv(x: Tensor, weight: Tensor, starts: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution + SiLU that restarts at document starts.

    x (B, T, C); weight (C, 1, K) (nn.Conv1d's depthwise layout); starts (B, T) bool; state
    (B, C, K-1) the previous K-1 inputs of each row's first document (None: zeros). Returns y (B, T, C)
    and the row's last K-1 inputs (B, C, K-1) (the next state; meaningful for unpadded rows).
    y_t = silu(sum_m w[K-1-m] x_{t-m}) over the inputs t-m of t's document.
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    prev = x.new_zeros(B, K - 1, C) if state is None else state.transpose(1, 2).to(x.dtype)
    ext = torch.cat([prev, x], dim=1)  # (B, K-1+T, C)
    # Document index of every extended position; the state belongs to the row's first document (0).
    doc = torch.cat([starts.new_zeros(B, K - 1, dtype=torch.long), starts.long().cumsum(1)], dim=1)
    w = weight.view(C, K).to(x.dtype)
    y = x * w[:, K - 1]
    for m in range(1, K):
        src = ext[:, K - 1 - m:K - 1 - m + T]  # x_{t-m}
        same = (doc[:, K - 1 - m:K - 1 - m + T] == doc[:, K - 1:])[..., None]
        y = y + torch.where(same, src, torch.zeros_like(src)) * w[:, K - 1 - m]
    return F.silu(y), ext[:, T:].transpose(1, 2)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor,
                               state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token delta rule. q, k (B, T, H, Dk) normalised; v (B, T, H, Dv); g, beta (B, T, H);
    starts (B, T) bool; state (B, H, Dk, Dv) or None. Returns o (B, T, H, Dv) fp32 and the final state."""
    B, T, H, Dk = k.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * Dk ** -0.5
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.float()
    out = []
    for t in range(T):
        keep = (~starts[:, t]).float().view(B, 1, 1, 1)
        S = S * keep * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (S * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]  # (B, H, Dv)
        S = S + k[:, t, ..., None] * delta[..., None, :]
        out.append((S * q[:, t, ..., None]).sum(-2))
    return torch.stack(out, dim=1), S


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor,
                           state: Tensor | None = None, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The chunked form (module docstring); same arguments and results as `recurrent_gated_delta_rule`."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))  # (B, H, Tp, D)
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2) for t in (g, beta))  # (B, H, Tp)
    starts = F.pad(starts, (0, pad))
    n = (T + pad) // chunk
    q = q * Dk ** -0.5
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    g, beta = (t.reshape(B, H, n, chunk) for t in (g, beta))
    seg = starts.view(B, 1, n, chunk).long().cumsum(-1)  # (B, 1, n, C): documents begun since the chunk start
    gamma = g.cumsum(-1)  # (B, H, n, C)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    same = causal & (seg[..., :, None] == seg[..., None, :])  # (B, 1, n, C, C)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~same, float("-inf")).exp()
    kb = k * beta[..., None]
    eye = torch.eye(chunk, device=q.device)
    system = eye + (kb @ k.transpose(-1, -2) * decay).tril(-1)  # I + A
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    inner = q @ k.transpose(-1, -2) * decay  # (B, H, n, C, C)
    sees_state = (seg == 0).float()[..., None]  # (B, 1, n, C, 1)
    q_state = q * gamma.exp()[..., None] * sees_state
    u_s = u_s * sees_state
    last_same = same[..., -1, :].float()[..., None]  # (B, 1, n, C, 1): j in the chunk's last document
    k_end = k * (gamma[..., -1:] - gamma).exp()[..., None] * last_same
    carry = (gamma[..., -1].exp() * (seg[..., -1] == 0).float())[..., None, None]  # (B, H, n, 1, 1)
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.float()
    out = []
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ S  # (B, H, C, Dv)
        out.append(q_state[:, :, i] @ S + inner[:, :, i] @ u)
        S = S * carry[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(B, H, n * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2), S


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm of the delta-rule output per value head, times silu(gate): HF's Qwen3NextRMSNormGated.

    y = weight * norm(x) (cast to x's dtype first) * silu(gate), in fp32, cast back; weight (Dv,) init 1.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


def linear_attend(attn: Any, layer_id: int, qkv: Tensor, g: Tensor, beta: Tensor, mix: Any) -> Tensor:
    """Run a Gated DeltaNet layer's recurrence under an attention context.

    qkv (B, T, C) the pre-convolution [q, k, v] channels, g and beta (B, T, Hv) fp32. `mix(qkv, g,
    beta, starts, conv_state, state) -> (o (B, T, Hv, Dv) fp32, conv_state, state)` is the layer's
    math. A context with `attend_linear` (the engine: per-sequence states) runs it itself; any other
    context gives its documents (`document_starts`) and the recurrences start from zero.
    """
    if hasattr(attn, "attend_linear"):
        return attn.attend_linear(layer_id, qkv, g, beta, mix)
    B, T, _ = qkv.shape
    return mix(qkv, g, beta, document_starts(attn, B, T, qkv.device), None, None)[0]
