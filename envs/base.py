"""The environment protocol: where prompts come from and how completions are scored.

An environment is a deterministic, indexable task: ``example(index)`` depends only on the
environment's seed and ``index``, so the controller's dataset cursor is a single integer that
checkpoints and resumes trivially, and every rank can rebuild the same example. ``score``
turns one completion into a scalar reward; ``sft_completion`` gives the reference text used
for supervised warm-up.

This first version is single-turn and text-in/text-out: the controller tokenises the prompt,
the engine generates, the controller decodes the completion and scores it. Multi-turn and
token-level episodes come later (issue 5). The protocol is expected to grow by addition,
keeping the methods below: an episode object that receives completion *token ids* and returns
the next observation's token ids (so earlier turns are never re-tokenised), a per-episode
``done`` flag and per-turn rewards, and an adapter that wraps verifiers tasksets in this
protocol. Single-turn environments will keep working through a default episode that calls
``example`` and ``score``.
"""

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Example", "Environment"]


@dataclass
class Example:
    """One task instance: the prompt text, the reference answer and free-form metadata."""

    index: int
    prompt: str
    answer: str
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    """A seeded, indexable, single-turn task (see the module docstring)."""

    name: str

    def example(self, index: int) -> Example:
        """The example at ``index``; a pure function of (the environment's seed, index)."""
        ...

    def score(self, example: Example, completion: str) -> float:
        """Reward of ``completion`` (decoded text, without eos) for ``example``."""
        ...

    def sft_completion(self, example: Example) -> str:
        """The completion the model should generate for ``example`` (without eos)."""
        ...
