"""Advantages and losses: pure functions of tensors.

Everything here takes and returns tensors (plus plain keyword numbers) so that it can be
tested against hand-computed values and reused by any trainer loop. Shapes: ``N`` prompts,
``G`` samples per prompt, ``B`` rows, ``T`` tokens per row, ``V`` vocabulary size.

Loss normalisation (used by `policy_loss` and `sft_loss`)
---------------------------------------------------------
A training step sees many micro-batches on each of ``dp`` data-parallel ranks. Every loss
here is ``sum over this micro-batch's loss tokens / num_loss_tokens`` where
``num_loss_tokens`` is the loss-token count of the WHOLE step: all ranks, all micro-batches.
The trainer (runtime/train/trainer.py) then

1. calls ``backward()`` on each micro-batch loss and lets gradients accumulate (a plain
   sum over micro-batches), and
2. SUMS gradients over the data-parallel ranks: FSDP2's divide factor is 1 and its
   reductions are forced to SUM (parallel/parallelize.py), so no loss is rescaled by ``dp``.

The resulting gradient is exactly the gradient of the per-token mean over the global batch,
independent of how tokens were split over ranks and micro-batches (and over expert-parallel
shards, which a mean reduction could not express).

Policy losses (`POLICY_LOSSES`, chosen by ``trainer.loss.type``; docs/algorithms.md has the
formulas side by side). Each is a sum of per-token policy-gradient terms plus the KL penalty
``kl_coef * 0.5 * d**2`` (``d = logprobs - inference_logprobs``), divided by ``num_loss_tokens``.
There is one optimizer step per batch, so the trainer's logprobs at the forward are those of the
weights the step starts from: the ratio ``r = exp(d)`` is the one between that policy and the
engine's (numerics mismatch, plus the policy lag of asynchronous steps), and its gradient is
``r * grad(logprobs)``. ``weights``, when given, multiplies every policy-gradient term (a
trainer/engine mismatch correction, `correction_weights`); the KL term is never weighted.

Sequence-level quantities (``gspo``, ``level="sequence"`` corrections) need the loss tokens of
every sample together: ``sample_ids`` (B, T) names each token's sample (runtime/train/packing.py
never splits a sample over rows, ranks or micro-batches; context parallelism would, and
runtime/config.py refuses the combination).
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_TYPES", "CORRECTIONS", "DROP_REASONS", "POLICY_LOSSES", "aipo_loss", "cispo_loss", "correction_weights",
           "dppo_loss", "filter_reason", "group_advantages", "gspo_loss", "length_penalized", "ppo_clip_loss",
           "sft_loss", "token_logprobs"]

ADVANTAGE_TYPES = ("grpo", "grpo_std", "drgrpo", "rloo")
CORRECTIONS = ("none", "tis", "mis", "icepop")
DROP_REASONS = ("too_few", "flat", "too_hard", "too_easy")
"""Why `filter_reason` drops a group; the controller logs each as batch/groups_dropped_<reason>."""


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, kind: str = "grpo", std_eps: float = 1e-6) -> Tensor:
    """Group-relative advantages of G samples per prompt.

    - ``grpo`` and ``drgrpo``: ``r - mean(r)`` (no std normalisation; Dr.GRPO differs from
      grpo only in the loss normaliser, which the controller sets: runtime/rollout/controller.py);
    - ``grpo_std``: ``(r - mean(r)) / (std(r) + std_eps)`` with the unbiased std (GRPO as published);
    - ``rloo``: ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r))`` (leave-one-out baseline).

    Args:
        rewards: (N, G) rewards of G >= 2 samples for each of N prompts.

    Returns:
        (N, G) fp32 advantages; each row sums to zero.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_prompts, group_size), got shape {tuple(rewards.shape)}")
    if kind not in ADVANTAGE_TYPES:
        raise ValueError(f"unknown advantage type {kind!r}; known: {ADVANTAGE_TYPES}")
    group_size = rewards.shape[1]
    if kind in ("grpo_std", "rloo") and group_size < 2:
        raise ValueError(f"advantage type {kind!r} needs groups of >= 2 samples, got {group_size}")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if kind == "grpo_std":
        return centred / (rewards.std(dim=1, keepdim=True) + std_eps)
    if kind == "rloo":
        return centred * (group_size / (group_size - 1))
    return centred


