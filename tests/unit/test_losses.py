"""Advantages and losses against hand-computed values."""

import math

import pytest
import torch

from meshrl.runtime.train.losses import group_advantages, policy_loss, sft_loss, token_logprobs

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


def test_policy_loss_value_gradient_and_stats_by_hand():
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    kl_coef, n = 0.1, 10
    loss, stats = policy_loss(
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


def test_policy_loss_masked_token_keeps_only_kl_gradient():
    # Token 1 of the case is masked: its gradient is the KL part alone, c * ln(1.8) / n.
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    loss, _ = policy_loss(
        logprobs, inference, advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=0.5, num_loss_tokens=4
    )
    loss.backward()
    torch.testing.assert_close(logprobs.grad[0, 1], torch.tensor(0.5 * LN(1.8) / 4))
    torch.testing.assert_close(logprobs.grad[0, 2], torch.tensor(0.5 * LN(0.4) / 4))
    assert logprobs.grad[0, 6].item() == 0.0


def test_policy_loss_wide_trust_region_keeps_everything():
    p, q, adv, logprobs, inference, advantages, mask = _loss_case()
    loss, stats = policy_loss(
        logprobs, inference, advantages, mask, delta_low=1.0, delta_high=1.0, kl_coef=0.0, num_loss_tokens=6
    )
    assert stats["masked_tokens"].item() == 0
    expected = sum(-(p[i] / q[i]) * adv[i] for i in range(6)) / 6  # -1 - 3.6 + 0.4 + 1.2 + 1.8 - 0.4
    torch.testing.assert_close(loss, torch.tensor(expected))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    # ratio 1 everywhere and no KL: loss = -sum(A) / n, gradient -A / n.
    logprobs = torch.log(torch.tensor([[0.3, 0.6, 0.1]])).requires_grad_(True)
    advantages = torch.tensor([[0.5, -1.5, 2.0]])
    mask = torch.tensor([[True, True, True]])
    loss, stats = policy_loss(
        logprobs, logprobs.detach(), advantages, mask, delta_low=0.2, delta_high=0.2, kl_coef=1.0, num_loss_tokens=5
    )
    torch.testing.assert_close(loss, torch.tensor(-(0.5 - 1.5 + 2.0) / 5))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 / 5, 1.5 / 5, -2.0 / 5]]))
    assert stats["mismatch_kl_sum"].item() == 0.0
    assert stats["kl_loss_sum"].item() == 0.0


def test_policy_loss_micro_batch_losses_sum_to_global_mean():
    # Splitting tokens over micro-batches with the global count gives the same total as one batch.
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    kwargs = dict(delta_low=0.2, delta_high=0.2, kl_coef=0.1, num_loss_tokens=6)
    whole, _ = policy_loss(logprobs, inference, advantages, mask, **kwargs)
    first, _ = policy_loss(logprobs[:, :3], inference[:, :3], advantages[:, :3], mask[:, :3], **kwargs)
    second, _ = policy_loss(logprobs[:, 3:], inference[:, 3:], advantages[:, 3:], mask[:, 3:], **kwargs)
    torch.testing.assert_close(first + second, whole)


def test_policy_loss_rejects_bad_arguments():
    _, _, _, logprobs, inference, advantages, mask = _loss_case()
    good = dict(delta_low=0.2, delta_high=0.2, kl_coef=0.0, num_loss_tokens=1)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        policy_loss(logprobs, inference, advantages, mask, **{**good, "num_loss_tokens": 0})
    with pytest.raises(ValueError, match="delta_low"):
        policy_loss(logprobs, inference, advantages, mask, **{**good, "delta_low": -0.1})


def test_sft_loss_by_hand():
    logprobs = torch.tensor([[LN(0.5), LN(0.25), LN(0.1)]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss = sft_loss(logprobs, mask, num_loss_tokens=4)
    torch.testing.assert_close(loss, torch.tensor((LN(2) + LN(4)) / 4))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25, 0.0]]))
