"""The engine's decode fusions (models/common/fused_decode.py, runtime/engine/kernels.py `kv_write`)
against the eager torch path they replace: q/k norm + RoPE, residual add + RMSNorm, the k/v cache
write, and a whole engine's greedy tokens and logprobs with MESHRL_FUSED_DECODE=1 vs 0.

Each kernel test runs twice: on CUDA in bf16 (`gpu`), and on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) in fp16, whose casts the interpreter rounds as torch does (its bf16 casts
truncate), so there the fused results equal eager bit for bit. Both skip without triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from meshrl.models.common import fused_decode
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding, apply_rope
from meshrl.runtime.engine import kernels, kv_cache
from meshrl.runtime.engine.api import generate
from meshrl.runtime.engine.kv_cache import NULL_BLOCK, KVCache, write_kv
from meshrl.runtime.engine.native import NativeEngine
from tests.random_models import scaled_random_model
from tests.unit.test_engine import random_prompts, requests_for, tiny_model

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES = [pytest.param("interpret", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")])]


def _clear_kernel_caches() -> None:
    fused_decode._kernels.cache_clear()
    kernels._kernels.cache_clear()


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """'cpu' with the kernels interpreted, or 'cuda'; the fusions forced on (inference mode still needed)."""
    monkeypatch.setenv("MESHRL_FUSED_DECODE", "1")
    if request.param == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _clear_kernel_caches()  # jitted (or interpreted) afresh under this setting
    yield "cpu" if request.param == "interpret" else "cuda"
    _clear_kernel_caches()


def _dtype(device: str) -> torch.dtype:
    return torch.float16 if device == "cpu" else torch.bfloat16


def _assert_close(fused: torch.Tensor, eager: torch.Tensor, device: str) -> None:
    assert fused.shape == eager.shape and fused.dtype == eager.dtype
    if device == "cpu":  # interpreted: the same fp32 ops in the same order
        torch.testing.assert_close(fused, eager, rtol=0, atol=0)
        return
    # CUDA: the reduction order and the compiler's rsqrt / fused multiply-add move a result by
    # about one spacing of the activation dtype (tests/unit/test_fused.py measures the same)
    a, b = fused.float(), eager.float()
    spacing = 2.0**-7 * torch.maximum(torch.maximum(a.abs(), b.abs()), b.abs().mean() / 64)
    assert ((a - b).abs() / spacing).max().item() <= 2.0
    assert (fused != eager).float().mean().item() < 0.5


def test_the_switch_is_on_for_cuda_half_inference_only(monkeypatch):
    monkeypatch.delenv("MESHRL_FUSED_DECODE", raising=False)
    x = torch.zeros(2, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert not fused_decode.enabled(x)  # CPU: off unless forced
    monkeypatch.setenv("MESHRL_FUSED_DECODE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fused_decode.enabled(x)  # never outside inference mode (training, no-grad passes)
    with torch.inference_mode():
        assert fused_decode.enabled(x) == HAS_TRITON
        assert not fused_decode.enabled(x.to("meta"))
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not fused_decode.enabled(x)  # a CPU tensor only where triton interprets
        monkeypatch.setenv("MESHRL_FUSED_DECODE", "0")
        assert not fused_decode.enabled(x)


@pytest.mark.parametrize("shape", [(3, 1, 4, 2, 16, 16), (2, 5, 4, 2, 32, 16), (1, 3, 2, 1, 24, 12)])
def test_qk_norm_rope_matches_eager(device, shape):
    """From the views of a packed q/k/v output, partial rotary (R < D) and a non-power-of-two half included."""
    B, T, Hq, Hkv, D, R = shape
    dt = _dtype(device)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g) * 3).to(device, dt)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
    q, k = q.view(B, T, Hq, D), k.view(B, T, Hkv, D)
    q_norm, k_norm = RMSNorm(D).to(device, dt), RMSNorm(D).to(device, dt)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(D, generator=g))
        k_norm.weight.copy_(torch.randn(D, generator=g))
    cos, sin = RotaryEmbedding(R, 1e6)(torch.randint(0, 30000, (B, T), generator=g).to(device), dt)
    with torch.no_grad():  # eager (no inference mode: the plain modules)
        normed = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
        eager = apply_rope(*normed, cos, sin)
    with torch.inference_mode():
        fused = fused_decode.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, cos, sin)
    for f, e, n in zip(fused, eager, normed):
        assert f.shape == e.shape and f.dtype == e.dtype
        if device == "cpu":  # interpreted: the same fp32 ops in the same order
            torch.testing.assert_close(f, e, rtol=0, atol=0)
            continue
        # CUDA: the normed values may move by a spacing (the fp32 sum's order, rsqrt), and RoPE's
        # sum of two rounded products can cancel: bound by two spacings of the products (test_fused.py)
        c, s_ = torch.ones_like(n.float()), torch.zeros_like(n.float())
        c[..., :R], s_[..., :R] = cos[:, None].float(), sin[:, None].float()
        rot = torch.cat([n[..., R // 2:R], n[..., :R // 2], n[..., R:]], -1).float()
        products = n.float().abs() * c.abs() + rot.abs() * s_.abs()
        assert ((f.float() - e.float()).abs() <= 2.0**-6 * products + 1e-6).all()


def test_add_rms_norm_matches_eager(device):
    dt = _dtype(device)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(5, 3, 48, generator=g).to(device, dt) for _ in range(2))
    norm = RMSNorm(48).to(device, dt)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
        h, n = norm.add_forward(x, y)  # the eager fallback
    with torch.inference_mode():
        fh, fn = norm.add_forward(x, y)
    torch.testing.assert_close(fh, h, rtol=0, atol=0)  # one rounded add either way
    _assert_close(fn, n, device)


def test_kv_write_writes_the_slots_write_slots_writes(device):
    """Pads go to the null block's slot; every other slot gets its token's k and v; shapes are checked."""
    dt = _dtype(device)
    g = torch.Generator().manual_seed(2)
    caches = [KVCache([0, 1], num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16, dtype=dt, device=device)
              for _ in range(2)]
    qkv = torch.randn(3, 2, (4 + 2 + 2) * 16, generator=g).to(device, dt)  # v a strided view, as in the engine
    k = qkv[..., 64:96].view(3, 2, 2, 16).transpose(1, 2)
    v = qkv[..., 96:].view(3, 2, 2, 16).transpose(1, 2)
    slots = torch.tensor([5, 6, 9, NULL_BLOCK, 22, NULL_BLOCK], device=device)
    write_kv(caches[0], 1, slots, k, v)  # eager: two index_copy_
    with torch.inference_mode():
        write_kv(caches[1], 1, slots, k, v)
        with pytest.raises(ValueError, match="cache slots"):
            write_kv(caches[1], 1, slots[:4], k, v)
        with pytest.raises(ValueError, match="heads"):
            write_kv(caches[1], 1, slots, k[..., :8], v)
    real = slots != NULL_BLOCK
    eager, fused = (c.data.view(2, 2, 2, -1, 16) for c in caches)  # (layer, k/v, head, slot, D)
    torch.testing.assert_close(fused[:, :, :, slots[real]], eager[:, :, :, slots[real]], rtol=0, atol=0)
    keep = torch.ones(eager.shape[3], dtype=torch.bool, device=device)
    keep[slots] = False  # every slot not written stays zero in both
    assert not fused[:, :, :, keep].any() and not eager[:, :, :, keep].any()


def _engine_out(flag: str, device: str, dtype: torch.dtype):
    """The completions and which fused kernels ran."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("MESHRL_FUSED_DECODE", flag)
        return _counted_run(monkeypatch, device, dtype)


