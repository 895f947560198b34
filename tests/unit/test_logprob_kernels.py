"""The logprob head's Triton kernels (runtime/train/logprob_kernels.py) against the torch path they replace.

Each test runs twice: on CUDA in bf16 (`gpu`) at the real vocabulary (151,936) and a small one,
and on the CPU under Triton's interpreter (TRITON_INTERPRET=1) in fp32 and fp16 with small blocks,
so a tiny vocabulary still spans several blocks and a partial one (the interpreter's bf16 casts
truncate where torch rounds, so bf16 is checked on CUDA only). Both skip without triton.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from meshrl.runtime.train import logprob_head, logprob_kernels
from meshrl.runtime.train.logprob_head import chunked_token_logprobs
from meshrl.runtime.train.losses import token_logprobs
from tests.unit.test_logprob_head import head_peak_bytes

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES = [pytest.param("interpret", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")])]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """'cpu' with the kernels interpreted (blocks of 16 columns), or 'cuda'; the kernels forced on."""
    monkeypatch.setenv("MESHRL_FUSED_LOGPROBS", "1")
    if request.param == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(logprob_kernels, "_BLOCK_FWD", 16)
        monkeypatch.setattr(logprob_kernels, "_BLOCK_BWD", 16)
    logprob_kernels._kernels.cache_clear()  # jitted (or interpreted) afresh under this setting
    yield "cpu" if request.param == "interpret" else "cuda"
    logprob_kernels._kernels.cache_clear()


def _cases(device: str) -> list[tuple[torch.dtype, int]]:
    """(dtype, vocabulary) pairs: odd sizes, never a multiple of the block."""
    if device == "cpu":
        return [(torch.float32, 50), (torch.float16, 37), (torch.float16, 5)]
    return [(torch.bfloat16, 151936), (torch.bfloat16, 1000), (torch.float32, 50)]


def _logits(n: int, V: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, V, generator=gen)).to(dtype).to(device)
    targets = torch.randint(0, V, (n,), generator=gen).to(device)
    return logits, targets


def _spacings(fused: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at the larger magnitude (floored at a tiny scale)."""
    a, b = fused.float(), ref.float()
    eps = torch.finfo(ref.dtype).eps
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), b.abs().max() * 2.0**-20)
    return ((a - b).abs() / (eps * scale)).max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_stats_match_torch(device, temperature):
    for dtype, V in _cases(device):
        logits, targets = _logits(19, V, dtype, device)
        ours = [torch.empty(19, device=device) for _ in range(3)]
        ref = [torch.empty(19, device=device) for _ in range(3)]
        logprob_kernels.forward_stats(logits, targets, temperature, *ours)
        logprob_head._torch_stats(logits.clone(), targets, temperature, *ref)
        z = logits.double() / temperature  # the exact values, from the same logits
        lse = torch.logsumexp(z, dim=-1)
        exact = [lse, z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse - ((z - lse[:, None]).exp() * z).sum(-1)]
        for name, a, b, c in zip(["lse", "logprobs", "entropy"], ours, ref, exact):
            # fp32 reductions in another order (and the compiler's exp/log on CUDA); entropy =
            # lse - sum p z cancels, which costs the torch path ~1e-5 at |lse| ~ 16
            torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5, msg=f"{name} {dtype} V={V} vs exact")
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5, msg=f"{name} {dtype} V={V} vs torch")


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_dlogits_match_torch(device, temperature):
    for dtype, V in _cases(device):
        logits, targets = _logits(11, V, dtype, device, seed=1)
        lse, logprobs, entropy = (torch.empty(11, device=device) for _ in range(3))
        logprob_head._torch_stats(logits.clone(), targets, temperature, lse, logprobs, entropy)
        grad = torch.randn(11, generator=torch.Generator().manual_seed(2)).to(device)
        ref = logprob_head._torch_dlogits(logits.clone(), targets, lse, grad, temperature)
        ours = logprob_kernels.dlogits_(logits, targets, lse, grad, temperature)
        assert ours.data_ptr() == logits.data_ptr() and ours.dtype == dtype  # in place, in the input dtype
        # The same fp32 formula. z may differ in its last bit (torch on the CPU divides by T, we
        # multiply by 1 / T, as torch on CUDA does) and exp in its last bits: ~|z| fp32 spacings in
        # p, which moves a value rounded to half precision by at most one spacing.
        if dtype == torch.float32:
            assert _spacings(ours, ref) <= 64, f"{dtype} V={V}"
        else:
            assert _spacings(ours, ref) <= 1.0, f"{dtype} V={V}"
            assert (ours != ref).float().mean().item() < 0.1, f"{dtype} V={V}"


