"""alphabet-sort: sort a few random lowercase words alphabetically (single turn).

Data are synthetic and seeded: example ``index`` draws ``min_words``..``max_words`` words of
random letters, each ``min_word_len``..``max_word_len`` long.

Format (short, for char-level models; the "sort:" tag tells the task apart in a mix):

    prompt      "sort: dog ant cow\\n"
    completion  "ant cow dog"            (then eos)

Reward: one component, ``similarity`` = ``difflib.SequenceMatcher`` ratio in [0, 1] between
the first line of the completion and the sorted words joined by single spaces. Metric
``exact``: 1 when they are equal.
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field

from .base import Example, Reward
from .config import EnvConfigBase
from .synthetic import check_range, example_rng, first_line, random_words

__all__ = ["AlphabetSortEnv", "AlphabetSortEnvConfig"]


class AlphabetSortEnvConfig(EnvConfigBase):
    """Sort a few random words alphabetically (built in, seeded; envs/alphabet_sort.py)."""

    name: Literal["alphabet-sort"] = "alphabet-sort"
    """Environment name."""
    seed: int = 0
    """Seed of the synthetic data set."""
    min_words: int = Field(2, ge=1)
    """Fewest words in a prompt."""
    max_words: int = Field(4, ge=1)
    """Most words in a prompt."""
    min_word_len: int = Field(3, ge=1)
    """Shortest word."""
    max_word_len: int = Field(6, ge=1)
    """Longest word."""
    weights: dict[str, float] = {}
    """Weights of reward components by name (similarity); unset ones weigh 1."""


class AlphabetSortEnv:
    """Seeded alphabet-sort task; see the module docstring."""

    name = "alphabet-sort"

    def __init__(self, seed: int = 0, min_words: int = 2, max_words: int = 4, min_word_len: int = 3,
                 max_word_len: int = 6, weights: dict[str, float] | None = None):
        check_range("num words", min_words, max_words)
        check_range("word length", min_word_len, max_word_len)
        example_rng(self.name, seed, 0)  # validates the seed
        self.seed = seed
        self.min_words, self.max_words = min_words, max_words
        self.min_word_len, self.max_word_len = min_word_len, max_word_len
        self.weights = dict(weights or {})

    def example(self, index: int) -> Example:
        rng = example_rng(self.name, self.seed, index)
        words = random_words(rng, rng.randint(self.min_words, self.max_words), self.min_word_len, self.max_word_len)
        return Example(index=index, prompt=f"sort: {' '.join(words)}\n", answer=" ".join(sorted(words)),
                       info={"words": words})

    def score(self, example: Example, completion: str) -> Reward:
        parsed = first_line(completion)
        similarity = difflib.SequenceMatcher(None, parsed, example.answer).ratio()
        return Reward({"similarity": similarity}, self.weights, {"exact": float(parsed == example.answer)})

    def sft_completion(self, example: Example) -> str:
        return example.answer
