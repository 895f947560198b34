"""What the runtime needs from an inference engine, and the types it trades in.

Two engines implement `InferenceEngine`: the native one (runtime/engine/native.py) and the vLLM
adapter (runtime/engine/vllm_engine.py). Requests are token ids in and token ids out, with the
fp32 logprob and the weight version of every sampled token; how a request is sampled is
`SamplingParams` (runtime/engine/sampling.py, beside the sampler that honours it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from torch import nn

from meshrl.runtime.engine.sampling import SamplingParams

__all__ = ["Completion", "FinishReason", "InferenceEngine", "Request", "SamplingParams", "continuation_ids", "generate"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Request:
    """A prompt (token ids) to complete; request_id is chosen by the caller, unique while live."""

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """A finished (or aborted) sample of a request.

    logprobs[i] is the fp32 logprob of token_ids[i] under the temperature-scaled, un-truncated
    distribution; versions[i] is the engine's weight version when token_ids[i] was sampled;
    index is the sample's number among the request's n.
    """

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    index: int = 0


def continuation_ids(completion: Completion, new_ids: list[int]) -> list[int]:
    """The prompt of the next turn of a multi-turn episode: earlier prompt + completion + the
    environment's new tokens, as ids (never re-tokenised text), so that an engine's prefix cache
    finds every block computed in earlier turns and only the new tokens are computed."""
    return list(completion.prompt_ids) + list(completion.token_ids) + list(new_ids)


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
        """One scheduler iteration; returns the samples that finished in it."""
        ...

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def abort(self, request_id: int) -> Completion | None:
        """Drop a live request at once, freeing its memory; None if it is not live."""
        ...

    def set_version(self, version: int) -> None:
        """Record the weight version that tokens sampled from now on come from."""
        ...


def generate(engine: InferenceEngine, requests: list[Request]) -> list[Completion]:
    """Run requests to completion on engine; completions come back in request order, and the n
    samples of one request next to each other in index order."""
    for request in requests:
        engine.add(request)
    done: dict[tuple[int, int], Completion] = {}
    while engine.has_work():
        for completion in engine.step():
            done[completion.request_id, completion.index] = completion
    return [done[r.request_id, i] for r in requests for i in range(r.sampling.n)]
