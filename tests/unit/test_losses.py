"""Advantages, filters, losses and mismatch corrections against hand-computed values."""

import math

import pytest
import torch

from meshrl.runtime.train.losses import (POLICY_LOSSES, aipo_loss, cispo_loss, correction_weights, dppo_loss,
                                         filter_reason, group_advantages, gspo_loss, length_penalized, ppo_clip_loss,
                                         sft_loss, token_logprobs)

LN = math.log


def test_group_advantages_subtract_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    # Row means: 0.5 and 0.2.
    expected = torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(rewards), expected)


def test_group_advantages_no_std_normalisation():
    # Mean 2, std != 1: a normalised version would rescale; ours must not.
    torch.testing.assert_close(group_advantages(torch.tensor([[0.0, 4.0]])), torch.tensor([[-2.0, 2.0]]))


def test_group_advantages_rejects_1d():
    with pytest.raises(ValueError, match="num_prompts"):
        group_advantages(torch.tensor([1.0, 2.0]))


def test_token_logprobs_tempered_by_hand():
    # With temperature 2 the tempered logits are [0, ln 2, ln 3]: probs 1/6, 2/6, 3/6.
    logits = torch.tensor([[[0.0, 2 * LN(2), 2 * LN(3)], [0.0, 2 * LN(2), 2 * LN(3)]]])  # (1, 2, 3)
    targets = torch.tensor([[2, 0]])
    logprobs, entropy = token_logprobs(logits, targets, temperature=2.0)
    assert logprobs.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs, torch.tensor([[LN(1 / 2), LN(1 / 6)]]))
    h = -(1 / 6 * LN(1 / 6) + 2 / 6 * LN(2 / 6) + 3 / 6 * LN(3 / 6))
    torch.testing.assert_close(entropy, torch.tensor([[h, h]]))


def test_token_logprobs_matches_direct_computation_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    logprobs, entropy = token_logprobs(logits, targets, temperature=0.7)

    ref_logits = logits.detach().float().requires_grad_(True)
    ref_logp_all = torch.log_softmax(ref_logits / 0.7, dim=-1)
    ref_logprobs = ref_logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(ref_logp_all.exp() * ref_logp_all).sum(-1)
    torch.testing.assert_close(logprobs, ref_logprobs)
    torch.testing.assert_close(entropy, ref_entropy.detach())
    assert not entropy.requires_grad

    weights = torch.randn(2, 5)
    (logprobs * weights).sum().backward()
    (ref_logprobs * weights).sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, atol=1e-2, rtol=1e-2)


def _loss_case():
    """Seven tokens, delta_low = delta_high = 0.2; see the per-token comments."""
    p = [0.5, 0.9, 0.2, 0.6, 0.9, 0.2, 0.3]  # trainer probabilities
    q = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0]  # inference probabilities (last: padding, logprob 0)
    adv = [1.0, 2.0, -1.0, -1.0, -1.0, 1.0, 0.0]
    mask = [True, True, True, True, True, True, False]
    # 0: p = q, A > 0                    -> kept
    # 1: p - q = +0.4 > 0.2, A > 0       -> masked (pushed further up)
    # 2: p - q = -0.3 < -0.2, A < 0      -> masked (pushed further down)
    # 3: p - q = +0.1, A < 0             -> kept
    # 4: p - q = +0.4, A < 0             -> kept (update pulls it back)
    # 5: p - q = -0.3, A > 0             -> kept (update pulls it back)
    # 6: not a loss token
    logprobs = torch.tensor([[LN(x) for x in p]], requires_grad=True)
    inference = torch.tensor([[LN(x) for x in q]])
    return p, q, adv, logprobs, inference, torch.tensor([adv]), torch.tensor([mask])


