"""Chunked LM head against the unchunked `token_logprobs(F.linear(hidden, weight), ...)`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.runtime.train.losses import token_logprobs
from meshrl.runtime.train.logprob_head import LogprobHead, chunked_token_logprobs, default_chunk_tokens


def make_inputs(B: int, T: int, dim: int, V: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, dim, generator=gen).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(V, dim, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    upstream = torch.randn(B, T, generator=gen)  # an arbitrary d loss / d logprob
    return hidden, weight, targets, upstream


def values_and_grads(fn, hidden, weight, upstream):
    hidden.grad = weight.grad = None
    logprobs, entropy = fn()
    (logprobs * upstream).sum().backward()
    return logprobs.detach(), entropy, hidden.grad.clone(), weight.grad.clone()


# B * T = 21 tokens: chunks of 1, 4 and 5 do not divide it, 21 is exactly one, 64 exceeds it.
@pytest.mark.parametrize("chunk_tokens", [1, 4, 5, 21, 64, None])
def test_matches_unchunked_fp32(chunk_tokens):
    hidden, weight, targets, upstream = make_inputs(B=3, T=7, dim=16, V=50, dtype=torch.float32)
    temperature = 0.7
    ref = values_and_grads(lambda: token_logprobs(F.linear(hidden, weight), targets, temperature),
                           hidden, weight, upstream)
    ours = values_and_grads(lambda: chunked_token_logprobs(hidden, weight, targets, temperature, chunk_tokens),
                            hidden, weight, upstream)
    for name, a, b in zip(["logprobs", "entropy", "grad_hidden", "grad_weight"], ours, ref):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert not ours[1].requires_grad  # entropy is a metric


@pytest.mark.parametrize("chunk_tokens", [8, 13])
def test_matches_unchunked_bf16(chunk_tokens):
    hidden, weight, targets, upstream = make_inputs(B=2, T=20, dim=32, V=96, dtype=torch.bfloat16)
    temperature = 1.3
    ref = values_and_grads(lambda: token_logprobs(F.linear(hidden, weight), targets, temperature),
                           hidden, weight, upstream)
    ours = values_and_grads(lambda: chunked_token_logprobs(hidden, weight, targets, temperature, chunk_tokens),
                            hidden, weight, upstream)
    logprobs, entropy, grad_hidden, grad_weight = ours
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    # Same bf16 logits per token, so the fp32 values agree closely; the gradients differ by
    # bf16 rounding of the matmul outputs (ours sums weight-gradient chunks in fp32).
    torch.testing.assert_close(logprobs, ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_hidden.float(), ref[2].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_weight.float(), ref[3].float(), rtol=2e-2, atol=2e-2)


def test_gradient_of_hidden_only():
    hidden, weight, targets, upstream = make_inputs(B=1, T=9, dim=8, V=30, dtype=torch.float32)
    weight.requires_grad_(False)
    logprobs, _ = chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_tokens=4)
    (logprobs * upstream).sum().backward()
    expected, = torch.autograd.grad((token_logprobs(F.linear(hidden, weight), targets, 1.0)[0] * upstream).sum(),
                                    hidden)
    torch.testing.assert_close(hidden.grad, expected)
    assert weight.grad is None


def test_saves_no_logits_for_backward():
    # A saved (N, V) tensor is what chunking exists to avoid: only hidden, weight, targets and
    # the per-token logsumexp may be kept.
    B, T, dim, V = 2, 32, 8, 500
    hidden, weight, targets, _ = make_inputs(B=B, T=T, dim=dim, V=V, dtype=torch.float32)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_tokens=16)
    assert saved and max(saved) == V * dim < B * T * V


def test_default_chunk_tokens():
    assert default_chunk_tokens(151936) == 1664  # 1 GiB of fp32 logits, a multiple of 128
    assert default_chunk_tokens(128) % 128 == 0 and default_chunk_tokens(128) >= 1 << 20
    assert default_chunk_tokens(10**9) == 128


def test_rejects_bad_arguments():
    hidden, weight, targets, _ = make_inputs(B=1, T=4, dim=8, V=10, dtype=torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        chunked_token_logprobs(hidden, weight.detach().double(), targets, 1.0)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(hidden, weight, targets[:, :3], 1.0)


@pytest.mark.parametrize("tie", [True, False])
def test_model_head_matches_logits_path(tie):
    from dataclasses import replace

    args = replace(FLAVORS["debug"], tie_embeddings=tie)
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    B, T, temperature = 2, 12, 0.8
    tokens = torch.randint(0, args.vocab_size, (B, T), generator=gen)
    targets = torch.randint(0, args.vocab_size, (B, T), generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(T))])
    upstream = torch.randn(B, T, generator=gen)

    def run(head: LogprobHead | None):
        model.zero_grad()
        attn = DocumentCausalAttention.from_positions(positions)
        if head is None:
            logprobs, entropy = token_logprobs(model(tokens, positions, attn), targets, temperature)
        else:
            logprobs, entropy = model(tokens, positions, attn, head=head)
        (logprobs * upstream).sum().backward()
        return logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = run(None)
    ours = run(LogprobHead(targets, temperature, chunk_tokens=7))
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-5)
    assert ours[2].keys() == ref[2].keys()
    for name, grad in ref[2].items():
        # fp32 rounding is relative to the tensor's scale: a small entry of the untied embedding's
        # gradient (entries up to ~6) sums terms of that size and differed by 1.2e-6 on one CPU
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(ours[2][name], grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def head_peak_bytes(weight: torch.Tensor, N: int, chunk: int, gen: torch.Generator) -> tuple:
    """The chunked head's forward and backward over N random bf16 tokens on CUDA -> (peak bytes
    allocated above the start, hidden, targets, logprobs, entropy)."""
    V, dim = weight.shape
    hidden = torch.randn(1, N, dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (1, N), device="cuda", generator=gen)
    weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    logprobs, entropy = chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_tokens=chunk)
    logprobs.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline, hidden, targets, logprobs, entropy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_bounded_on_cuda():
    # V = 32768, chunks of 1024 tokens: the peak is one chunk's logits plus the weight gradient,
    # whatever the token count. Unchunked, 8192 tokens hold 1 GiB of fp32 logits alone and
    # every further 8192 tokens add 1.5 GiB (fp32 + bf16 logits).
    dim, V, chunk = 512, 32768, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (0.05 * torch.randn(V, dim, device="cuda", generator=gen)).bfloat16().requires_grad_()

    def peak_bytes(N: int) -> int:
        peak, hidden, targets, logprobs, entropy = head_peak_bytes(weight, N, chunk, gen)
        ref_logprobs, ref_entropy = token_logprobs(F.linear(hidden, weight), targets, 1.0)
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(entropy, ref_entropy, rtol=1e-3, atol=1e-3)
        return peak

    peak_bytes(1024)  # warm-up: cuBLAS workspaces are allocated on first use
    small, large = peak_bytes(8192), peak_bytes(16384)
    assert small < 8192 * V * 4, f"peak {small / 2**20:.0f} MiB"
    # 8192 more tokens add only their hidden states, gradients and per-token outputs (~20 MiB).
    assert large - small < 64 * 2**20, f"peaks {small / 2**20:.0f} and {large / 2**20:.0f} MiB"
