"""reverse-text: reverse a string of random lowercase words, character by character.

Data are synthetic and seeded (no files, no hub): example ``index`` draws between
``min_words`` and ``max_words`` words of random lowercase letters, each between
``min_word_len`` and ``max_word_len`` long, joined by single spaces.

Prompt format, chosen for char-level models (every prompt character costs a token and a
single-task model gains nothing from an instruction): the text followed by a newline,

    prompt      "abc de\\n"
    completion  "ed cba"        (the model then emits eos)

Reward: one component, ``lcs`` = LCS(parsed, answer) / max(len(parsed), len(answer)) in [0, 1],
where ``parsed`` is the completion stripped of surrounding whitespace and cut at its first newline
and LCS is the length of the longest common subsequence. It is 1 exactly when ``parsed ==
answer``, and a dropped or an added character costs as much as a wrong one: for the answer "mma",
"ma", "mmaa" and "mmm" score 2/3, 3/4 and 2/3, never more than the right length with the same
characters would. (``difflib``'s ratio 2*M/(len(a)+len(b)), the reward before, paid for dropping
characters: "ma" scored 0.8 there, and RL learned to answer short.)

Metrics beside it: ``exact`` (1 when parsed == answer; pass@1 of `meshrl eval` with
``pass_threshold = 1`` counts the same thing) and ``length_ratio`` = len(parsed) / len(answer),
which stays near 1 for a policy that learns the task rather than the reward.
"""

import random
import string
from typing import Literal

from pydantic import Field, model_validator

from .base import Example, Reward
from .config import EnvConfigBase
from .synthetic import first_line

__all__ = ["ReverseTextEnv", "ReverseTextEnvConfig", "lcs_length", "lcs_reward"]


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

    def score(self, example: Example, completion: str) -> Reward:
        """``lcs`` reward in [0, 1], with the ``exact`` and ``length_ratio`` metrics (module docstring)."""
        parsed = first_line(completion)
        answer = example.answer
        return Reward({"lcs": lcs_reward(parsed, answer)},
                      metrics={"exact": float(parsed == answer), "length_ratio": len(parsed) / len(answer)})

    def sft_completion(self, example: Example) -> str:
        """The reversed text (the model appends eos)."""
        return example.answer


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (dynamic programming, one row)."""
    row = [0] * (len(b) + 1)
    for ca in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, cb in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if ca == cb else max(row[j], row[j - 1])
    return row[-1]


def lcs_reward(parsed: str, answer: str) -> float:
    """LCS(parsed, answer) / max(len(parsed), len(answer)); 1.0 when both are empty."""
    longest = max(len(parsed), len(answer))
    return lcs_length(parsed, answer) / longest if longest else 1.0


def _check_range(what: str, low: int, high: int) -> None:
    """ValueError unless 1 <= low <= high."""
    if low < 1 or high < low:
        raise ValueError(f"{what}: need 1 <= min <= max, got min={low}, max={high}")