def test_dppo_loss_value_gradient_and_stats_by_hand():
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    kl_coef, n = 0.1, 10
    loss, stats = dppo_loss(
        logprobs, inference, advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=kl_coef, num_loss_tokens=n
    )
    ratios = [p[i] / q[i] for i in range(6)]  # 1, 1.8, 0.4, 1.2, 1.8, 0.4
    kept = [0, 3, 4, 5]
    pg = [-ratios[i] * adv[i] for i in kept]  # -1, 1.2, 1.8, -0.4
    kl = [kl_coef * 0.5 * LN(r) ** 2 for r in ratios]
    expected_loss = (sum(pg) + sum(kl)) / n
    torch.testing.assert_close(loss, torch.tensor(expected_loss))

    loss.backward()
    # d/dlogp of -ratio*A is -ratio*A; of c/2 * (logp - logq)^2 is c * ln(ratio).
    expected_grad = [0.0] * 7
    for i in range(6):
        expected_grad[i] = (kl_coef * LN(ratios[i]) + (-ratios[i] * adv[i] if i in kept else 0.0)) / n
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected_grad]))

    assert stats["loss_tokens"].item() == 6
    assert stats["masked_tokens"].item() == 2
    torch.testing.assert_close(stats["ratio_sum"], torch.tensor(sum(ratios)))
    torch.testing.assert_close(stats["pg_loss_sum"], torch.tensor(sum(pg)))
    torch.testing.assert_close(stats["kl_loss_sum"], torch.tensor(sum(kl)))
    k3 = sum(r - LN(r) - 1 for r in ratios)
    torch.testing.assert_close(stats["mismatch_kl_sum"], torch.tensor(k3))
    assert all(not s.requires_grad for s in stats.values())


def test_dppo_loss_masked_token_keeps_only_kl_gradient():
    # Token 1 of the case is masked: its gradient is the KL part alone, c * ln(1.8) / n.
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    loss, _ = dppo_loss(
        logprobs, inference, advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=0.5, num_loss_tokens=4
    )
    loss.backward()
    torch.testing.assert_close(logprobs.grad[0, 1], torch.tensor(0.5 * LN(1.8) / 4))
    torch.testing.assert_close(logprobs.grad[0, 2], torch.tensor(0.5 * LN(0.4) / 4))
    assert logprobs.grad[0, 6].item() == 0.0


def test_dppo_loss_wide_trust_region_keeps_everything():
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = dppo_loss(
        logprobs, inference, advantages, mask, delta_low=1.0, delta_high=1.0, kl_coef=0.0, num_loss_tokens=6
    )
    assert stats["masked_tokens"].item() == 0
    expected = sum(-(p[i] / q[i]) * adv[i] for i in range(6)) / 6  # -1 - 3.6 + 0.4 + 1.2 + 1.8 - 0.4
    torch.testing.assert_close(loss, torch.tensor(expected))


def test_dppo_loss_on_policy_is_minus_mean_advantage():
    # ratio 1 everywhere and no KL: loss = -sum(A) / n, gradient -A / n.
    logprobs = torch.log(torch.tensor([[0.3, 0.6, 0.1]])).requires_grad_(True)
    advantages = torch.tensor([[0.5, -1.5, 2.0]])
    mask = torch.tensor([[True, True, True]])
    loss, stats = dppo_loss(
        logprobs, logprobs.detach(), advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=1.0, num_loss_tokens=5
    )
    torch.testing.assert_close(loss, torch.tensor(-(0.5 - 1.5 + 2.0) / 5))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 / 5, 1.5 / 5, -2.0 / 5]]))
    assert stats["mismatch_kl_sum"].item() == 0.0
    assert stats["kl_loss_sum"].item() == 0.0


def test_dppo_loss_micro_batch_losses_sum_to_global_mean():
    # Splitting tokens over micro-batches with the global count gives the same total as one batch.
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    kwargs = dict(delta_low=0.2, delta_high=0.2, kl_coef=0.1, num_loss_tokens=6)
    whole, _ = dppo_loss(logprobs, inference, advantages, mask, **kwargs)
    first, _ = dppo_loss(logprobs[:, :3], inference[:, :3], advantages[:, :3], mask[:, :3], **kwargs)
    second, _ = dppo_loss(logprobs[:, 3:], inference[:, 3:], advantages[:, 3:], mask[:, 3:], **kwargs)
    torch.testing.assert_close(first + second, whole)


def test_dppo_loss_rejects_bad_arguments():
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    good = dict(delta_low=0.2, delta_high=0.2, kl_coef=0.0, num_loss_tokens=1)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        dppo_loss(logprobs, inference, advantages, mask, **{**good, "num_loss_tokens": 0})
    with pytest.raises(ValueError, match="delta_low"):
        dppo_loss(logprobs, inference, advantages, mask, **{**good, "delta_low": -0.1})


def test_sft_loss_by_hand():
    logprobs = torch.tensor([[LN(0.5), LN(0.25), LN(0.1)]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss = sft_loss(logprobs, mask, num_loss_tokens=4)
    torch.testing.assert_close(loss, torch.tensor((LN(2) + LN(4)) / 4))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25, 0.0]]))


# ----------------------------------------------------------------------------- advantages and filters