def length_penalized(rewards: Tensor, num_tokens: Tensor, coef: float, max_tokens: int) -> Tensor:
    """``rewards - coef * num_tokens / max_tokens``: a linear penalty on sampled length, applied
    before advantages (``advantage.length_penalty``). Shapes: any, equal; returns fp32."""
    if coef < 0 or max_tokens < 1:
        raise ValueError(f"need coef >= 0 and max_tokens >= 1, got coef={coef}, max_tokens={max_tokens}")
    return rewards.float() - coef * num_tokens.float() / max_tokens


def filter_reason(rewards: Tensor, *, shaped: Tensor | None = None, pass_threshold: float, min_pass_rate: float,
                  max_pass_rate: float) -> str | None:
    """Why a group is dropped (one of `DROP_REASONS`), or None to train on it.

    In this order: ``"too_few"`` (fewer than 2 samples), ``"flat"`` (every shaped reward equal: zero
    advantage everywhere, no signal), ``"too_hard"`` (pass rate < ``min_pass_rate``), ``"too_easy"``
    (pass rate > ``max_pass_rate``), where the pass rate is the share of ``rewards`` >= ``pass_threshold``.

    Args:
        rewards: (G,) the group's environment rewards.
        shaped: (G,) the rewards advantages are computed from (after a length penalty); default ``rewards``.
    """
    shaped = rewards if shaped is None else shaped
    if rewards.numel() < 2:
        return "too_few"
    if float(shaped.max() - shaped.min()) < 1e-6:
        return "flat"
    pass_rate = float((rewards >= pass_threshold).float().mean())
    if pass_rate < min_pass_rate:
        return "too_hard"
    if pass_rate > max_pass_rate:
        return "too_easy"
    return None


# ----------------------------------------------------------------------------- logprobs


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probabilities of ``targets`` and entropy under the tempered distribution.

    The logits are divided by ``temperature`` (the sampling temperature of the inference
    engine, so trainer and inference score the same distribution) and normalised in fp32.
    ``log p(target) = logit[target] - logsumexp(logits)``: only one fp32 (B, T, V) tensor
    (the tempered logits) is kept alive for backward; no full log_softmax output is
    materialised next to it.

    Args:
        logits: (B, T, V) any float dtype.
        targets: (B, T) int64 token ids.
        temperature: > 0.

    Returns:
        logprobs: (B, T) fp32, differentiable w.r.t. ``logits``.
        entropy: (B, T) fp32, detached (a metric, not a loss term).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature  # (B, T, V) fp32; the bf16->fp32 temporary dies here
    lse = torch.logsumexp(scaled, dim=-1)  # (B, T)
    target_logits = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    logprobs = target_logits - lse  # (B, T)
    entropy = _entropy(scaled.detach(), lse.detach())
    return logprobs, entropy


