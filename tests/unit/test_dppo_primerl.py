"""Our `dppo` loss against prime-rl's default loss, on shared inputs.

The reference below is prime-rl's ``default_loss_fn`` + ``compute_loss`` (src/prime_rl/trainer/rl/loss.py,
read at commit 559b447 of PrimeIntellect-ai/prime-rl, 2026-08-21) written from its formula, not
copied. Per sample, with ``d = trainer - inference`` logprob, ``ratio = exp(d)``, ``Δp = p - q``:

    invalid_t = (Δp_t > dppo_mask_high)  if A_t > 0  else  (Δp_t < -dppo_mask_low)
    keep_t    = loss_mask_t and not invalid_t
    term_t    = -(keep_t * adv_tau * A_t * ratio_t) + kl_tau * loss_mask_t * d_t**2
    loss      = (sum over samples of sum_t term_t) / rl_scale      (rl_scale: the step's loss tokens)

with their defaults dppo_mask_low = dppo_mask_high = 0.2, adv_tau = 1, kl_tau = 1e-3. Ours with
delta_low = delta_high = 0.2 and kl_coef = 2 * kl_tau (our default 2e-3) computes the same terms.

What is bit for bit, and what is not: every per-token term and every per-token gradient are
equal to the last bit; the whole loss sums the same terms in another order (theirs per sample,
ours per micro-batch with the PG and KL sums apart), so it agrees to float32 summation rounding.
Their `is_masked` metric also counts zero-advantage tokens whose probability fell by more than
dppo_mask_low (their `where` picks the low bound when A <= 0); our `masked_tokens` counts only
tokens whose term was dropped with a nonzero advantage. Their ``loss_weights`` (per-component token
weights, not a mismatch correction) also scale the KL term; ours (`weights`, the corrections) never
do: with no weights, the case compared here, both are the same.
"""

import torch

from meshrl.runtime.config import LossConfig
from meshrl.runtime.train.losses import dppo_loss

PRIME_RL_DEFAULTS = dict(dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3)


def _prime_rl_sample_terms(trainer_lp, inference_lp, advantages, loss_mask, *, dppo_mask_low, dppo_mask_high,
                           adv_tau, kl_tau):
    """(seq,) per-token terms of one sample, prime-rl's formula (module docstring)."""
    d = trainer_lp - inference_lp
    ratio = torch.exp(d)
    prob_diff = torch.exp(trainer_lp) - torch.exp(inference_lp)
    invalid = torch.where(advantages > 0, prob_diff > dppo_mask_high, prob_diff < -dppo_mask_low)
    keep = loss_mask & ~invalid
    return -(keep * (adv_tau * advantages) * ratio) + kl_tau * (loss_mask * d ** 2), invalid


def _prime_rl_loss(samples, rl_scale, **params):
    """prime-rl's packed loss: per-sample sums added up, divided by the global loss-token count."""
    total = samples[0][0].sum() * 0.0
    for trainer_lp, inference_lp, advantages, loss_mask in samples:
        terms, _ = _prime_rl_sample_terms(trainer_lp, inference_lp, advantages, loss_mask, **params)
        total = total + terms.sum()
    return total / rl_scale


def _case():
    """Three samples (prompt tokens unmasked) packed in two rows of 12, with ratios far enough from 1
    that the trust region drops tokens both ways, and one zero-advantage sample."""
    g = torch.Generator().manual_seed(0)
    lengths, prompts, advantages = (7, 5, 9), (2, 1, 3), (0.75, -0.4375, 0.0)
    rows = ([0, 1], [2])  # samples 0 and 1 share row 0; sample 2 is alone in row 1, then padding
    width = 12
    probs = torch.rand(sum(lengths), generator=g) * 0.9 + 0.05
    moved = (probs + (torch.rand(sum(lengths), generator=g) - 0.5) * 0.8).clamp(0.02, 0.99)
    trainer_all, inference_all = torch.log(moved), torch.log(probs)  # (sum lengths,)
    samples, start = [], 0
    for length, prompt, adv in zip(lengths, prompts, advantages):
        mask = torch.arange(length) >= prompt
        samples.append((trainer_all[start:start + length], inference_all[start:start + length],
                        torch.full((length,), adv), mask))
        start += length
    shape = (len(rows), width)
    packed = {k: torch.zeros(shape) for k in ("trainer", "inference", "advantages")}
    packed["mask"] = torch.zeros(shape, dtype=torch.bool)
    packed["sample_ids"] = torch.full(shape, -1)
    where = []  # (row, column) of each sample's first token
    for r, members in enumerate(rows):
        col = 0
        for s in members:
            tl, il, adv, mask = samples[s]
            n = tl.numel()
            for key, value in zip(("trainer", "inference", "advantages", "mask"), (tl, il, adv, mask)):
                packed[key][r, col:col + n] = value
            packed["sample_ids"][r, col:col + n] = s
            where.append((r, col))
            col += n
    return samples, packed, where


