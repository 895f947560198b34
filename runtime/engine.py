"""Native inference engine: the models/ definitions plus a slot-based KV cache.

One scheduler iteration (`NativeEngine.step`):

    waiting requests --admit into free slots--> prefill (one right-padded batch) --> sample 1st token
    running slots ----one batched decode step (last token of every slot)--------> sample next token
    after every sample: stop id / max_tokens / slot full?  --> Completion, slot freed at once

Each running request owns one slot of a per-layer KV cache of shape
(max_num_seqs, Hkv, max_model_len, D). The model has no cache of its own: it calls
`attn.attend(layer_id, q, k, v)` in every layer, and the engine's `_CacheAttention` writes the new
k/v into the slots at their absolute positions and attends over each slot's cached prefix with a
boolean mask (causal within the new tokens, bounded by the slot's length). Prefill and decode are the
same operation with T = prompt length or T = 1, which also lets a later version append a new turn
to a live sequence.

Logprobs are fp32 log_softmax(logits / temperature) of the sampled token over the full vocabulary
(before top_p), which is what the trainer recomputes; greedy requests report temperature-1 logprobs.

Weight sync copies new weights into `engine.model` parameters in place between `step()` calls and
then calls `set_version(v)`. The engine keeps no state derived from weights, so nothing goes stale;
the KV cache of in-flight requests is kept, and the tokens sampled after the swap record the new
version in `Completion.versions` (off-policy by design, bounded by the controller).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature: 0 means greedy (argmax); its logprobs are then those of temperature 1.
    top_p: nucleus filtering of the sampling distribution; logprobs ignore it.
    max_tokens: most tokens to generate (the stop token counts).
    stop_token_ids: generation ends after sampling one of these (put the tokenizer's EOS here);
        the stop token is part of the completion.
    seed: when set, the request samples from its own generator, so its tokens depend only on
        the seed and the logits, not on which other requests share the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")


@dataclass
class Request:
    """A prompt (token ids) to complete; request_id is chosen by the caller, unique while live."""

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """A finished (or aborted) request.

    logprobs[i] is the fp32 logprob of token_ids[i] under the temperature-scaled, un-truncated
    distribution; versions[i] is the engine's weight version when token_ids[i] was sampled.
    """

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason


@runtime_checkable
class InferenceEngine(Protocol):
    """What the runtime needs from an engine (native or vLLM).

    `model` is the nn.Module whose parameters weight sync overwrites in place between `step()`
    calls; it then calls `set_version(v)`.
    """

    version: int
    model: nn.Module

    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never be served."""
        ...

    def step(self) -> list[Completion]:
        """One scheduler iteration; returns the requests that finished in it."""
        ...

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def abort(self, request_id: int) -> Completion | None:
        """Drop a waiting or running request at once; None if it is not live."""
        ...

    def set_version(self, version: int) -> None:
        """Record the weight version that tokens sampled from now on come from."""
        ...


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside its nucleus; rows are not renormalised.

    probs (B, V), top_p (B,). A token is kept if the mass of the tokens ranked above it is below
    top_p, so the top token is always kept. Rows with top_p >= 1 are returned unchanged (float
    rounding of the cumulative sum must not cut their tail).
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_above >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with its own params; return (tokens (B,) long, logprobs (B,) fp32).

    logits (B, V). Logprobs are log_softmax(logits / temperature) of the sampled token (temperature
    1 for greedy rows), in fp32, before top_p. Rows with a generator are sampled one by one with it
    so that their draws do not depend on the rest of the batch; the others share one draw from the
    global RNG.
    """
    num_rows = logits.shape[0]
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)  # (B, V) fp32
    tokens = logp.argmax(dim=-1)  # greedy rows keep this
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        probs = logp[sampled].exp()  # (S, V); multinomial takes unnormalised rows
        if any(params[i].top_p < 1.0 for i in sampled):  # skip the vocabulary sort when unused
            probs = top_p_filter(probs, torch.tensor([params[i].top_p for i in sampled], device=device))
        shared = [j for j, i in enumerate(sampled) if generators[i] is None]
        if shared:
            tokens[[sampled[j] for j in shared]] = torch.multinomial(probs[shared], 1).squeeze(-1)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j : j + 1], 1, generator=generators[i])[0, 0]
    logprobs = logp.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
    assert tokens.shape == (num_rows,)
    return tokens, logprobs


class _KVCache:
    """Per-layer k/v tensors of shape (num_slots, Hkv, max_len, D), allocated on first use.

    Shapes and dtype come from the first k/v a layer produces, so the cache needs nothing from the
    model's args and always matches what the model computes.
    """

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def layer(self, layer_id: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (k_cache, v_cache) of one layer; `like` is a (B, Hkv, T, D) k of that layer."""
        if layer_id not in self.k:
            _, num_kv_heads, _, head_dim = like.shape
            shape = (self.num_slots, num_kv_heads, self.max_len, head_dim)
            self.k[layer_id] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.v[layer_id] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.k[layer_id], self.v[layer_id]


