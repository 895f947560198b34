"""reverse-text: reverse a string of random lowercase words, character by character.

Data are synthetic and seeded (no files, no hub): example ``index`` draws between
``min_words`` and ``max_words`` words of random lowercase letters, each between
``min_word_len`` and ``max_word_len`` long, joined by single spaces.

Prompt format, chosen for char-level models (every prompt character costs a token and a
single-task model gains nothing from an instruction): the text followed by a newline,

    prompt      "abc de\\n"
    completion  "ed cba"        (the model then emits eos)

Reward: ``difflib.SequenceMatcher(None, parsed, answer).ratio()`` in [0, 1], where
``parsed`` is the completion stripped of surrounding whitespace and cut at its first newline.
"""

import difflib
import random
import string
from typing import Literal

from pydantic import Field, model_validator

from .base import Example
from .config import EnvConfigBase

__all__ = ["ReverseTextEnv", "ReverseTextEnvConfig"]


class ReverseTextEnvConfig(EnvConfigBase):
    """Reverse a few random words character by character (built in, seeded, no hub)."""

    name: Literal["reverse-text"] = "reverse-text"
    """Environment name."""
    seed: int = 0
    """Seed of the synthetic data set (example i is a pure function of seed and i)."""
    min_words: int = Field(1, ge=1)
    """Fewest words in a prompt."""
    max_words: int = Field(1, ge=1)
    """Most words in a prompt."""
    min_word_len: int = Field(3, ge=1)
    """Shortest word."""
    max_word_len: int = Field(6, ge=1)
    """Longest word."""

    @model_validator(mode="after")
    def _ranges(self) -> "ReverseTextEnvConfig":
        if self.min_words > self.max_words:
            raise ValueError(f"env.min_words ({self.min_words}) > env.max_words ({self.max_words})")
        if self.min_word_len > self.max_word_len:
            raise ValueError(f"env.min_word_len ({self.min_word_len}) > env.max_word_len ({self.max_word_len})")
        return self


class ReverseTextEnv:
    """Seeded reverse-text task; see the module docstring for the data, format and reward."""

    name = "reverse-text"

    def __init__(self, seed: int, min_words: int, max_words: int, min_word_len: int, max_word_len: int):
        _check_range("num words", min_words, max_words)
        _check_range("word length", min_word_len, max_word_len)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self.min_words, self.max_words = min_words, max_words
        self.min_word_len, self.max_word_len = min_word_len, max_word_len

    def example(self, index: int) -> Example:
        """The example at ``index``, a pure function of (seed, index)."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        # A string seed is hashed with SHA-512 by `random`, the same in every process.
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        num_words = rng.randint(self.min_words, self.max_words)
        words = [
            "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_word_len, self.max_word_len)))
            for _ in range(num_words)
        ]
        text = " ".join(words)
        return Example(index=index, prompt=f"{text}\n", answer=text[::-1], info={"text": text, "num_words": num_words})

    def score(self, example: Example, completion: str) -> float:
        """Similarity ratio in [0, 1] between the parsed completion and the reversed text."""
        parsed = completion.strip().split("\n", 1)[0].strip()
        return difflib.SequenceMatcher(None, parsed, example.answer).ratio()

    def sft_completion(self, example: Example) -> str:
        """The reversed text (the model appends eos)."""
        return example.answer


def _check_range(what: str, low: int, high: int) -> None:
    """ValueError unless 1 <= low <= high."""
    if low < 1 or high < low:
        raise ValueError(f"{what}: need 1 <= min <= max, got min={low}, max={high}")
