"""Sampling parameters and the batched, seeded sampler of the native engine.

One call samples a token for every row of a (B, V) logits batch with that row's own
temperature, top_k, min_p and top_p, on the logits' device, with a handful of batched kernels
and no Python loop over rows. Without truncation (the RL default) the vocabulary is read once,
in 1024-token chunks (max, mass and argmax per chunk; a Triton kernel on CUDA), and the draw
scans only the chunk it lands in; with truncation the whole (B, V) probabilities are formed.
The engine captures the sampler in its decode CUDA graph.

Logprobs. The logprob reported for a sampled token is fp32 `log_softmax(logits / temperature)`
over the full vocabulary, before any truncation (top_k, min_p, top_p), which is what the
trainer recomputes from its own forward. Greedy rows (temperature 0) report temperature-1
logprobs.

Truncation, in this order: top_k keeps the k largest logits (ties with the k-th are kept);
min_p keeps tokens whose probability is at least min_p times the row's largest; top_p keeps
the smallest set of most likely remaining tokens whose mass reaches top_p of what is left
(the top token always survives). The token is then drawn from the renormalised remainder.

Randomness. Row r draws its token by inverse-CDF with one uniform number that is a hash of
(its seed, the index of the token in its completion). It depends on nothing else: not on the
batch, the other rows, a global RNG or the device, so a seeded request gives the same tokens
whatever it is batched with, after a preemption, and on a CUDA graph replay (up to the logits
themselves, which a GPU computes with batch-shape-dependent rounding). Requests without a seed
get one from the engine's RNG when they are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from meshrl.runtime.engine.kernels import chunk_stats, triton_available


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature: 0 means greedy (argmax); its logprobs are then those of temperature 1.
    top_k: keep the k most likely tokens (0 = off). min_p: keep tokens with probability at
        least min_p times the top token's (0 = off). top_p: nucleus of the remaining mass (1 = off).
        None of them changes the reported logprobs.
    max_tokens: most tokens to generate (the stop token counts).
    stop_token_ids: generation ends after sampling one of these (put the tokenizer's EOS here);
        the stop token is part of the completion.
    stop: stop strings; generation ends after the token that completes one of them in the
        decoded completion (that token is kept). Needs the engine's `detokenize`.
    n: samples of the prompt; they share its prefill and come back as n completions with
        `index` 0..n-1 and the same request_id.
    seed: when set, sample i uses seed + i and its tokens depend only on that seed and the
        logits, not on the rest of the batch. Without it the engine picks a seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the dataclass is hashable).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= self.seed < 2**63 - self.n:
            raise ValueError(f"seed must be in [0, 2**63 - n), got {self.seed}")


# ---------------------------------------------------------------------------- counter-based RNG

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x, c in [0, 2**32), in int64: the product may pass 2**63, but int64
    multiplication wraps modulo 2**64 on CPU and CUDA, which keeps its low 32 bits exact (two
    kernels; tests/unit/test_sampling.py checks the wrap against Python's integers)."""
    return (x * c) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seeds: Tensor, counters: Tensor) -> Tensor:
    """seeds (B,) int64 >= 0, counters (B,) int64 -> (B,) float64 uniform in [0, 1), 48 random bits."""
    return _uniform_from_keys(seed_keys(seeds), counters)