def _counted_run(monkeypatch, device: str, dtype: torch.dtype):
    calls = {}

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(fused_decode, "qk_norm_rope")
    counted(fused_decode, "add_rms_norm")
    counted(kv_cache, "kv_write")
    engine = NativeEngine(tiny_model(), max_num_seqs=3, max_model_len=64, block_size=4, device=device, dtype=dtype)
    return (engine, generate(engine, requests_for(random_prompts([5, 11, 3]), temperature=0.0, max_tokens=8))), calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_greedy_tokens_and_logprobs_agree(device, dtype):
    """The whole engine (prefill, decode, CUDA graphs on the GPU) with the fusions on and off. In fp32
    the kernels' math is eager's up to the order of a sum: the same tokens and logprobs. In bf16
    (CUDA only) their outputs move by about a spacing (the kernel tests) and a random tiny model has
    near-tied logits (test_engine's bf16 test), so: every fused greedy token is the eager full
    forward's argmax up to bf16 rounding, and the logprobs agree up to the first step where the
    two engines took different tokens."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates bf16 casts")
    (engine, on), calls = _engine_out("1", device, dtype)
    assert set(calls) == {"qk_norm_rope", "add_rms_norm", "kv_write"}  # each fused kernel served the engine
    (_, off), calls = _engine_out("0", device, dtype)
    assert not calls
    if dtype == torch.float32:
        assert [c.token_ids for c in on] == [c.token_ids for c in off]
    for prompt, a, b in zip(random_prompts([5, 11, 3]), on, off):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids) - 1)
        torch.testing.assert_close(torch.tensor(a.logprobs[:same + 1]), torch.tensor(b.logprobs[:same + 1]),
                                   rtol=0, atol=1e-4 if dtype == torch.float32 else 0.1)
        ids = list(prompt) + a.token_ids
        with torch.no_grad():  # eager modules (no inference mode: no fused kernel)
            logits = engine.model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None])
        logits = logits[0, len(prompt) - 1:-1].float()
        gap = logits.max(-1).values - logits.gather(-1, torch.tensor(a.token_ids, device=device)[:, None])[:, 0]
        assert (gap <= 0.02 * logits.abs().max(-1).values + 1e-3).all(), gap.tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_hidden_with_the_fusions_matches_eager(device, family):
    """DecoderLM.hidden with every fusion (q/k norm + RoPE for Qwen3, the residual adds carried
    into the next norm's kernel, the final norm included) against the eager modules."""
    from meshrl.models import get_family

    fam = get_family(family)
    model = scaled_random_model(fam.model_cls, fam.flavors["debug"], seed=0).to(device, _dtype(device))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, fam.flavors["debug"].vocab_size, (3, 7), generator=g).to(device)
    positions = torch.arange(7, device=device).expand(3, -1)
    with torch.no_grad():
        eager = model.hidden(tokens, positions)
    with torch.inference_mode():
        fused = model.hidden(tokens, positions)
    if device == "cpu":  # interpreted fp16: the same ops in the same order
        torch.testing.assert_close(fused, eager, rtol=0, atol=0)
    else:  # bf16 spacings compound over the layers: a loose bound, the kernel tests hold the tight ones
        assert (fused.float() - eager.float()).abs().max().item() <= 0.05 * eager.float().abs().max().item()