def test_advantage_types_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5]])  # mean 0.5; unbiased std sqrt(0.5 / 3)
    std = math.sqrt(0.5 / 3)
    torch.testing.assert_close(group_advantages(rewards, "grpo"), torch.tensor([[0.5, -0.5, 0.0, 0.0]]))
    torch.testing.assert_close(group_advantages(rewards, "drgrpo"), torch.tensor([[0.5, -0.5, 0.0, 0.0]]))
    torch.testing.assert_close(group_advantages(rewards, "grpo_std"),
                               torch.tensor([[0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0]]))
    # leave-one-out: 1 - mean(0, .5, .5), 0 - mean(1, .5, .5), .5 - mean(1, 0, .5), ...
    torch.testing.assert_close(group_advantages(rewards, "rloo"), torch.tensor([[2 / 3, -2 / 3, 0.0, 0.0]]))


def test_grpo_std_of_a_flat_group_is_zero_and_unknown_type_refused():
    torch.testing.assert_close(group_advantages(torch.tensor([[0.3, 0.3]]), "grpo_std"), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="unknown advantage type"):
        group_advantages(torch.tensor([[0.0, 1.0]]), "ppo")
    with pytest.raises(ValueError, match=">= 2 samples"):
        group_advantages(torch.tensor([[1.0]]), "rloo")


def test_length_penalty_by_hand():
    shaped = length_penalized(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([4, 8, 2]), coef=0.5, max_tokens=8)
    torch.testing.assert_close(shaped, torch.tensor([1.0 - 0.25, 1.0 - 0.5, 0.5 - 0.125]))
    with pytest.raises(ValueError, match="coef"):
        length_penalized(torch.tensor([1.0]), torch.tensor([1]), coef=-1.0, max_tokens=8)


def test_filter_reasons():
    band = dict(pass_threshold=1.0, min_pass_rate=0.2, max_pass_rate=0.7)
    assert filter_reason(torch.tensor([1.0]), **band) == "too_few"
    assert filter_reason(torch.tensor([0.4, 0.4, 0.4]), **band) == "flat"
    assert filter_reason(torch.tensor([0.0, 0.5, 0.9, 0.9, 0.9]), **band) == "too_hard"  # pass rate 0 < 0.2
    assert filter_reason(torch.tensor([1.0, 1.0, 1.0, 0.5]), **band) == "too_easy"  # 0.75 > 0.7
    assert filter_reason(torch.tensor([1.0, 0.0, 0.5]), **band) is None  # 1/3 in the band
    # a length penalty gives a group of equal rewards a signal: flat is judged on the shaped rewards
    flat_rewards = torch.tensor([1.0, 1.0])
    assert filter_reason(flat_rewards, shaped=torch.tensor([0.9, 0.7]), pass_threshold=1.0, min_pass_rate=0.0,
                         max_pass_rate=1.0) is None


# ----------------------------------------------------------------------------- the other losses


def _grad(loss, logprobs):
    loss.backward()
    return logprobs.grad[0].tolist()


def test_dppo_default_is_prime_rl_default_loss():
    # prime-rl's default: sum of -keep * A * ratio + kl_tau * d^2 over loss tokens / N, kl_tau = 1e-3; ours with
    # kl_coef = 2 * kl_tau (the LossConfig default) is the same per-token terms
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    loss, _ = dppo_loss(logprobs, inference, advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=2e-3,
                        num_loss_tokens=6)
    d = (logprobs - inference).detach() * mask
    diff = torch.exp(logprobs.detach()) - torch.exp(inference)
    drop = torch.where(advantages > 0, diff > 0.2, diff < -0.2)
    reference = (-((mask & ~drop) * advantages * torch.exp(d)) + 1e-3 * (mask * d ** 2)).sum() / 6
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-7, atol=0)


def test_aipo_truncates_the_weight_and_keeps_the_gradient():
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = aipo_loss(logprobs, inference, advantages, mask, ratio_cap=1.5, kl_coef=0.0, num_loss_tokens=6)
    weight = [1.0, 1.5, 0.4, 1.2, 1.5, 0.4]  # min(ratio, 1.5); ratios 1, 1.8, 0.4, 1.2, 1.8, 0.4
    torch.testing.assert_close(loss, torch.tensor(sum(-w * a for w, a in zip(weight, adv)) / 6))
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)),
                               torch.tensor([-w * a / 6 for w, a in zip(weight, adv)] + [0.0]))
    assert stats["clipped_tokens"].item() == 2 and stats["masked_tokens"].item() == 0