def seed_keys(seeds: Tensor) -> Tensor:
    """seeds (B,) int64 -> (3, B) int64: the parts of hash_uniform that depend on the seed alone
    (computed once per batch instead of at every token)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return torch.stack([lo, hi, _mix32(lo + 0x9E3779B9 & _M32)])


def _uniform_from_keys(keys: Tensor, counters: Tensor) -> Tensor:
    lo, hi, lo_mixed = keys
    a = _mix32(lo ^ _mix32(hi ^ _mix32(counters & _M32)))
    b = _mix32(a ^ lo_mixed)
    return (a * 65536 + (b >> 16)).double() / 2.0**48


# ---------------------------------------------------------------------------- batched sampler


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, plus what the host knows about them.

    temperature, top_p, min_p (B,) fp32; top_k, seeds (B,) int64. divisor (B,) fp32: the
    temperature, 1 on greedy rows; greedy (B,) bool; seed_keys (3, B) int64 (see `seed_keys`).
    max_top_k / use_top_p / use_min_p / all_greedy / any_greedy / unit_temperature let the
    sampler skip the work no row asks for (e.g. the vocabulary sort of top_p, the division by
    a temperature of 1).
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor
    seeds: Tensor
    max_top_k: int
    use_top_p: bool
    use_min_p: bool
    all_greedy: bool
    divisor: Tensor
    greedy: Tensor
    seed_keys: Tensor
    any_greedy: bool
    unit_temperature: bool

    @classmethod
    def build(cls, params: list[SamplingParams | None], seeds: list[int], device: torch.device) -> SamplingBatch:
        """params[i] None marks a pad row: sampled greedily, its token is thrown away, so it turns
        on no work (a greedy pad must not make a batch of sampled rows compute the argmax)."""
        pad = SamplingParams(temperature=0.0)
        rows = [p or pad for p in params]
        real = [p for p in params if p is not None]
        temperature = torch.tensor([p.temperature for p in rows], dtype=torch.float32)
        greedy = temperature == 0  # in fp32: a temperature that rounds to 0 is greedy too
        divisor = torch.where(greedy, torch.ones_like(temperature), temperature)
        is_real = torch.tensor([p is not None for p in params], dtype=torch.bool)
        seeds_t = torch.tensor(seeds, dtype=torch.int64)

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            temperature=move(temperature),
            top_p=move(torch.tensor([p.top_p for p in rows], dtype=torch.float32)),
            top_k=move(torch.tensor([p.top_k for p in rows], dtype=torch.int64)),
            min_p=move(torch.tensor([p.min_p for p in rows], dtype=torch.float32)),
            seeds=move(seeds_t),
            max_top_k=max((p.top_k for p in real if p.temperature > 0), default=0),
            use_top_p=any(p.top_p < 1.0 and p.temperature > 0 for p in real),
            use_min_p=any(p.min_p > 0.0 and p.temperature > 0 for p in real),
            all_greedy=all(p.temperature == 0 for p in real),
            divisor=move(divisor),
            greedy=move(greedy),
            seed_keys=move(seed_keys(seeds_t)),
            any_greedy=bool((greedy & is_real).any()),
            unit_temperature=bool((divisor == 1).all()),
        )


    def mode(self) -> tuple[int, bool, bool, bool, bool, bool]:
        """Which operations `sample` runs for this batch (its host flags), with max_top_k rounded up
        to a power of two (a larger top-k pass keeps the same tokens: each row cuts at its own k).
        A CUDA graph captured for one mode serves every batch of that mode."""
        k = self.max_top_k
        return (1 << (k - 1).bit_length() if k else 0, self.use_top_p, self.use_min_p, self.all_greedy,
                self.any_greedy, self.unit_temperature)


_BATCH_TENSORS = ("temperature", "top_p", "top_k", "min_p", "seeds", "divisor", "greedy", "seed_keys")


class StaticSamplingBatch:
    """A SamplingBatch's tensors for up to `rows` rows in buffers that never move, so a captured
    CUDA graph can read them: `load` copies a batch in, `view(B, mode)` is the batch to sample with."""

    def __init__(self, rows: int, device: torch.device) -> None:
        template = SamplingBatch.build([None] * rows, [0] * rows, device)
        self.buffers = {name: getattr(template, name).clone() for name in _BATCH_TENSORS}

    def load(self, batch: SamplingBatch) -> None:
        for name, buffer in self.buffers.items():
            value = getattr(batch, name)
            buffer[..., :value.shape[-1]].copy_(value)

    def view(self, B: int, mode: tuple[int, bool, bool, bool, bool, bool]) -> SamplingBatch:
        max_top_k, use_top_p, use_min_p, all_greedy, any_greedy, unit_temperature = mode
        return SamplingBatch(**{name: buffer[..., :B] for name, buffer in self.buffers.items()},
                             max_top_k=max_top_k, use_top_p=use_top_p, use_min_p=use_min_p, all_greedy=all_greedy,
                             any_greedy=any_greedy, unit_temperature=unit_temperature)


def truncate(probs: Tensor, scaled: Tensor, batch: SamplingBatch) -> Tensor:
    """Zero what top_k, min_p and top_p drop (see the module docstring). probs, scaled (B, V) fp32;
    probs may be unnormalised (every rule compares within a row)."""
    if batch.max_top_k > 0:
        k = batch.top_k.clamp(max=min(batch.max_top_k, scaled.shape[1]))
        top = scaled.topk(min(batch.max_top_k, scaled.shape[1]), dim=-1).values  # (B, K) descending
        kth = top.gather(-1, (k - 1).clamp(min=0)[:, None])  # (B, 1)
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        probs = probs.masked_fill(scaled < kth, 0.0)
    if batch.use_min_p:
        floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    if batch.use_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        total = sorted_probs.sum(dim=-1, keepdim=True)
        # Rows with top_p == 1 keep everything: float rounding of the sum must not cut their tail.
        drop = (mass_above >= batch.top_p[:, None] * total) & (batch.top_p[:, None] < 1.0)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def sample(logits: Tensor, batch: SamplingBatch, counters: Tensor) -> tuple[Tensor, Tensor]:
    """Sample one token per row. logits (B, V) any float dtype; counters (B,) int64 (the index of
    the token in its completion) -> (tokens (B,) int64, logprobs (B,) fp32)."""
    if batch.max_top_k or batch.use_top_p or batch.use_min_p:
        return _sample_truncated(logits, batch, counters)
    return _sample_full(logits, batch, counters)


def _sample_truncated(logits: Tensor, batch: SamplingBatch, counters: Tensor) -> tuple[Tensor, Tensor]:
    """Some row truncates: probabilities over the whole (B, V) batch, truncated, drawn."""
    logits = logits.float()
    # x / 1 is exactly x: skip a pass over (B, V) when no row has another temperature.
    scaled = logits if batch.unit_temperature else logits / batch.divisor[:, None]  # (B, V)
    # Only the sampled tokens' logprobs are needed, so no (B, V) log_softmax: unnormalised
    # probabilities exp(x - max) serve truncation and the draw (both only use ratios), and
    # logprob = (x - max) - log(sum), as accurate as log_softmax near 0.
    peak = scaled.amax(dim=-1, keepdim=True)  # (B, 1)
    weights = (scaled - peak).exp_()  # (B, V) in (0, 1], the top token's is 1
    log_total = weights.sum(dim=-1, keepdim=True).log_()  # (B, 1)
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        drawn = inverse_cdf(truncate(weights, scaled, batch), _uniform_from_keys(batch.seed_keys, counters))
        tokens = torch.where(batch.greedy, logits.argmax(dim=-1), drawn) if batch.any_greedy else drawn
    return tokens, ((scaled.gather(-1, tokens[:, None]) - peak) - log_total).squeeze(-1)


def _chunk_stats(logits: Tensor, divisor: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """runtime/engine/kernels.py's chunk_stats (one Triton pass on CUDA), or the same in torch."""
    if logits.is_cuda and triton_available():
        return chunk_stats(logits, divisor, chunk)
    B, V = logits.shape
    n = -(-V // chunk)
    x = logits.float() / divisor[:, None]
    if n * chunk != V:
        x = torch.nn.functional.pad(x, (0, n * chunk - V), value=float("-inf"))
    x = x.view(B, n, chunk)
    cmax, carg = x.max(dim=-1)
    return cmax, (x - cmax[..., None]).exp().sum(dim=-1), carg


def _sample_full(logits: Tensor, batch: SamplingBatch, counters: Tensor) -> tuple[Tensor, Tensor]:
    """No row truncates: the whole vocabulary is read once, in chunks, for each chunk's max, mass
    and argmax (the normaliser, the greedy token and the draw's first level all come from those);
    only the drawn chunk's 1024 logits are read again. Same tokens as `_sample_truncated` up to
    rounding at a token boundary."""
    B, V = logits.shape
    C = min(_CHUNK, 1 << (V - 1).bit_length())  # a power of two (triton ranges); the last chunk is masked
    cmax, csum, carg = _chunk_stats(logits, batch.divisor, C)  # (B, n) each
    peak = cmax.amax(dim=1, keepdim=True)  # (B, 1)
    mass = csum.double() * (cmax - peak).double().exp()  # (B, n) in float64
    if batch.any_greedy or batch.all_greedy:
        first = (cmax == peak).int().argmax(dim=1, keepdim=True)  # the first chunk holding the max
        argmax = (first * C + carg.gather(1, first)).squeeze(1)
    if batch.all_greedy:
        tokens = argmax
    else:
        def weights_at(index: Tensor) -> Tensor:  # exp(x - max) of the drawn chunk, as mass counts it
            return (logits.gather(1, index).double() / batch.divisor[:, None] - peak).exp()

        drawn = _draw(mass, _uniform_from_keys(batch.seed_keys, counters), C, V, weights_at)
        tokens = torch.where(batch.greedy, argmax, drawn) if batch.any_greedy else drawn
    x = logits.gather(1, tokens[:, None]).float() / batch.divisor[:, None]
    return tokens, ((x - peak) - mass.sum(dim=1, keepdim=True).log().float()).squeeze(1)


_CHUNK = 1024


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The first token whose cumulative mass exceeds u times the row's total. probs (B, V) fp32
    >= 0 with a positive total, u (B,) float64 in [0, 1) -> (B,) int64; never a zero-mass token.

    Two levels, so the full vocabulary is read once (fp64 sums of 1024-token chunks) and only
    the chosen chunk is scanned: a full-vocabulary fp64 cumsum was the sampler's largest cost.
    """
    B, V = probs.shape
    C = min(_CHUNK, V)
    full = V // C
    sums = [probs[:, :full * C].view(B, full, C).sum(-1, dtype=torch.float64)]  # (B, full)
    if full * C < V:
        sums.append(probs[:, full * C:].sum(-1, keepdim=True, dtype=torch.float64))
    return _draw(torch.cat(sums, dim=1), u, C, V, lambda index: probs.gather(1, index).double())


def _draw(mass: Tensor, u: Tensor, C: int, V: int, weights_at: Callable[[Tensor], Tensor]) -> Tensor:
    """The two-level inverse-CDF draw. mass (B, n) float64: each C-token chunk's mass; u (B,)
    float64 in [0, 1); weights_at(index (B, C)) -> those tokens' float64 weights, on the same
    scale as mass -> (B,) int64, the first token whose cumulative mass exceeds u times the total."""
    cdf = mass.cumsum(dim=1)  # (B, n) mass up to the end of each chunk
    target = (u * cdf[:, -1])[:, None]  # (B, 1)
    chunk = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # (B, 1)
    base = torch.where(chunk > 0, cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)  # mass before the chunk
    arange = torch.arange(C, device=mass.device)
    index = chunk * C + arange  # (B, C)
    weights = weights_at(index.clamp(max=V - 1)).masked_fill_(index >= V, 0.0)
    pos = torch.searchsorted(weights.cumsum(dim=1).add_(base), target, right=True)  # (B, 1) in [0, C]
    # The chunk masses and this cumsum sum in different orders: a target in the chunk's last ulps
    # may pass its end; take the chunk's last token with mass then.
    last = torch.where(weights > 0, arange, -1).amax(dim=1, keepdim=True)
    return (chunk * C + torch.minimum(pos, last)).squeeze(1)
