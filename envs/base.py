"""The environment protocols: where prompts come from, how episodes unfold, how they are scored.

An environment is a deterministic, indexable task: ``example(index)`` depends only on the
environment's seed and ``index``, so the controller's dataset cursor is a single integer that
checkpoints and resumes trivially, and every rank can rebuild the same example.

Two protocols, the second added to the first:

``Environment`` (single turn, text in / text out). ``score(example, completion)`` turns one
decoded completion into a reward: a float, or a `Reward` with several weighted components and
metrics; ``sft_completion`` gives the reference text used for supervised warm-up.

``EpisodeEnvironment`` (multi-turn, token in / token out). ``episode(example, tokenizer)``
starts one rollout. The runtime asks it for the prompt token ids, samples a turn, and hands
the episode the sampled *token ids*; the episode answers with the environment's next tokens
(a tool result, feedback, the next user message) or says it is done. The next turn's prompt is
every earlier token followed by the new ones, so earlier turns are never re-tokenised and the
logprobs the trainer sees belong to exactly the tokens that were sampled. An episode may use the
tokenizer to decode the sampled ids and to encode *its own* new text, never to re-encode
earlier turns. Environment tokens are context for the model, never trained on (loss mask
False). When the episode ends, ``score()`` gives its `Reward`.

A single-turn `Environment` runs as an episode through `SingleTurnEpisode` (`make_episode`),
so the runtime drives every environment the same way. `TextEpisode` is the base of the
built-in multi-turn environments: they are written in text, it does the token bookkeeping.

Faults: anything an environment raises while starting, stepping or scoring an episode fails
that rollout only (counted as rollouts/failed and excluded from training); see
runtime/rollout/episodes.py for timeouts and memory limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Example", "Environment", "Episode", "EpisodeEnvironment", "Reward", "SingleTurnEpisode", "TextEpisode",
           "Turn", "as_reward", "decode_reply", "make_episode", "stop_token_ids"]


@dataclass
class Example:
    """One task instance: the prompt text, the reference answer and free-form metadata.

    ``env`` names the environment that made it when several are mixed (envs/mix.py).
    """

    index: int
    prompt: str
    answer: str
    info: dict = field(default_factory=dict)
    env: str = ""


@dataclass
class Reward:
    """An episode's score: reward components (name -> value), their weights and free metrics.

    The scalar reward that advantages are computed from is ``total``, the weighted sum of the
    components (a component without a weight has weight 1). Metrics are logged, never trained on.
    """

    components: dict[str, float]
    weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.weights.get(k, 1.0) * v for k, v in self.components.items()))

    def __float__(self) -> float:  # code written for float rewards (e.g. SFT's evaluator) keeps working
        return self.total


def as_reward(value: Reward | float | int) -> Reward:
    """A `Reward` from what a scoring function returned: a Reward, or a number (component "reward")."""
    if isinstance(value, Reward):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a reward must be a number or a Reward, got {type(value).__name__}: {value!r}")
    return Reward({"reward": float(value)})


@dataclass
class Turn:
    """What an episode answers after a sampled turn: the environment's tokens and whether it ended.

    ``env_ids`` are appended after the sampled tokens (only when the episode goes on).
    """

    env_ids: list[int] = field(default_factory=list)
    done: bool = True


class Environment(Protocol):
    """A seeded, indexable, single-turn task (see the module docstring)."""

    name: str

    def example(self, index: int) -> Example:
        """The example at ``index``; a pure function of (the environment's seed, index)."""
        ...

    def score(self, example: Example, completion: str) -> Reward | float:
        """Reward of ``completion`` (decoded text, without eos) for ``example``."""
        ...

    def sft_completion(self, example: Example) -> str:
        """The completion the model should generate for ``example`` (without eos)."""
        ...


@runtime_checkable
class Episode(Protocol):
    """One rollout of a multi-turn environment, token in / token out (see the module docstring)."""

    def prompt_ids(self) -> list[int]:
        """Token ids of the first prompt."""
        ...

    def step(self, completion_ids: list[int], finish_reason: str) -> Turn:
        """React to a sampled turn (its token ids, the stop token included; finish_reason
        "stop" or "length"); return the environment's tokens and whether the episode is over."""
        ...

    def score(self) -> Reward | float:
        """The finished episode's reward."""
        ...

    # Optional: close() is called, from the runtime's thread and without waiting, when the episode
    # fails (an error or a timeout elsewhere), so an episode that owns a process can stop it.


class EpisodeEnvironment(Protocol):
    """A seeded, indexable, multi-turn task: ``episode`` starts one rollout of an example."""

    name: str

    def example(self, index: int) -> Example:
        ...

    def episode(self, example: Example, tokenizer: Any) -> Episode:
        ...


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a sampled turn: eos first, then the tokenizer's ``stop_tokens`` (a chat
    model's end-of-turn token beside its end of text; runtime/tokenizer.py says where they come from)."""
    ids = [tokenizer.eos_token_id]
    for token in getattr(tokenizer, "init_kwargs", {}).get("stop_tokens") or ():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def decode_reply(tokenizer: Any, completion_ids: list[int]) -> str:
    """A sampled turn as text, without the trailing stop token (eos or end of turn) the engine stopped on."""
    ids = list(completion_ids)
    if ids and ids[-1] in stop_token_ids(tokenizer):
        ids = ids[:-1]
    return tokenizer.decode(ids)


class SingleTurnEpisode:
    """A single-turn `Environment` as an episode: prompt, one sampled turn, ``env.score``."""

    def __init__(self, env: Environment, example: Example, tokenizer: Any):
        self.env, self.example, self.tokenizer = env, example, tokenizer
        self.completion: str | None = None

    def prompt_ids(self) -> list[int]:
        return self.tokenizer.encode(self.example.prompt, add_special_tokens=False)

    def step(self, completion_ids: list[int], finish_reason: str) -> Turn:
        self.completion = decode_reply(self.tokenizer, completion_ids)
        return Turn(done=True)

    def score(self) -> Reward:
        assert self.completion is not None, "score() before the episode's turn"
        return as_reward(self.env.score(self.example, self.completion))


def make_episode(env: Any, example: Example, tokenizer: Any) -> Episode:
    """The episode of ``example``: the environment's own, or a single-turn one around ``score``."""
    if hasattr(env, "episode"):
        return env.episode(example, tokenizer)
    return SingleTurnEpisode(env, example, tokenizer)


class TextEpisode:
    """Base of multi-turn episodes written in text; it does the token bookkeeping.

    Subclasses implement ``respond(reply)``: the environment's next message for the model's
    latest reply (decoded, eos stripped), or None to end the episode; and ``rewards()``. The
    first prompt is ``example.prompt``. An episode ends after ``max_turns`` sampled turns, and
    after a turn cut off by the token limit (``truncated``; the reply is incomplete).
    """

    def __init__(self, example: Example, tokenizer: Any, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.example, self.tokenizer, self.max_turns = example, tokenizer, max_turns
        self.replies: list[str] = []
        self.messages: list[str] = []  # the environment's messages after the first prompt
        self.truncated = False

    def prompt_ids(self) -> list[int]:
        return self.tokenizer.encode(self.example.prompt, add_special_tokens=False)

    def step(self, completion_ids: list[int], finish_reason: str) -> Turn:
        reply = decode_reply(self.tokenizer, completion_ids)
        self.replies.append(reply)
        if finish_reason != "stop":
            self.truncated = True
            return Turn(done=True)
        message = self.respond(reply)
        if message is None or len(self.replies) >= self.max_turns:
            return Turn(done=True)
        self.messages.append(message)
        return Turn(self.tokenizer.encode(message, add_special_tokens=False), done=False)

    def respond(self, reply: str) -> str | None:
        raise NotImplementedError

    def rewards(self) -> Reward:
        raise NotImplementedError

    def score(self) -> Reward:
        return self.rewards()
