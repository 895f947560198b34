"""Batched sampler: parameter validation, truncation (top_k, min_p, top_p), full-distribution fp32
logprobs, the counter-based RNG, batch independence and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from meshrl.runtime.engine.sampling import (
    SamplingBatch,
    SamplingParams,
    StaticSamplingBatch,
    hash_uniform,
    inverse_cdf,
    sample,
    truncate,
)


def batch_of(*params: SamplingParams, seeds: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch.build(list(params), seeds or list(range(len(params))), torch.device("cpu"))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.5), dict(max_tokens=0),
    dict(stop_token_ids=(-1,)), dict(stop=("",)), dict(n=0), dict(seed=-1),
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_store_tuples():
    p = SamplingParams(stop_token_ids=[3, 4], stop="END")
    assert p.stop_token_ids == (3, 4) and p.stop == ("END",)
    hash(p)


def test_truncate_top_k_min_p_top_p():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 4)
    scaled = probs.log()
    params = [SamplingParams(top_k=2), SamplingParams(min_p=0.6), SamplingParams(top_p=0.65), SamplingParams()]
    out = truncate(probs, scaled, batch_of(*params))
    expected = torch.tensor([
        [0.0, 0.4, 0.0, 0.3],  # the 2 largest
        [0.0, 0.4, 0.0, 0.3],  # >= 0.6 * 0.4 = 0.24
        [0.0, 0.4, 0.0, 0.3],  # mass above 0.3 is 0.4 < 0.65, above 0.2 is 0.7: dropped
        [0.1, 0.4, 0.2, 0.3],
    ])
    assert torch.equal(out, expected)
    # top_p acts on what top_k left: of {0.4, 0.3} (mass 0.7), 0.4 alone is 57% < 60%: keep both.
    both = truncate(probs[:1], scaled[:1], batch_of(SamplingParams(top_k=2, top_p=0.6)))
    assert torch.equal(both, expected[:1])


def test_greedy_and_tiny_top_p_pick_argmax_and_report_full_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.5, 0.0, 4.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_p=0.01),
              SamplingParams(temperature=0.5, top_k=1)]
    tokens, logprobs = sample(logits, batch_of(*params), torch.zeros(3, dtype=torch.long))
    assert tokens.tolist() == [1, 0, 2]
    expected = torch.stack([torch.log_softmax(logits[0], -1)[1], torch.log_softmax(logits[1] / 2.0, -1)[0],
                            torch.log_softmax(logits[2] / 0.5, -1)[2]])
    assert torch.allclose(logprobs, expected) and logprobs.dtype == torch.float32


def test_hash_uniform_is_deterministic_and_spread():
    seeds = torch.arange(20000) * 7919 + 2**40
    counters = torch.arange(20000) % 13
    u = hash_uniform(seeds, counters)
    assert torch.equal(u, hash_uniform(seeds, counters))
    assert u.min() >= 0 and u.max() < 1 and u.dtype == torch.float64
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert len(set(u.tolist())) == len(u)
    assert hash_uniform(torch.tensor([5]), torch.tensor([0])) != hash_uniform(torch.tensor([5]), torch.tensor([1]))


def test_row_draw_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=1.0, top_k=10 * (i % 3), top_p=0.9 if i % 2 else 1.0) for i in range(6)]
    counters = torch.arange(6)
    tokens, logprobs = sample(logits, batch_of(*params, seeds=[11 * i for i in range(6)]), counters)
    for i in range(6):
        alone, lp = sample(logits[i:i + 1], batch_of(params[i], seeds=[11 * i]), counters[i:i + 1])
        assert alone.item() == tokens[i].item() and lp.item() == pytest.approx(logprobs[i].item())


def test_sampled_frequencies_follow_the_truncated_distribution():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    num = 20000
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, min_p=0.2)] * num, [3] * num, torch.device("cpu"))
    tokens, _ = sample(logits.expand(num, 4), batch, torch.arange(num))
    freq = torch.bincount(tokens, minlength=4).double() / num
    target = torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95  # 0.05 < 0.2 * 0.5 is dropped
    assert freq[0] == 0
    assert (freq - target).abs().max() < 0.015


def test_pad_rows_change_no_real_row_and_switch_on_no_work():
    """None rows (the engine's pad rows) neither change the real rows' tokens and logprobs nor
    turn on work only they would need (the argmax of greedy rows, the temperature division)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    cpu = torch.device("cpu")
    params = [SamplingParams(temperature=1.0), None, SamplingParams(temperature=0.7, top_k=5), None,
              SamplingParams(temperature=0.0)]
    counters = torch.tensor([3, 0, 4, 0, 9])
    padded = SamplingBatch.build(params, [5, 0, 6, 0, 7], cpu)
    tokens, logprobs = sample(logits, padded, counters)
    for i in (0, 2, 4):
        alone = SamplingBatch.build([params[i]], [[5, 0, 6, 0, 7][i]], cpu)
        token, logprob = sample(logits[i:i + 1], alone, counters[i:i + 1])
        assert token.item() == tokens[i].item() and logprob.item() == logprobs[i].item()
    sampled_only = SamplingBatch.build([SamplingParams(temperature=1.0), None], [1, 0], cpu)
    assert not sampled_only.any_greedy and not sampled_only.all_greedy and sampled_only.unit_temperature
    assert SamplingBatch.build([SamplingParams(temperature=0.0), None], [1, 0], cpu).all_greedy
    assert not padded.unit_temperature and padded.any_greedy and padded.max_top_k == 5


@pytest.mark.parametrize("vocab", [5, 1024, 3000, 151936])
def test_inverse_cdf_matches_the_full_cumsum_and_skips_zero_mass(vocab):
    """The two-level draw picks the token a full-vocabulary fp64 cumsum picks (up to targets
    within rounding of a token boundary) and never a token of zero mass."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=g) ** 8
    probs[:, ::3] = 0.0  # truncated tokens
    probs[:, 1] += 1e-3
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0**-48
    drawn = inverse_cdf(probs, u)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    assert (probs.gather(1, drawn[:, None]) > 0).all()
    mismatch = drawn != expected
    if mismatch.any():  # only where the target sits at a boundary up to rounding
        rows = mismatch.nonzero().squeeze(1)
        gap = (cdf[rows, expected[rows]] - u[rows] * cdf[rows, -1]).abs() / cdf[rows, -1]
        assert (gap < 1e-12).all() and mismatch.sum() <= 1


def test_static_batch_view_samples_like_the_batch():
    """The fixed-address buffers a CUDA graph reads give the same tokens as the batch they hold."""
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1), None, SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.9, min_p=0.05)]
    batch = SamplingBatch.build(params, [11, 0, 12, 13], torch.device("cpu"))
    static = StaticSamplingBatch(8, torch.device("cpu"))
    static.load(batch)
    assert batch.mode()[0] == 8  # top_k 5 rounds up to the next power of two
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    counters = torch.arange(4)
    for a, b in zip(sample(logits, batch, counters), sample(logits, static.view(4, batch.mode()), counters)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("vocab", [7, 1024, 5000])
def test_untruncated_sampler_matches_the_full_probability_path(vocab):
    """The chunked one-pass sampler (no truncation) draws the tokens and reports the logprobs of
    the whole-vocabulary path, for greedy, sampled and tempered rows mixed."""
    from meshrl.runtime.engine.sampling import _sample_full, _sample_truncated

    g = torch.Generator().manual_seed(vocab)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.0, 0.7, 1.3] * 16)]
    batch = SamplingBatch.build(params, [p.seed for p in params], torch.device("cpu"))
    for step in range(5):
        logits = (torch.randn(64, vocab, generator=g) * 4).to(torch.bfloat16)
        counters = torch.full((64,), step)
        tokens, logprobs = _sample_full(logits, batch, counters)
        ref_tokens, ref_logprobs = _sample_truncated(logits, batch, counters)
        assert (tokens != ref_tokens).sum() <= 1  # only a target on a token boundary may differ
        same = tokens == ref_tokens
        assert torch.allclose(logprobs[same], ref_logprobs[same], atol=2e-6, rtol=1e-6)
    assert torch.equal(tokens[1::4], logits.float().argmax(-1)[1::4])  # greedy rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_chunk_stats_match_torch():
    pytest.importorskip("triton")
    from meshrl.runtime.engine.kernels import chunk_stats

    logits = (torch.randn(37, 151936, device="cuda") * 5).to(torch.bfloat16)
    logits[3, 2048:3072] = logits[3].max()  # ties: the first index wins
    divisor = torch.rand(37, device="cuda") + 0.5
    cmax, csum, carg = chunk_stats(logits, divisor, 1024)
    x = torch.nn.functional.pad(logits.float() / divisor[:, None], (0, 149 * 1024 - 151936), value=float("-inf"))
    ref_max, ref_arg = x.view(37, 149, 1024).max(dim=-1)
    ref_sum = (x.view(37, 149, 1024) - ref_max[..., None]).exp().sum(-1)
    assert torch.allclose(cmax, ref_max, rtol=1e-6) and torch.allclose(csum, ref_sum, rtol=1e-5)
    assert torch.equal(carg, ref_arg)


def test_mul32_keeps_the_low_bits_of_a_wrapping_product():
    """The RNG's 32-bit multiply relies on int64 products wrapping modulo 2**64 (they pass 2**63)."""
    from meshrl.runtime.engine.sampling import _mul32

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 2**32, (50000,), generator=g), torch.tensor([0, 1, 2**31, 2**32 - 1])])
    for c in (0x7FEB352D, 0x846CA68B, 2**32 - 1):
        assert _mul32(x, c).tolist() == [(v * c) % 2**32 for v in x.tolist()]