@torch.no_grad()
def _entropy(scaled: Tensor, lse: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v, with one (B, T, V) temporary, reused in place."""
    weighted = torch.softmax(scaled, dim=-1).mul_(scaled)  # (B, T, V)
    return lse - weighted.sum(dim=-1)  # (B, T)


# ----------------------------------------------------------------------------- policy losses


def dppo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
              delta_low: float, delta_high: float, kl_coef: float, num_loss_tokens: int,
              weights: Tensor | None = None, sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-weighted policy gradient with a binary trust region (DPPO) and a KL penalty.

    Per loss token, with ``d = logprobs - inference_logprobs`` (trainer minus inference),
    ``ratio = exp(d)``, ``p = exp(logprobs)``, ``q = exp(inference_logprobs)``:

    - policy-gradient term ``-ratio * A`` (gradient ``-ratio * A * grad log p``): corrects
      for the inference policy having sampled the token;
    - the PG term is dropped (trust region, Binary-TV variant of "Rethinking the Trust
      Region in LLM RL") when the token's probability already moved too far in the direction
      the update pushes it: ``A > 0 and p - q > delta_high`` or ``A < 0 and p - q < -delta_low``;
    - KL penalty ``kl_coef * 0.5 * d**2`` on every loss token, dropped or not, which pulls
      the trainer back toward the inference policy.

    The loss is the sum of these terms over this micro-batch's loss tokens divided by
    ``num_loss_tokens``, the loss-token count of the whole step over all ranks and
    micro-batches; the caller sums gradients over micro-batches and ranks (module docstring).

    Args:
        logprobs: (B, T) fp32 trainer log-probabilities of the sampled tokens (with grad).
        inference_logprobs: (B, T) log-probabilities the inference engine reported.
        advantages: (B, T) per-token advantages.
        loss_mask: (B, T) bool, True where the token is trained on.
        delta_low, delta_high: trust-region bounds in probability space, >= 0.
        kl_coef: weight of the KL penalty, >= 0.
        num_loss_tokens: global loss-token count of the step, > 0.
        weights: (B, T) optional detached factor on every PG term (a mismatch correction).
        sample_ids: unused (the same signature as every `POLICY_LOSSES` entry).

    Returns:
        loss: 0-dim tensor.
        stats: detached 0-dim fp32 SUMS over this micro-batch's loss tokens (all-reduce the
            sums, then divide by the global ``loss_tokens``): ``loss_tokens``,
            ``masked_tokens`` (PG term dropped by the trust region), ``clipped_tokens`` (PG
            weight clipped but the gradient kept; 0 here), ``mismatch_kl_sum`` (k3 estimator
            ``exp(d) - d - 1`` of KL(inference || trainer) on the sampled tokens, which the
            inference policy drew), ``ratio_sum``, ``pg_loss_sum`` (PG terms that were kept),
            ``kl_loss_sum`` (KL penalty terms incl. ``kl_coef``).
    """
    _check_loss_args(num_loss_tokens, delta_low=delta_low, delta_high=delta_high, kl_coef=kl_coef)
    loss_mask, log_ratio, ratio = _masked_ratio(logprobs, inference_logprobs, loss_mask)
    out_of_region = _outside_trust_region(logprobs, inference_logprobs, advantages, delta_low, delta_high)
    pg_terms = torch.where(out_of_region, 0.0, -ratio * advantages)  # (B, T)
    return _finish(pg_terms, weights, loss_mask, log_ratio, kl_coef, num_loss_tokens, masked=out_of_region)


def aipo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
              ratio_cap: float, kl_coef: float, num_loss_tokens: int, weights: Tensor | None = None,
              sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """AIPO (LlamaRL): the importance weight truncated at ``ratio_cap``, as a stop-gradient weight.

    PG term ``-sg(min(ratio, ratio_cap)) * A * exp(logprobs - sg(logprobs))``: its value is
    ``-min(ratio, ratio_cap) * A`` and its gradient ``-min(ratio, ratio_cap) * A * grad log p``, so a
    token above the cap still learns, with weight ``ratio_cap`` (``clipped_tokens``). (A plain
    ``-clamp(ratio, max=ratio_cap) * A`` would instead give those tokens no gradient at all.) KL
    penalty, normalisation, ``weights`` and stats as in `dppo_loss`.
    """
    _check_loss_args(num_loss_tokens, kl_coef=kl_coef)
    if ratio_cap <= 0:
        raise ValueError(f"ratio_cap must be > 0, got {ratio_cap}")
    loss_mask, log_ratio, ratio = _masked_ratio(logprobs, inference_logprobs, loss_mask)
    weight = ratio.detach().clamp(max=ratio_cap)  # (B, T)
    pg_terms = -weight * advantages * _unit_score(logprobs, loss_mask)  # (B, T)
    return _finish(pg_terms, weights, loss_mask, log_ratio, kl_coef, num_loss_tokens,
                   clipped=ratio.detach() > ratio_cap)


def ppo_clip_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                  clip_low: float, clip_high: float, kl_coef: float, num_loss_tokens: int,
                  weights: Tensor | None = None, sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with the engine's policy as the old policy.

    PG term ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``. Where the clipped
    branch is the smaller (``A > 0 and ratio > 1 + clip_high``, ``A < 0 and ratio < 1 - clip_low``)
    the term is constant: no gradient (``masked_tokens``). KL penalty, normalisation, ``weights``
    and stats as in `dppo_loss`.
    """
    _check_loss_args(num_loss_tokens, clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
    loss_mask, log_ratio, ratio = _masked_ratio(logprobs, inference_logprobs, loss_mask)
    pg_terms, masked = _clipped_surrogate(ratio, ratio.detach(), advantages, clip_low, clip_high)
    return _finish(pg_terms, weights, loss_mask, log_ratio, kl_coef, num_loss_tokens, masked=masked)


def gspo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
              clip_low: float, clip_high: float, kl_coef: float, num_loss_tokens: int,
              weights: Tensor | None = None, sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (token form, "GSPO-token"): PPO's clipped surrogate on a sequence-level ratio.

    ``s = exp(mean of d over the sample's loss tokens)`` (the length-normalised sequence ratio,
    detached) and per token ``s_t = s * exp(logprobs - sg(logprobs))`` (value ``s``, gradient
    ``s * grad log p``); PG term ``-min(s_t * A, clip(s_t, 1 - clip_low, 1 + clip_high) * A)``, so
    a whole sample is clipped together (``masked_tokens``). Each token carries its sample's term
    and the sum is divided by ``num_loss_tokens`` like every loss here (token-mean, where the
    paper averages per sequence first). Needs ``sample_ids``. KL penalty, ``weights`` and stats as
    in `dppo_loss`.
    """
    _check_loss_args(num_loss_tokens, clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
    if sample_ids is None:
        raise ValueError("gspo_loss needs sample_ids (which sample each token belongs to)")
    loss_mask, log_ratio, _ = _masked_ratio(logprobs, inference_logprobs, loss_mask)
    seq_ratio = torch.exp(_per_sample(log_ratio.detach(), loss_mask, sample_ids, mean=True))  # (B, T)
    token_ratio = seq_ratio * _unit_score(logprobs, loss_mask)  # (B, T)
    pg_terms, masked = _clipped_surrogate(token_ratio, seq_ratio, advantages, clip_low, clip_high)
    return _finish(pg_terms, weights, loss_mask, log_ratio, kl_coef, num_loss_tokens, masked=masked)


def cispo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
               clip_low: float, clip_high: float, kl_coef: float, num_loss_tokens: int,
               weights: Tensor | None = None, sample_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): the importance weight clipped, as a stop-gradient weight; no token dropped.

    PG term ``-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * exp(logprobs - sg(logprobs))``:
    value ``-clip(ratio) * A``, gradient ``-clip(ratio) * A * grad log p`` for every token, the
    clipped ones included (``clipped_tokens``). KL penalty, normalisation, ``weights`` and stats
    as in `dppo_loss`.
    """
    _check_loss_args(num_loss_tokens, clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
    loss_mask, log_ratio, ratio = _masked_ratio(logprobs, inference_logprobs, loss_mask)
    low, high = max(1.0 - clip_low, 0.0), 1.0 + clip_high
    weight = ratio.detach().clamp(min=low, max=high)  # (B, T)
    pg_terms = -weight * advantages * _unit_score(logprobs, loss_mask)  # (B, T)
    return _finish(pg_terms, weights, loss_mask, log_ratio, kl_coef, num_loss_tokens,
                   clipped=(ratio.detach() < low) | (ratio.detach() > high))


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "dppo": dppo_loss,
    "aipo": aipo_loss,
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""``trainer.loss.type`` -> the loss. Common arguments: the four (B, T) tensors, then keywords
``kl_coef``, ``num_loss_tokens``, ``weights``, ``sample_ids`` and the loss's own parameters."""


# ----------------------------------------------------------------------------- corrections


@torch.no_grad()
def correction_weights(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor, sample_ids: Tensor, *,
                       kind: str, level: str, low: float, high: float) -> tuple[Tensor, Tensor]:
    """A trainer/engine mismatch correction as a detached factor on each token's PG term.

    ``rho = exp(d)`` per token (``level="token"``), or ``exp(sum of d over the sample's loss
    tokens)`` for every token of the sample (``level="sequence"``, the sample's likelihood ratio),
    with ``d = logprobs - inference_logprobs``. The losses already weight by the token ratio, so
    the factor changes that weight:

    - ``tis`` (truncated IS): ``min(1, high / rho)``, i.e. the IS weight becomes ``min(rho, high)``;
    - ``mis`` (masked IS): ``1 if rho <= high else 0``: tokens (samples) above the bound are dropped;
    - ``icepop``: ``1 if low <= rho <= high else 0``: dropped on both sides.

    Args:
        logprobs, inference_logprobs, loss_mask, sample_ids: (B, T) as in the losses.
        kind: ``tis``, ``mis`` or ``icepop``.
        level: ``token`` or ``sequence``.
        low, high: the bounds on rho, 0 <= low <= 1 <= high (``low`` is used by icepop only).

    Returns:
        weights: (B, T) fp32 factor (1 outside the loss mask).
        touched: (B, T) bool, loss tokens whose factor is not 1 (their share is logged as
            ``loss/correction_fraction``).
    """
    if kind not in CORRECTIONS or kind == "none":
        raise ValueError(f"unknown correction {kind!r}; known: {CORRECTIONS[1:]}")
    if level not in ("token", "sequence"):
        raise ValueError(f"correction level must be 'token' or 'sequence', got {level!r}")
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"correction bounds need 0 <= low <= 1 <= high, got low={low}, high={high}")
    loss_mask = loss_mask.bool()
    d = torch.where(loss_mask, logprobs.detach().float() - inference_logprobs.float(), 0.0)  # (B, T)
    log_rho = _per_sample(d, loss_mask, sample_ids, mean=False) if level == "sequence" else d
    log_high = math.log(high)
    if kind == "tis":  # computed in log space: a sequence ratio may overflow exp
        weights = torch.exp(torch.clamp(log_high - log_rho, max=0.0))
        touched = log_rho > log_high
    else:
        keep = log_rho <= log_high
        if kind == "icepop":
            keep &= log_rho >= (math.log(low) if low > 0 else -math.inf)
        weights, touched = keep.float(), ~keep
    touched &= loss_mask
    return torch.where(loss_mask, weights, 1.0), touched