def _ours(packed, mask, num_loss_tokens):
    logprobs = packed["trainer"].clone().requires_grad_(True)
    loss, stats = dppo_loss(logprobs, packed["inference"], packed["advantages"], mask, delta_low=0.2,
                            delta_high=0.2, kl_coef=LossConfig().kl_coef, num_loss_tokens=num_loss_tokens,
                            sample_ids=packed["sample_ids"])
    return logprobs, loss, stats


def test_defaults_map_to_prime_rl_defaults():
    cfg = LossConfig()
    assert cfg.type == "dppo" and cfg.correction == "none"
    assert (cfg.delta_low, cfg.delta_high) == (PRIME_RL_DEFAULTS["dppo_mask_low"], PRIME_RL_DEFAULTS["dppo_mask_high"])
    assert cfg.kl_coef * 0.5 == PRIME_RL_DEFAULTS["kl_tau"]  # exact in binary floating point


def test_dppo_per_token_terms_equal_prime_rl_bit_for_bit():
    samples, packed, where = _case()
    checked = dropped = 0
    for s, (r, col) in enumerate(where):
        tl, il, adv, mask = samples[s]
        terms, invalid = _prime_rl_sample_terms(tl, il, adv, mask, **PRIME_RL_DEFAULTS)
        for t in range(tl.numel()):
            if not mask[t]:
                continue
            one = torch.zeros_like(packed["mask"])
            one[r, col + t] = True
            _, loss, _ = _ours(packed, one, num_loss_tokens=1)
            assert loss.item() == terms[t].item(), (s, t, loss.item(), terms[t].item())  # bit for bit
            checked += 1
            dropped += bool(invalid[t] and adv[t] != 0)
    assert checked == int(packed["mask"].sum()) == 15
    assert dropped >= 2  # the trust region acted on this case, so the drop rule is compared too


def test_dppo_gradients_equal_prime_rl_bit_for_bit():
    samples, packed, where = _case()
    n = int(packed["mask"].sum())
    logprobs, loss, stats = _ours(packed, packed["mask"], num_loss_tokens=n)
    loss.backward()
    ref_inputs = [(tl.clone().requires_grad_(True), il, adv, mask) for tl, il, adv, mask in samples]
    reference = _prime_rl_loss(ref_inputs, n, **PRIME_RL_DEFAULTS)
    reference.backward()
    for (r, col), (tl, _, _, _) in zip(where, ref_inputs):
        assert torch.equal(logprobs.grad[r, col:col + tl.numel()], tl.grad)
    # padding gets no gradient
    assert torch.equal(logprobs.grad[~(packed["sample_ids"] >= 0)], torch.zeros(int((packed["sample_ids"] < 0).sum())))
    # the whole loss: the same terms summed in another order
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=4 * torch.finfo(torch.float32).eps, atol=0)

    # masked tokens: theirs minus the zero-advantage ones (module docstring)
    theirs = 0
    for tl, il, adv, mask in samples:
        _, invalid = _prime_rl_sample_terms(tl, il, adv, mask, **PRIME_RL_DEFAULTS)
        theirs += int((mask & invalid & (adv != 0)).sum())
    assert stats["masked_tokens"].item() == theirs > 0
