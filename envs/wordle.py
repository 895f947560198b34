"""wordle: guess a secret five-letter word in a few turns, with letter feedback after each guess.

The secret of example ``index`` is drawn (seeded) from the word list shipped in the package
(envs/wordle_words.py). Turn format:

    prompt        "wordle:\\n"
    model         "crane"<eos>                  (the first line of the reply is the guess)
    environment   "crane .Y..G\\n"              (the guess and one mark per letter)

Marks: ``G`` right letter in the right place, ``Y`` in the word but elsewhere, ``.`` not in
the word (or not that many times: a letter is marked Y at most as often as the secret holds
it beyond its G marks, left to right). A guess that is not five letters a-z gets
"invalid\\n" and still counts as a turn. The episode ends when the word is found or after
``max_turns`` guesses.

Reward components: ``solved`` (1 if found; weight 1) and ``letters`` (best guess's
(G + Y/2) / 5; weight 0.2 by default, a denser signal for small models). Metrics: ``turns``,
``valid_fraction`` (share of well-formed guesses).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from pydantic import Field

from .base import Example, Reward, TextEpisode
from .config import EnvConfigBase
from .synthetic import example_rng, first_line
from .wordle_words import WORDS

__all__ = ["WordleEnv", "WordleEnvConfig", "feedback"]

DEFAULT_WEIGHTS = {"solved": 1.0, "letters": 0.2}


def feedback(guess: str, secret: str) -> str:
    """The marks of ``guess`` against ``secret`` (both five lowercase letters); see the module docstring."""
    marks = ["."] * len(secret)
    left = Counter(s for g, s in zip(guess, secret) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i] = "G"
        elif left[g] > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


def _valid(guess: str) -> bool:
    return len(guess) == 5 and guess.isascii() and guess.isalpha() and guess.islower()


class WordleEnvConfig(EnvConfigBase):
    """Guess a five-letter word with letter feedback, over several turns (envs/wordle.py)."""

    name: Literal["wordle"] = "wordle"
    """Environment name."""
    seed: int = 0
    """Seed of the secret words."""
    max_turns: int = Field(6, ge=1)
    """Guesses per episode."""
    weights: dict[str, float] = {}
    """Weights of reward components by name (solved: 1, letters: 0.2 unless set)."""


class WordleEnv:
    """Seeded wordle; see the module docstring."""

    name = "wordle"

    def __init__(self, seed: int = 0, max_turns: int = 6, weights: dict[str, float] | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        example_rng(self.name, seed, 0)
        self.seed, self.max_turns = seed, max_turns
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}

    def example(self, index: int) -> Example:
        secret = example_rng(self.name, self.seed, index).choice(WORDS)
        return Example(index=index, prompt="wordle:\n", answer=secret, info={})

    def episode(self, example: Example, tokenizer: Any) -> "WordleEpisode":
        return WordleEpisode(example, tokenizer, self.max_turns, self.weights)


class WordleEpisode(TextEpisode):
    def __init__(self, example: Example, tokenizer: Any, max_turns: int, weights: dict[str, float]):
        super().__init__(example, tokenizer, max_turns)
        self.weights = weights
        self.marks: list[str | None] = []  # per guess; None for an invalid one

    def respond(self, reply: str) -> str | None:
        guess = first_line(reply).lower()
        if not _valid(guess):
            self.marks.append(None)
            return "invalid\n"
        marks = feedback(guess, self.example.answer)
        self.marks.append(marks)
        return None if marks == "GGGGG" else f"{guess} {marks}\n"

    def rewards(self) -> Reward:
        valid = [m for m in self.marks if m is not None]
        solved = float("GGGGG" in valid)
        letters = max(((m.count("G") + 0.5 * m.count("Y")) / 5 for m in valid), default=0.0)
        turns = len(self.replies)
        return Reward({"solved": solved, "letters": letters}, self.weights,
                      {"turns": float(turns), "valid_fraction": len(valid) / max(turns, 1)})