# 37 tokens: chunks of 5 and 16 do not divide it, 64 exceeds it.
@pytest.mark.parametrize("chunk_tokens", [5, 16, 64])
def test_head_matches_torch_path(device, monkeypatch, chunk_tokens):
    for dtype, V in _cases(device):
        gen = torch.Generator().manual_seed(3)
        hidden = torch.randn(1, 37, 32, generator=gen).to(dtype).to(device).requires_grad_()
        weight = (0.5 * torch.randn(V, 32, generator=gen)).to(dtype).to(device).requires_grad_()
        targets = torch.randint(0, V, (1, 37), generator=gen).to(device)
        upstream = torch.randn(1, 37, generator=gen).to(device)
        runs = {}
        for fused in ("1", "0"):
            monkeypatch.setenv("MESHRL_FUSED_LOGPROBS", fused)
            hidden.grad = weight.grad = None
            logprobs, entropy = chunked_token_logprobs(hidden, weight, targets, 1.3, chunk_tokens)
            (logprobs * upstream).sum().backward()
            runs[fused] = (logprobs.detach(), entropy, hidden.grad, weight.grad)
        ours, ref = runs["1"], runs["0"]
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-5
        for name, a, b in zip(["logprobs", "entropy", "grad_hidden", "grad_weight"], ours, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            # logprobs and entropy come from the same logits; the gradients from dlogits that
            # differ by at most one spacing of the dtype in a few elements
            rtol, atol = (1e-5, 5e-5) if name in ("logprobs", "entropy") else (tol, tol)
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=f"{name} {dtype} V={V}")
        if dtype == torch.float32:  # and both match the unchunked path
            expected = token_logprobs(F.linear(hidden.detach(), weight.detach()), targets, 1.3)
            torch.testing.assert_close(ours[0], expected[0], rtol=1e-5, atol=1e-5)


def test_the_switch(monkeypatch):
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    monkeypatch.delenv("MESHRL_FUSED_LOGPROBS", raising=False)
    assert not logprob_kernels.enabled(x)  # CPU keeps the torch path unless forced
    monkeypatch.setenv("MESHRL_FUSED_LOGPROBS", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not logprob_kernels.enabled(x)  # forced on, but no kernel runs on the CPU uninterpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert logprob_kernels.enabled(x) == HAS_TRITON
    assert not logprob_kernels.enabled(x.long())
    assert not logprob_kernels.enabled(torch.empty(2, 3, dtype=torch.bfloat16, device="meta"))
    monkeypatch.setenv("MESHRL_FUSED_LOGPROBS", "0")
    assert not logprob_kernels.enabled(x)
    if torch.cuda.is_available():
        assert not logprob_kernels.enabled(x.cuda())
        monkeypatch.delenv("MESHRL_FUSED_LOGPROBS")
        assert logprob_kernels.enabled(x.cuda()) == HAS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_fused_peak_memory_is_the_input_dtype_logits(monkeypatch):
    # V = 32768, dim 512, chunks of 1024 tokens, 8192 tokens: the fused head holds one chunk of
    # bf16 logits (64 MiB) and the weight gradient (fp32 sum, a bf16 chunk term and the bf16
    # result: 8 bytes x V x dim = 128 MiB). The torch path's fp32 z and p add 256 MiB more.
    monkeypatch.setenv("MESHRL_FUSED_LOGPROBS", "1")
    dim, V, chunk, N = 512, 32768, 1024, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (0.05 * torch.randn(V, dim, device="cuda", generator=gen)).bfloat16().requires_grad_()

    def peak_bytes() -> int:
        return head_peak_bytes(weight, N, chunk, gen)[0]

    peak_bytes()  # warm-up: cuBLAS workspaces are allocated on first use
    peak = peak_bytes()
    hidden_and_grads = 2 * N * dim * 2 + 4 * N * 4  # hidden's gradient, bf16 matmul outputs, per-token vectors
    assert peak < 2 * chunk * V * 2 + 8 * V * dim + hidden_and_grads + 32 * 2**20, f"peak {peak / 2**20:.0f} MiB"