# ----------------------------------------------------------------------------- shared pieces


def _masked_ratio(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(bool loss mask, log-ratio d zeroed outside it, exp(d)); all (B, T).

    Zeroing d outside the loss mask means padding can never produce inf/nan gradients."""
    loss_mask = loss_mask.bool()
    log_ratio = torch.where(loss_mask, logprobs - inference_logprobs, 0.0)
    return loss_mask, log_ratio, torch.exp(log_ratio)


def _unit_score(logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """``exp(logprobs - sg(logprobs))`` on loss tokens: value 1, gradient ``grad log p``. (B, T)"""
    return torch.exp(torch.where(loss_mask, logprobs - logprobs.detach(), 0.0))


def _clipped_surrogate(ratio: Tensor, ratio_value: Tensor, advantages: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's ``-min(ratio * A, clip(ratio) * A)`` and where its clipped branch (no gradient) won.

    ``ratio`` carries the gradient, ``ratio_value`` (detached, same value) decides the branch."""
    low, high = 1.0 - clip_low, 1.0 + clip_high
    clipped = ((advantages > 0) & (ratio_value > high)) | ((advantages < 0) & (ratio_value < low))
    terms = torch.where(clipped, -ratio_value.clamp(min=low, max=high) * advantages, -ratio * advantages)
    return terms, clipped


def _per_sample(values: Tensor, loss_mask: Tensor, sample_ids: Tensor, mean: bool) -> Tensor:
    """Each token's sample's sum (or mean) of ``values`` over that sample's loss tokens. (B, T)"""
    _, inverse = torch.unique(sample_ids.reshape(-1), return_inverse=True)
    num = int(inverse.max()) + 1 if inverse.numel() else 0
    masked = torch.where(loss_mask, values, 0.0).reshape(-1)
    sums = torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(0, inverse, masked)
    if mean:
        counts = torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(
            0, inverse, loss_mask.reshape(-1).to(values.dtype))
        sums = sums / counts.clamp(min=1.0)
    return sums[inverse].view_as(values)


def _finish(pg_terms: Tensor, weights: Tensor | None, loss_mask: Tensor, log_ratio: Tensor, kl_coef: float,
            num_loss_tokens: int, masked: Tensor | None = None,
            clipped: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Apply the correction weights and the loss mask, add the KL penalty, normalise; the stats."""
    if weights is not None:
        pg_terms = pg_terms * weights
    pg_terms = torch.where(loss_mask, pg_terms, 0.0)  # (B, T)
    kl_terms = torch.where(loss_mask, kl_coef * 0.5 * log_ratio.square(), 0.0)  # (B, T)
    pg_sum, kl_sum = pg_terms.sum(), kl_terms.sum()
    loss = (pg_sum + kl_sum) / num_loss_tokens
    none = torch.zeros_like(loss_mask)
    stats = _loss_stats(loss_mask, none if masked is None else masked, none if clipped is None else clipped,
                        log_ratio, pg_sum, kl_sum)
    return loss, stats


@torch.no_grad()
def _loss_stats(loss_mask: Tensor, masked: Tensor, clipped: Tensor, log_ratio: Tensor, pg_sum: Tensor,
                kl_sum: Tensor) -> dict[str, Tensor]:
    """The detached sums every policy loss returns (see `dppo_loss`)."""
    d = log_ratio.detach()
    return {
        "loss_tokens": loss_mask.sum().float(),
        "masked_tokens": (loss_mask & masked).sum().float(),
        "clipped_tokens": (loss_mask & clipped).sum().float(),
        "mismatch_kl_sum": torch.where(loss_mask, torch.exp(d) - d - 1.0, 0.0).sum().float(),
        "ratio_sum": torch.where(loss_mask, torch.exp(d), 0.0).sum().float(),
        "pg_loss_sum": pg_sum.detach().float(),
        "kl_loss_sum": kl_sum.detach().float(),
    }


@torch.no_grad()
def _outside_trust_region(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, delta_low: float,
                          delta_high: float) -> Tensor:
    """(B, T) bool: tokens whose probability already moved past the Binary-TV bound in the
    direction the update pushes it (``A > 0 and p - q > delta_high``, ``A < 0 and p - q < -delta_low``)."""
    prob_diff = torch.exp(logprobs) - torch.exp(inference_logprobs)  # (B, T)
    return ((advantages > 0) & (prob_diff > delta_high)) | ((advantages < 0) & (prob_diff < -delta_low))


# ----------------------------------------------------------------------------- supervised


def sft_loss(logprobs: Tensor, loss_mask: Tensor, num_loss_tokens: int) -> Tensor:
    """Negative log-likelihood summed over loss tokens, divided by ``num_loss_tokens``.

    Same normalisation contract as the policy losses (global token count; gradients summed over
    micro-batches and ranks).

    Args:
        logprobs: (B, T) fp32 log-probabilities of the target tokens.
        loss_mask: (B, T) bool.
        num_loss_tokens: global loss-token count of the step, > 0.

    Returns:
        0-dim loss tensor.
    """
    _check_loss_args(num_loss_tokens)
    return -torch.where(loss_mask.bool(), logprobs, 0.0).sum() / num_loss_tokens


def _check_loss_args(num_loss_tokens: int, **non_negative: float) -> None:
    """Reject a non-positive token count and negative coefficients (caller mistakes)."""
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be > 0, got {num_loss_tokens}")
    for name, value in non_negative.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