def test_ppo_clip_by_hand():
    _, _, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = ppo_clip_loss(logprobs, inference, advantages, mask, clip_low=0.3, clip_high=0.5, kl_coef=0.0,
                                num_loss_tokens=6)
    # ratios 1, 1.8, 0.4, 1.2, 1.8, 0.4 in [0.7, 1.5]: token 1 (A > 0, ratio > 1.5) and token 2 (A < 0,
    # ratio < 0.7) take the clipped branch (constant: no gradient); 4 (A < 0) and 5 (A > 0) are pulled back
    terms = [-1.0, -1.5 * 2, -0.7 * -1, -1.2 * -1, -1.8 * -1, -0.4 * 1]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 6))
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)),
                               torch.tensor([-1.0 / 6, 0.0, 0.0, 1.2 / 6, 1.8 / 6, -0.4 / 6, 0.0]))
    assert stats["masked_tokens"].item() == 2 and stats["clipped_tokens"].item() == 0


def test_cispo_clips_the_weight_and_drops_no_token():
    _, _, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = cispo_loss(logprobs, inference, advantages, mask, clip_low=0.3, clip_high=0.5, kl_coef=0.0,
                             num_loss_tokens=6)
    weight = [1.0, 1.5, 0.7, 1.2, 1.5, 0.7]  # clip(ratio, 0.7, 1.5)
    torch.testing.assert_close(loss, torch.tensor(sum(-w * a for w, a in zip(weight, adv)) / 6))
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)),
                               torch.tensor([-w * a / 6 for w, a in zip(weight, adv)] + [0.0]))
    assert stats["clipped_tokens"].item() == 4 and stats["masked_tokens"].item() == 0


def _sample_ids():
    return torch.tensor([[0, 0, 0, 1, 1, 1, 1]])  # two samples; the last position is not a loss token


def test_gspo_clips_whole_samples_on_the_sequence_ratio():
    _, _, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = gspo_loss(logprobs, inference, advantages, mask, clip_low=0.1, clip_high=0.1, kl_coef=0.0,
                            num_loss_tokens=6, sample_ids=_sample_ids())
    s0, s1 = (1.0 * 1.8 * 0.4) ** (1 / 3), (1.2 * 1.8 * 0.4) ** (1 / 3)  # geometric means: 0.896, 0.952
    # sample 0's ratio is below 0.9: its negative-advantage token 2 is clipped (0.9 * A, no gradient)
    terms = [-s0 * 1, -s0 * 2, -0.9 * -1, -s1 * -1, -s1 * -1, -s1 * 1]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 6))
    grad = [-s0 * 1, -s0 * 2, 0.0, s1, s1, -s1, 0.0]
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)), torch.tensor([g / 6 for g in grad]))
    assert stats["masked_tokens"].item() == 1
    with pytest.raises(ValueError, match="sample_ids"):
        gspo_loss(logprobs, inference, advantages, mask, clip_low=0.1, clip_high=0.1, kl_coef=0.0, num_loss_tokens=6)


LOSS_PARAMS = {"dppo": dict(delta_low=0.2, delta_high=0.2), "aipo": dict(ratio_cap=8.0),
               "ppo_clip": dict(clip_low=0.2, clip_high=0.2), "gspo": dict(clip_low=3e-4, clip_high=4e-4),
               "cispo": dict(clip_low=1.0, clip_high=0.28)}


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_every_loss_on_policy_is_minus_mean_advantage(kind):
    # ratio 1: every loss is the plain policy gradient -A * grad log p / N, the KL term is 0
    logprobs = torch.log(torch.tensor([[0.3, 0.6, 0.1, 0.5]])).requires_grad_(True)
    advantages = torch.tensor([[0.5, -1.5, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = POLICY_LOSSES[kind](logprobs, logprobs.detach(), advantages, mask, kl_coef=1.0, num_loss_tokens=5,
                                      sample_ids=torch.tensor([[0, 0, 1, 1]]), **LOSS_PARAMS[kind])
    torch.testing.assert_close(loss, torch.tensor(-(0.5 - 1.5 + 2.0) / 5))
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)), torch.tensor([-0.5 / 5, 1.5 / 5, -2.0 / 5, 0.0]))
    assert stats["mismatch_kl_sum"].item() == 0.0 and stats["masked_tokens"].item() == 0


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_every_loss_sums_over_micro_batches_to_the_global_mean(kind):
    # split at the sample boundary (gspo needs whole samples; packing never splits one)
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    ids = _sample_ids()
    kw = dict(kl_coef=0.1, num_loss_tokens=6, **LOSS_PARAMS[kind])
    whole, _ = POLICY_LOSSES[kind](logprobs, inference, advantages, mask, sample_ids=ids, **kw)
    parts = [POLICY_LOSSES[kind](logprobs[:, sl], inference[:, sl], advantages[:, sl], mask[:, sl],
                                 sample_ids=ids[:, sl], **kw)[0] for sl in (slice(0, 3), slice(3, 7))]
    torch.testing.assert_close(parts[0] + parts[1], whole)


