"""One sample of a request, as the native engine tracks it (runtime/engine/scheduler.py moves it
between the queues, runtime/engine/runner.py feeds it to the model).

A sequence is (request, sample index): `tokens` (prompt + generated), `num_computed` of them with
k/v in the cache, a block table, and a *row*: its index in the persistent decode buffers (token,
position, slot, block table, context length), which on CUDA the graphs read. Its stop rules
(stop ids, stop strings, length) are checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from meshrl.runtime.engine.api import Completion, FinishReason, Request


@dataclass(eq=False, slots=True)
class Sequence:
    request: Request
    index: int
    seed: int
    tokens: list[int]  # prompt + generated
    num_prompt: int
    limit: int  # it ends by length once it holds this many tokens (max_tokens, max_model_len)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose k/v are in the cache
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of its leading full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    ready: bool = False  # decoding, with its row's inputs and device block table up to date
    row: int = -1
    admitted: int = -1  # admission stamp: the newest running sequence is preempted first
    cache_version: int = 0  # weight version of its oldest cached k/v
    followers: list[Sequence] = field(default_factory=list)  # samples waiting to fork its prefill
    inflight: int = 0  # decode launches whose token has not come back yet (0 or 1)
    epoch: int = 0  # bumped whenever it loses its row: results of earlier launches are stale

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    def completion(self, finish_reason: FinishReason) -> Completion:
        r = self.request
        return Completion(r.request_id, list(r.prompt_ids), self.generated, self.logprobs, self.versions,
                          finish_reason, self.index)

    def finish_reason(self, detokenize: Callable[[list[int]], str] | None) -> FinishReason | None:
        """Why the sequence ends after its last token, or None while it goes on."""
        sampling = self.request.sampling
        if self.tokens[-1] in sampling.stop_token_ids:
            return "stop"
        if sampling.stop and self.stop_string(detokenize):
            return "stop"
        if len(self.tokens) >= self.limit:
            return "length"
        return None

    def stop_string(self, detokenize: Callable[[list[int]], str]) -> bool:
        """Whether the tail of the completion contains one of the request's stop strings."""
        stop = self.request.sampling.stop
        window = max(len(s) for s in stop) + 4  # tokens are rarely shorter than one character
        tail = detokenize(self.tokens[max(len(self.tokens) - window, self.num_prompt):])
        return any(s in tail for s in stop)
