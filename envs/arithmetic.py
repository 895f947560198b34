"""arithmetic: integer arithmetic, as bare expressions or short word problems, checked exactly.

Data are synthetic and seeded. ``style="expression"``: ``num_ops`` operations (+, -, *) over
integers in [min_value, max_value], evaluated with the usual precedence:

    prompt "12+7*3=\\n"      completion "33"

``style="word"``: one of a few templates (add, take away, groups of, share equally, two steps)
with names and objects drawn from short lists; every answer is a non-negative integer:

    prompt "Ann has 4 pears. She gets 3 more. How many pears does Ann have now?\\n"   completion "7"

Verifier: the last integer written in the completion (commas ignored) must equal the answer.
Reward component ``correct`` (1 or 0); metric ``parsed`` (the completion holds an integer).
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from .base import Example, Reward
from .config import EnvConfigBase
from .synthetic import check_range, example_rng, last_integer

__all__ = ["ArithmeticEnv", "ArithmeticEnvConfig"]

_NAMES = ("Ann", "Bo", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo")
_PRONOUNS = {"Ann": "She", "Bo": "He", "Cai": "He", "Dee": "She", "Eli": "He", "Fay": "She", "Gus": "He",
             "Hal": "He", "Ivy": "She", "Jo": "She"}
_ITEMS = ("apples", "pears", "coins", "cards", "books", "shells", "stamps", "marbles")


def _word_problem(rng: random.Random, low: int, high: int) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    she = _PRONOUNS[name]
    a, b = rng.randint(low, high), rng.randint(low, high)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{name} has {a} {item}. {she} gets {b} more. How many {item} does {name} have now?", a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {item} and gives {b} away. How many {item} are left?", a - b
    if kind == 2:
        return f"{name} buys {a} bags with {b} {item} in each bag. How many {item} is that?", a * b
    if kind == 3:
        return (f"{name} shares {a * b} {item} equally among {b} friends. "
                f"How many {item} does each friend get?"), a
    c = rng.randint(0, a + b)
    return f"{name} has {a} {item}, finds {b} more and loses {c}. How many {item} are left?", a + b - c


def _expression(rng: random.Random, low: int, high: int, num_ops: int) -> tuple[str, int]:
    parts = [str(rng.randint(low, high))]
    for _ in range(num_ops):
        parts += [rng.choice("+-*"), str(rng.randint(low, high))]
    text = "".join(parts)
    # Only digits and + - * reach eval (built here, never model output): precedence as written.
    return f"{text}=", eval(text, {"__builtins__": {}}, {})  # noqa: S307


class ArithmeticEnvConfig(EnvConfigBase):
    """Integer arithmetic, as expressions or word problems, with an exact-answer verifier (envs/arithmetic.py)."""

    name: Literal["arithmetic"] = "arithmetic"
    """Environment name."""
    seed: int = 0
    """Seed of the synthetic data set."""
    style: Literal["expression", "word"] = "expression"
    """Bare expressions ("12+7=") or short word problems."""
    min_value: int = Field(1, ge=0)
    """Smallest operand."""
    max_value: int = Field(20, ge=0)
    """Largest operand."""
    num_ops: int = Field(1, ge=1)
    """Operations per expression (style = "expression")."""
    weights: dict[str, float] = {}
    """Weights of reward components by name (correct)."""


class ArithmeticEnv:
    """Seeded arithmetic / word problems with an exact-answer verifier; see the module docstring."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, style: str = "expression", min_value: int = 1, max_value: int = 20,
                 num_ops: int = 1, weights: dict[str, float] | None = None):
        if style not in ("expression", "word"):
            raise ValueError(f"style must be 'expression' or 'word', got {style!r}")
        check_range("value", min_value, max_value, minimum=0)
        if num_ops < 1:
            raise ValueError(f"num_ops must be >= 1, got {num_ops}")
        example_rng(self.name, seed, 0)
        self.seed, self.style, self.num_ops = seed, style, num_ops
        self.min_value, self.max_value = min_value, max_value
        self.weights = dict(weights or {})

    def example(self, index: int) -> Example:
        rng = example_rng(f"{self.name}-{self.style}", self.seed, index)
        if self.style == "word":
            question, answer = _word_problem(rng, self.min_value, self.max_value)
        else:
            question, answer = _expression(rng, self.min_value, self.max_value, self.num_ops)
        return Example(index=index, prompt=f"{question}\n", answer=str(answer), info={})

    def score(self, example: Example, completion: str) -> Reward:
        value = last_integer(completion)
        correct = value is not None and str(value) == example.answer
        return Reward({"correct": float(correct)}, self.weights, {"parsed": float(value is not None)})

    def sft_completion(self, example: Example) -> str:
        return example.answer