class _CacheAttention:
    """AttentionContext for one forward of new tokens appended to cached slots.

    slots (B,) long: the cache slot of each row. positions (B, T) long: absolute position of each
    new token (right-padded rows continue counting; their keys land past the row's length, where
    the length mask hides them until decode overwrites them). key_len: max position + 1.
    """

    def __init__(self, cache: _KVCache, slots: torch.Tensor, positions: torch.Tensor, key_len: int):
        self.cache = cache
        self.slots = slots
        self.positions = positions
        self.key_len = key_len
        keys = torch.arange(key_len, device=positions.device)
        # Query at position p sees cached keys 0..p: causal within the new tokens and bounded by
        # the slot's own history.
        self.mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, L)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D), caching k/v."""
        k_cache, v_cache = self.cache.layer(layer_id, k)
        rows = self.slots[:, None]  # (B, 1), broadcast against positions (B, T)
        k_cache[rows, :, self.positions] = k.transpose(1, 2)  # (B, T, Hkv, D)
        v_cache[rows, :, self.positions] = v.transpose(1, 2)
        keys = k_cache[self.slots, :, : self.key_len]  # (B, Hkv, L, D)
        values = v_cache[self.slots, :, : self.key_len]
        group = q.shape[1] // keys.shape[1]
        if group > 1:  # GQA: query head h reads kv head h // group, as in HF's repeat_kv
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        # Repeated k/v rather than enable_gqa: with a mask, CUDA runs the memory-efficient kernel,
        # which does not take enable_gqa.
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask)


@dataclass
class _Sequence:
    """A running request: its slot, sampled tokens so far and how many tokens sit in the cache."""

    request: Request
    slot: int
    generator: torch.Generator | None
    num_cached: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def completion(self, finish_reason: FinishReason) -> Completion:
        """The Completion of this sequence as it stands."""
        r = self.request
        return Completion(r.request_id, list(r.prompt_ids), self.token_ids, self.logprobs, self.versions, finish_reason)


class NativeEngine:
    """Continuous-batching engine over a models/ model with a slot-based KV cache.

    model: a models/ module with hidden(tokens (B, T), positions (B, T), attn) -> final-normed hidden
        states (B, T, dim) and output_weight (V, dim), so that forward == F.linear(hidden,
        output_weight); it is moved to device/dtype, put in eval mode and frozen.
    max_num_seqs: cache slots, i.e. most requests running at once.
    max_model_len: most tokens (prompt + completion) of one request.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.version = 0
        self._cache = _KVCache(max_num_seqs, max_model_len)
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Sequence] = {}  # request_id -> sequence
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first

    def set_version(self, version: int) -> None:
        """Tokens sampled from now on are recorded with this weight version."""
        self.version = version

    def add(self, request: Request) -> None:
        """Queue a request; ValueError if its prompt is empty, too long or holds unknown token ids."""
        num_prompt = len(request.prompt_ids)
        if not 1 <= num_prompt <= self.max_model_len - 1:
            raise ValueError(
                f"request {request.request_id}: prompt has {num_prompt} tokens, "
                f"must be 1..{self.max_model_len - 1} (max_model_len - 1)"
            )
        vocab_size = self.model.output_weight.shape[0]
        if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab_size:
            raise ValueError(f"request {request.request_id}: prompt token ids must be in [0, {vocab_size})")
        if request.request_id in self._running or any(r.request_id == request.request_id for r in self._waiting):
            raise ValueError(f"request {request.request_id} is already live")
        self._waiting.append(request)

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._waiting or self._running)

    def abort(self, request_id: int) -> Completion | None:
        """Drop a live request and free its slot; returns what it had generated, or None."""
        if request_id in self._running:
            seq = self._running.pop(request_id)
            self._free_slots.append(seq.slot)
            return seq.completion("abort")
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return Completion(request_id, list(request.prompt_ids), [], [], [], "abort")
        return None

    def step(self) -> list[Completion]:
        """Admit and prefill waiting requests into free slots, then decode one token per running slot."""
        with torch.inference_mode():
            admitted = self._admit()
            finished = self._forward(admitted, prefill=True) if admitted else []
            running = list(self._running.values())
            if running:
                finished += self._forward(running, prefill=False)
        return finished

    def _admit(self) -> list[_Sequence]:
        """Move waiting requests into free slots (FIFO)."""
        admitted = []
        while self._waiting and self._free_slots:
            request = self._waiting.popleft()
            generator = None
            if request.sampling.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
            seq = _Sequence(request, self._free_slots.pop(), generator)
            self._running[request.request_id] = seq
            admitted.append(seq)
        return admitted

    def _forward(self, seqs: list[_Sequence], prefill: bool) -> list[Completion]:
        """Run the model on new tokens of `seqs` (whole prompts or the last sampled token), sample one
        token each, and return the sequences that finished."""
        if prefill:
            new_tokens = [s.request.prompt_ids for s in seqs]
        else:
            new_tokens = [s.token_ids[-1:] for s in seqs]
        num_new = max(len(t) for t in new_tokens)
        padded = [t + [0] * (num_new - len(t)) for t in new_tokens]
        tokens = torch.tensor(padded, dtype=torch.long, device=self.device)  # (B, T)
        starts = torch.tensor([s.num_cached for s in seqs], device=self.device)
        positions = starts[:, None] + torch.arange(num_new, device=self.device)  # (B, T)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        key_len = max(s.num_cached for s in seqs) + num_new
        attn = _CacheAttention(self._cache, slots, positions, key_len)
        hidden = self.model.hidden(tokens, positions, attn)  # (B, T, dim)
        last = torch.tensor([len(t) - 1 for t in new_tokens], device=self.device)
        # Project only the rows we sample from: a prefill never materialises (B, T, V) logits.
        last_hidden = hidden[torch.arange(len(seqs), device=self.device), last]  # (B, dim)
        last_logits = F.linear(last_hidden, self.model.output_weight)  # (B, V)
        for seq, new in zip(seqs, new_tokens):
            seq.num_cached += len(new)
        return self._append(seqs, last_logits)

    def _append(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[Completion]:
        """Sample from logits (B, V), append to each sequence, finish those that hit a limit."""
        params = [s.request.sampling for s in seqs]
        tokens, logprobs = sample_tokens(logits, params, [s.generator for s in seqs])
        finished = []
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            reason = self._finish_reason(seq)
            if reason is not None:
                del self._running[seq.request.request_id]
                self._free_slots.append(seq.slot)
                finished.append(seq.completion(reason))
        return finished

    def _finish_reason(self, seq: _Sequence) -> FinishReason | None:
        """Why seq stops after its latest token, or None if it goes on."""
        sampling = seq.request.sampling
        if seq.token_ids[-1] in sampling.stop_token_ids:
            return "stop"
        if len(seq.token_ids) >= sampling.max_tokens:
            return "length"
        # The latest token still needs a cache position before the next one can be sampled.
        if len(seq.request.prompt_ids) + len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None


def generate(engine: InferenceEngine, requests: list[Request]) -> list[Completion]:
    """Run requests to completion on engine; completions come back in request order."""
    for request in requests:
        engine.add(request)
    done: dict[int, Completion] = {}
    while engine.has_work():
        for completion in engine.step():
            done[completion.request_id] = completion
    return [done[r.request_id] for r in requests]