# ----------------------------------------------------------------------------- corrections


def test_token_level_corrections_by_hand():
    _, _, _, logprobs, inference, _, mask = _loss_case()  # ratios 1, 1.8, 0.4, 1.2, 1.8, 0.4 (+ padding)
    kw = dict(level="token", low=0.5, high=1.5)
    w, touched = correction_weights(logprobs, inference, mask, _sample_ids(), kind="tis", **kw)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.5 / 1.8, 1.0, 1.0, 1.5 / 1.8, 1.0, 1.0]]))
    assert touched.tolist() == [[False, True, False, False, True, False, False]]
    w, touched = correction_weights(logprobs, inference, mask, _sample_ids(), kind="mis", **kw)
    assert w.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]] and touched.sum() == 2
    w, touched = correction_weights(logprobs, inference, mask, _sample_ids(), kind="icepop", **kw)
    assert w.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]] and touched.sum() == 4
    assert not w.requires_grad


def test_sequence_level_corrections_by_hand():
    # sample 0: ratios 2, 2 (product 4); sample 1: 0.5, 1 (product 0.5); the last token is padding
    inference = torch.log(torch.tensor([[0.25, 0.25, 0.5, 0.5, 0.5]]))
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.25, 0.5, 0.5]]))
    mask = torch.tensor([[True, True, True, True, False]])
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    w, touched = correction_weights(logprobs, inference, mask, ids, kind="tis", level="sequence", low=0.0, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 1.0, 1.0, 1.0]]))  # sample 0: min(4, 2) / 4
    assert touched.tolist() == [[True, True, False, False, False]]
    w, _ = correction_weights(logprobs, inference, mask, ids, kind="mis", level="sequence", low=0.0, high=2.0)
    assert w.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]
    w, touched = correction_weights(logprobs, inference, mask, ids, kind="icepop", level="sequence", low=0.6,
                                    high=2.0)
    assert w.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]] and touched.sum() == 4  # 4 > 2 and 0.5 < 0.6
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        correction_weights(logprobs, inference, mask, ids, kind="tis", level="token", low=0.0, high=0.5)


def test_correction_weights_scale_the_policy_gradient_terms_only():
    # mis drops tokens 1 and 4 (ratio 1.8 > 1.5): their PG terms and gradients go, the KL terms stay
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    w, _ = correction_weights(logprobs, inference, mask, _sample_ids(), kind="mis", level="token", low=0.0, high=1.5)
    loss, stats = cispo_loss(logprobs, inference, advantages, mask, clip_low=1.0, clip_high=10.0, kl_coef=0.1,
                             num_loss_tokens=6, weights=w)
    ratios = [p[i] / q[i] for i in range(6)]
    kept = [0, 2, 3, 5]
    pg = sum(-ratios[i] * adv[i] for i in kept)
    kl = sum(0.1 * 0.5 * LN(r) ** 2 for r in ratios)
    torch.testing.assert_close(loss, torch.tensor((pg + kl) / 6))
    grad = [((-ratios[i] * adv[i] if i in kept else 0.0) + 0.1 * LN(ratios[i])) / 6 for i in range(6)] + [0.0]
    torch.testing.assert_close(torch.tensor(_grad(loss, logprobs)), torch.tensor(grad))


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_trainer_dispatches_the_configured_loss_and_correction(kind):
    from tensordict import TensorDict

    from meshrl.runtime.config import LossConfig
    from meshrl.runtime.train.trainer import policy_loss

    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    mb = TensorDict({"loss_mask": mask, "inference_logprobs": inference, "advantages": advantages,
                     "sample_ids": _sample_ids()}, batch_size=[1, 7])
    cfg = LossConfig(type=kind, kl_coef=0.1, correction="tis", correction_high=1.5)
    value, stats = policy_loss(mb, logprobs, cfg, num_loss_tokens=6)
    w, touched = correction_weights(logprobs, inference, mask, _sample_ids(), kind="tis", level="token", low=0.0,
                                    high=1.5)
    expected, _ = POLICY_LOSSES[kind](logprobs, inference, advantages, mask, kl_coef=0.1, num_loss_tokens=6,
                                      weights=w, sample_ids=_sample_ids(), **cfg.params)
    torch.testing.assert_close(value, expected)
    assert stats["corrected_tokens"].item() == touched.sum().item() == 2
