"""multiturn-sort: keep a growing list of words sorted, over several turns.

Turn 1 gives ``min_words``..``max_words`` random words; every later turn adds
``words_per_turn`` more, and after each turn the model must answer the whole list so far,
sorted. Data are synthetic and seeded (example ``index`` fixes every turn's words).

    prompt (turn 1)   "sort: dog ant\\n"           model: "ant dog"<eos>
    environment       "add: cow\\n"                model: "ant cow dog"<eos>
    environment       "add: bee\\n"                model: "ant bee cow dog"<eos>

The environment's lines are environment tokens (context, not trained on); each sampled reply
ends with eos. Reward: ``similarity`` = the mean over the ``num_turns`` turns of the
``difflib.SequenceMatcher`` ratio between the reply's first line and that turn's sorted list
(a turn never reached scores 0). Metrics: ``exact_turns`` (fraction of turns answered
exactly), ``final_similarity`` (of the last turn), ``turns`` (turns played).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field

from .base import Example, Reward, TextEpisode
from .config import EnvConfigBase
from .synthetic import check_range, example_rng, first_line, random_words

__all__ = ["MultiTurnSortEnv", "MultiTurnSortEnvConfig"]


class MultiTurnSortEnvConfig(EnvConfigBase):
    """Keep a list sorted while it grows each turn; per-turn similarity reward (envs/multiturn_sort.py)."""

    name: Literal["multiturn-sort"] = "multiturn-sort"
    """Environment name."""
    seed: int = 0
    """Seed of the synthetic data set."""
    num_turns: int = Field(3, ge=1)
    """Turns per episode."""
    min_words: int = Field(2, ge=1)
    """Fewest words in the first turn."""
    max_words: int = Field(3, ge=1)
    """Most words in the first turn."""
    words_per_turn: int = Field(1, ge=1)
    """Words added by each later turn."""
    min_word_len: int = Field(3, ge=1)
    """Shortest word."""
    max_word_len: int = Field(5, ge=1)
    """Longest word."""
    weights: dict[str, float] = {}
    """Weights of reward components by name (similarity)."""


class MultiTurnSortEnv:
    """Seeded multi-turn sorting task; see the module docstring."""

    name = "multiturn-sort"

    def __init__(self, seed: int = 0, num_turns: int = 3, min_words: int = 2, max_words: int = 3,
                 words_per_turn: int = 1, min_word_len: int = 3, max_word_len: int = 5,
                 weights: dict[str, float] | None = None):
        check_range("num words", min_words, max_words)
        check_range("word length", min_word_len, max_word_len)
        if num_turns < 1 or words_per_turn < 1:
            raise ValueError(f"num_turns and words_per_turn must be >= 1, got {num_turns}, {words_per_turn}")
        example_rng(self.name, seed, 0)
        self.seed, self.num_turns, self.words_per_turn = seed, num_turns, words_per_turn
        self.min_words, self.max_words = min_words, max_words
        self.min_word_len, self.max_word_len = min_word_len, max_word_len
        self.weights = dict(weights or {})

    def example(self, index: int) -> Example:
        rng = example_rng(self.name, self.seed, index)
        turns = [random_words(rng, rng.randint(self.min_words, self.max_words), self.min_word_len, self.max_word_len)]
        for _ in range(self.num_turns - 1):
            turns.append(random_words(rng, self.words_per_turn, self.min_word_len, self.max_word_len))
        answers, seen = [], []
        for words in turns:
            seen = seen + words
            answers.append(" ".join(sorted(seen)))
        return Example(index=index, prompt=f"sort: {' '.join(turns[0])}\n", answer=answers[-1],
                       info={"turns": turns, "answers": answers})

    def episode(self, example: Example, tokenizer: Any) -> "MultiTurnSortEpisode":
        return MultiTurnSortEpisode(example, tokenizer, self.num_turns, self.weights)


class MultiTurnSortEpisode(TextEpisode):
    def __init__(self, example: Example, tokenizer: Any, num_turns: int, weights: dict[str, float]):
        super().__init__(example, tokenizer, max_turns=num_turns)
        self.weights = weights

    def respond(self, reply: str) -> str | None:
        turn = len(self.replies) - 1  # the reply being answered
        turns = self.example.info["turns"]
        return f"add: {' '.join(turns[turn + 1])}\n" if turn + 1 < len(turns) else None

    def rewards(self) -> Reward:
        answers = self.example.info["answers"]
        n = len(answers)
        parsed = [first_line(r) for r in self.replies[:n]]
        sims = [difflib.SequenceMatcher(None, p, a).ratio() for p, a in zip(parsed, answers)]
        sims += [0.0] * (n - len(sims))
        exact = sum(p == a for p, a in zip(parsed, answers))
        return Reward({"similarity": sum(sims) / n}, self.weights,
                      {"exact_turns": exact / n, "final_similarity": sims[-1], "turns": float(len(self.replies))})
