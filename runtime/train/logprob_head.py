"""A chunked LM head: target log-probabilities and entropy without the (B, T, V) logits.

At V = 151936 and 16k tokens a row, the fp32 logits `losses.token_logprobs` keeps for
backward are ~9.3 GiB, plus their input-dtype copy. Here the flattened tokens are processed
`chunk_tokens` at a time: forward keeps only the per-token logsumexp, and backward recomputes
each chunk's logits from (hidden, weight), so at most one chunk of logits is alive at a time.

The numbers are those of `losses.token_logprobs(F.linear(hidden, weight), targets, T)`:
logits in the input dtype, divided by the temperature in fp32, `log p(target) = z[target] -
logsumexp(z)`, entropy detached. The trainer passes a `LogprobHead` to
`model(tokens, positions, attn, head=...)`, which calls it inside the model's forward where
the LM head weight is unsharded (FSDP2).

Around the two matmuls of a chunk (cuBLAS, input dtype), the element-wise work runs either in
torch (`_torch_stats`, `_torch_dlogits`: fp32 (n, V) temporaries; the CPU path and the reference)
or in two Triton kernels (runtime/train/logprob_kernels.py: they read the input-dtype logits and
write dlogits over them in place, so a chunk holds no fp32 (n, V) tensor). The kernels serve
CUDA by default; MESHRL_FUSED_LOGPROBS=0 / 1 forces them off / on (that module's docstring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from meshrl.runtime.train import logprob_kernels

__all__ = ["chunked_token_logprobs", "LogprobHead", "default_chunk_tokens"]

# Chunk size by memory budget rather than a fixed token count: the cost of a chunk on the torch
# path is its fp32 logits, chunk * V * 4 bytes (forward holds about 2.5x that: the fp32 z and p
# and the input-dtype logits; backward about 2x). 1 GiB gives ~1.7k tokens at V = 152k, where
# the (chunk x dim) @ (dim x V) matmul is still large enough to keep a GPU's tensor cores busy
# (> 1 TFLOP per chunk at dim = 4096), and a whole small-vocabulary row in one chunk.
# The fused kernels hold only the input-dtype logits (2 bytes a logit in bf16, not ~10), and the
# rule is kept as it is: it still bounds the torch path (CPU, MESHRL_FUSED_LOGPROBS=0), larger
# chunks buy no matmul efficiency past ~1k rows and no L2 reuse (a chunk's logits are hundreds of
# MiB either way), and the one per-chunk cost that shrinks, the weight-gradient add of a (V, dim)
# matmul result into the fp32 sum (~10 bytes x V x dim of traffic: ~1.6 GB, an estimated ~0.4 ms at
# the 0.6B shape on an H200), is under 1% of a step at the trainer's 4096-token chunks; the memory saved goes to
# activations instead.
_CHUNK_BYTES = 1 << 30
# Multiples of 128 rows keep the matmul tiles full.
_CHUNK_ALIGN = 128


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose fp32 logits fit in `_CHUNK_BYTES`, a multiple of 128 (at least 128)."""
    tokens = _CHUNK_BYTES // (4 * vocab_size)
    return max(_CHUNK_ALIGN, tokens // _CHUNK_ALIGN * _CHUNK_ALIGN)


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                           chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Log-probabilities of `targets` and entropy of softmax(hidden @ weight.T / temperature).

    Args:
        hidden: (B, T, dim) final-normed hidden states, any float dtype.
        weight: (V, dim) LM head, same dtype as `hidden`.
        targets: (B, T) int64 token ids in [0, V).
        temperature: > 0.
        chunk_tokens: tokens per chunk (of the B * T flattened tokens); None picks
            `default_chunk_tokens(V)`.

    Returns:
        logprobs: (B, T) fp32, differentiable w.r.t. `hidden` and `weight`.
        entropy: (B, T) fp32, detached (a metric, not a loss term).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"expected hidden (B, T, dim) and weight (V, dim), got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets {tuple(targets.shape)} must be (B, T) = {tuple(hidden.shape[:2])}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    B, T, dim = hidden.shape
    # The outputs are made (B, T) inside the Function, not viewed after it: FSDP2 warns about
    # (and cannot hook in-place ops on) a root module output that is a view.
    return _ChunkedLogprobs.apply(hidden.reshape(B * T, dim), weight, targets.reshape(B * T),
                                  float(temperature), int(chunk_tokens), (B, T))


class _ChunkedLogprobs(torch.autograd.Function):
    """(N, dim), (V, dim), (N,) -> logprobs, entropy of `shape` (N elements); saves no logits for backward."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_tokens: int, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        N = hidden.shape[0]
        logprobs_out = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        entropy_out = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        logprobs, entropy = logprobs_out.view(N), entropy_out.view(N)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        fused = logprob_kernels.enabled(hidden)
        for start in range(0, N, chunk_tokens):
            end = min(start + chunk_tokens, N)
            # The matmul in the input dtype (like F.linear in the unchunked path).
            logits = hidden[start:end] @ weight.T  # (n, V)
            if fused:
                logprob_kernels.forward_stats(logits, targets[start:end], temperature, lse[start:end],
                                              logprobs[start:end], entropy[start:end])
            else:
                _torch_stats(logits, targets[start:end], temperature, lse[start:end], logprobs[start:end],
                             entropy[start:end])
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.fused = fused
        ctx.mark_non_differentiable(entropy_out)
        return logprobs_out, entropy_out

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_logprobs = grad_logprobs.reshape(-1)  # (N,)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        N = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Partial weight gradients are summed in fp32 (one matmul per chunk would otherwise
        # round the running sum to bf16 each time); cast to the weight dtype at the end.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_logprobs = grad_logprobs.float().contiguous()
        for start in range(0, N, chunk_tokens):
            end = min(start + chunk_tokens, N)
            h = hidden[start:end]  # (n, dim)
            logits = h @ weight.T  # (n, V), as in forward
            if ctx.fused:  # in place over the logits, in their dtype
                dlogits = logprob_kernels.dlogits_(logits, targets[start:end], lse[start:end],
                                                   grad_logprobs[start:end], temperature)
            else:
                dlogits = _torch_dlogits(logits, targets[start:end], lse[start:end], grad_logprobs[start:end],
                                         temperature)
            if need_hidden:
                grad_hidden[start:end] = dlogits @ weight
            if need_weight and dlogits.dtype == torch.float32:
                grad_weight.addmm_(dlogits.T, h)  # no (V, dim) temporary
            elif need_weight:
                grad_weight.add_(dlogits.T @ h)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _torch_stats(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor, logprobs: Tensor,
                 entropy: Tensor) -> None:
    """The reference for `logprob_kernels.forward_stats`: fill lse, logprobs, entropy (n,) from logits (n, V)."""
    z = logits.float().div_(temperature)  # (n, V) fp32
    lse_c = torch.logsumexp(z, dim=-1)  # (n,)
    logprobs.copy_(z.gather(-1, targets[:, None]).squeeze(-1) - lse_c)
    lse.copy_(lse_c)
    # H = lse - sum_v p_v z_v, as losses._entropy computes it; p is built in the one (n, V)
    # temporary so a chunk costs two fp32 (n, V) tensors at most.
    p = (z - lse_c[:, None]).exp_()  # (n, V)
    entropy.copy_(lse_c - p.mul_(z).sum(dim=-1))


def _torch_dlogits(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """The reference for `logprob_kernels.dlogits_`: d(sum grad * logprob) / d logits (n, V) in the logits' dtype."""
    z = logits.float().div_(temperature)  # (n, V) fp32, as in forward
    # d logprob / d z = onehot(target) - softmax(z); built in place in z's storage.
    dz = z.sub_(lse[:, None]).exp_().neg_()  # (n, V) = -softmax(z)
    dz.scatter_add_(-1, targets[:, None], torch.ones_like(dz[:, :1]))
    # Chain rule through z = logits / temperature; the matmuls run in the input dtype.
    return dz.mul_(grad[:, None] / temperature).to(logits.dtype)  # (n, V)


class LogprobHead:
    """An `OutputHead` (models/common/attention.py) returning `chunked_token_logprobs`.

    Usage: `logprobs, entropy = model(tokens, positions, attn, head=LogprobHead(targets, T))`,
    each (B, T) fp32.
    """

    def __init__(self, targets: Tensor, temperature: float, chunk_tokens: int | None = None) -> None:
        self.targets = targets  # (B, T) int64
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens

    def __call__(self, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return chunked_token_logprobs(hidden, weight, self.targets.to(hidden.device), self.temperature,
                                      self.chunk_tokens)
