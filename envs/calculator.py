"""calculator: arithmetic with a calculator tool the model calls over several turns.

Data are synthetic and seeded: ``num_ops`` operations (+, -, *) over integers in
[min_value, max_value]. Call format (documented in docs/environments.md):

    prompt        "calc: 347*29+18\\n"
    model         "CALL 347*29"<eos>          a reply whose first line starts with "CALL " is a call
    environment   "= 10063\\n"                 the tool's result (environment tokens, not trained on)
    model         "CALL 10063+18"<eos>
    environment   "= 10081\\n"
    model         "10081"<eos>                any other reply is the final answer: its last integer

A call's expression may hold digits, spaces, ``+ - * / % ( ) .`` and at most 64 characters;
anything else gets "error: ...\\n" without running. An allowed expression is evaluated by a
separate Python process (envs/sandbox.py: time and memory limits, no network, empty
environment), because it is model output: ``9**9**9`` must not hang or exhaust the controller.
An expression that raises (``1/0``) gets "error: <the exception>\\n", a result the model reads;
a call that exceeds the tool's time or memory limit fails the whole rollout (counted in
rollouts/failed, excluded from training). After ``max_tool_calls`` calls the next reply ends
the episode, whatever it is.

With ``instructions = true`` the prompt starts with one line explaining the format (for
pretrained chat models; char-level models learn the format from reward alone, or not).

Reward component ``correct`` (final answer equals the value); metrics ``tool_calls``,
``tool_errors``, ``answered`` (the episode ended with an answer).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from .base import Example, Reward, TextEpisode
from .config import EnvConfigBase
from .sandbox import SandboxLimits, run_python
from .synthetic import check_range, example_rng, first_line, last_integer

__all__ = ["CalculatorEnv", "CalculatorEnvConfig", "CALL_PREFIX"]

CALL_PREFIX = "CALL "
INSTRUCTIONS = "Use the calculator by replying CALL <expression>; reply with the number when you know it.\n"
_ALLOWED = re.compile(r"[0-9+\-*/%(). ]{1,64}")
# Reads the expression from stdin (no quoting of model output into code) and prints its value.
_PROGRAM = "import sys\nprint(eval(sys.stdin.read(), {'__builtins__': {}}, {}))\n"


def run_calculator(expression: str, limits: SandboxLimits) -> str:
    """The tool: the value of ``expression`` as text, or "error: ..."; SandboxError past the limits."""
    expression = expression.strip()
    if not _ALLOWED.fullmatch(expression):
        return "error: only numbers, spaces and + - * / % ( ) . are allowed, at most 64 characters"
    result = run_python(_PROGRAM, limits, stdin=expression)
    if not result.ok:
        last = result.stderr.strip().splitlines()[-1:] or ["the expression failed"]
        return f"error: {last[0][:120]}"
    return result.stdout.strip()[:120]


class CalculatorEnvConfig(EnvConfigBase):
    """Tool use: arithmetic with a calculator the model calls over several turns (envs/calculator.py)."""

    name: Literal["calculator"] = "calculator"
    """Environment name."""
    seed: int = 0
    """Seed of the synthetic data set."""
    min_value: int = Field(10, ge=0)
    """Smallest operand."""
    max_value: int = Field(999, ge=0)
    """Largest operand."""
    num_ops: int = Field(2, ge=1)
    """Operations per problem."""
    max_tool_calls: int = Field(3, ge=0)
    """Calculator calls per episode."""
    instructions: bool = False
    """Start the prompt with one line explaining the call format (for pretrained chat models)."""
    tool_timeout_s: float = Field(2.0, gt=0)
    """Time limit of one calculator call (its own process); past it the rollout fails."""
    tool_memory_mb: int = Field(128, ge=16)
    """Address-space limit of one calculator call; past it the rollout fails."""
    weights: dict[str, float] = {}
    """Weights of reward components by name (correct)."""


class CalculatorEnv:
    """Seeded tool-use task; see the module docstring."""

    name = "calculator"

    def __init__(self, seed: int = 0, min_value: int = 10, max_value: int = 999, num_ops: int = 2,
                 max_tool_calls: int = 3, instructions: bool = False, tool_timeout_s: float = 2.0,
                 tool_memory_mb: int = 128, weights: dict[str, float] | None = None):
        check_range("value", min_value, max_value, minimum=0)
        if num_ops < 1 or max_tool_calls < 0:
            raise ValueError(f"need num_ops >= 1 and max_tool_calls >= 0, got {num_ops}, {max_tool_calls}")
        example_rng(self.name, seed, 0)
        self.seed, self.num_ops, self.max_tool_calls = seed, num_ops, max_tool_calls
        self.min_value, self.max_value = min_value, max_value
        self.instructions = instructions
        self.limits = SandboxLimits(timeout_s=tool_timeout_s, memory_mb=tool_memory_mb)
        self.weights = dict(weights or {})

    def example(self, index: int) -> Example:
        rng = example_rng(self.name, self.seed, index)
        parts = [str(rng.randint(self.min_value, self.max_value))]
        for _ in range(self.num_ops):
            parts += [rng.choice("+-*"), str(rng.randint(self.min_value, self.max_value))]
        expression = "".join(parts)
        value = eval(expression, {"__builtins__": {}}, {})  # noqa: S307 - built here from digits and + - *
        prefix = INSTRUCTIONS if self.instructions else ""
        return Example(index=index, prompt=f"{prefix}calc: {expression}\n", answer=str(value),
                       info={"expression": expression})

    def episode(self, example: Example, tokenizer: Any) -> "CalculatorEpisode":
        return CalculatorEpisode(example, tokenizer, self.max_tool_calls, self.limits, self.weights)


class CalculatorEpisode(TextEpisode):
    def __init__(self, example: Example, tokenizer: Any, max_tool_calls: int, limits: SandboxLimits,
                 weights: dict[str, float]):
        super().__init__(example, tokenizer, max_turns=max_tool_calls + 1)
        self.limits, self.weights, self.max_tool_calls = limits, weights, max_tool_calls
        self.calls = 0
        self.errors = 0
        self.answer: str | None = None

    def respond(self, reply: str) -> str | None:
        line = first_line(reply)
        if not line.startswith(CALL_PREFIX):
            self.answer = reply
            return None
        if self.calls >= self.max_tool_calls:  # out of calls: the episode ends unanswered
            return None
        self.calls += 1
        result = run_calculator(line[len(CALL_PREFIX):], self.limits)  # SandboxError fails the rollout
        self.errors += result.startswith("error:")
        return f"= {result}\n" if not result.startswith("error:") else f"{result}\n"

    def rewards(self) -> Reward:
        value = last_integer(self.answer) if self.answer is not None else None
        correct = value is not None and str(value) == self.example.answer
        return Reward({"correct": float(correct)}, self.weights,
                      {"tool_calls": float(self.calls), "tool_errors": float(self.errors),
                       "answered": float(self.answer is not None)})
