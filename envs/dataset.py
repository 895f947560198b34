"""dataset: RL on prompts from your own file, scored by a reward chosen by name.

Rows come from a JSONL file, a parquet file or a datasets save_to_disk folder (meshrl.data's
sources, the same as SFT's `[data]`). Example ``index`` is row ``order(index)``: every epoch visits
each row once in a seeded order (meshrl.data.order), so the controller's cursor resumes exactly.

Prompt: the ``prompt`` column, a string or a list of ``{role, content}`` messages. With ``chat``
(default "auto": when the tokenizer has a chat template) the prompt is rendered with the chat
template and its generation prompt (a string becomes one user message, after ``system_prompt``
if set); otherwise a string prompt is the model's input as it is.

Reward (``reward``):

- ``exact``: 1 when the completion, stripped, equals the answer column's value, stripped;
- ``math``: 1 when the completion's final answer (the last ``\\boxed{...}``, else the last number)
  equals the answer: numbers compare by value (``0.5`` = ``1/2`` = ``\\frac{1}{2}``, ``1,000`` =
  ``1000``), anything else as text with spaces, ``$`` and ``\\left``/``\\right`` removed;
  metric ``parsed`` says whether an answer was found;
- ``package.module:function``: a Python function named in *your config* (nothing read from a data
  file is ever imported or run). It is called as ``function(completion=..., **arguments)`` and
  returns a number or an envs.base.Reward. ``reward_args`` maps each argument name to the column
  it is read from (default: ``answer`` from the answer column when there is one).

The row's columns also travel in ``Example.info["row"]`` (shown in samples/).
"""

from __future__ import annotations

import importlib
import re
from fractions import Fraction
from typing import Any, Callable, Literal

from pydantic import field_validator

from meshrl.data.formats import chat_prompt, check_messages, read_template
from meshrl.data.order import EpochOrder
from meshrl.data.sources import RowError, columns_of, read_rows

from .base import Example, Reward, SingleTurnEpisode, as_reward
from .config import EnvConfigBase

__all__ = ["DatasetEnv", "DatasetEnvConfig", "check_dataset_envs", "exact_reward", "final_answer", "math_equal", "math_reward"]

BUILTIN_REWARDS = ("exact", "math")


class DatasetEnvConfig(EnvConfigBase):
    """Prompts (and answers) from your own file, a reward chosen by name (envs/dataset.py; docs/environments.md)."""

    name: Literal["dataset"] = "dataset"
    """Environment name."""
    path: str
    """A JSONL file, a parquet file, or a folder written by datasets' save_to_disk."""
    split: str | None = None
    """The split of a save_to_disk folder holding a DatasetDict (unset: "train")."""
    prompt: str = "prompt"
    """Column of the prompt: a string, or a list of {role, content} messages."""
    answer: str | None = "answer"
    """Column of the reference answer (exact and math rewards; the SFT completion); unset: none."""
    reward: str = "exact"
    """exact, math, or a Python function `package.module:function` (module docstring)."""
    reward_args: dict[str, str] = {}
    """A Python reward's keyword arguments: argument name -> the column it is read from
    (unset: answer = the answer column)."""
    chat: bool | Literal["auto"] = "auto"
    """Render prompts with the chat template and its generation prompt; auto: when there is a template."""
    chat_template: str | None = None
    """A Jinja chat template, or a path to a .jinja file, instead of the tokenizer's."""
    system_prompt: str | None = None
    """A system message put before a string prompt when it is rendered as a chat."""
    shuffle: bool = True
    """Visit the rows of every epoch in a new seeded order (else in file order)."""
    seed: int = 0
    """Seed of the row order."""
    on_error: Literal["fail", "skip"] = "fail"
    """A row without a usable prompt or answer: fail naming its file and line, or skip it."""

    @field_validator("reward")
    @classmethod
    def _reward_name(cls, value: str) -> str:
        if value not in BUILTIN_REWARDS and not re.fullmatch(r"[\w.]+:[\w.]+", value):
            raise ValueError(f"env.reward must be exact, math or package.module:function, got {value!r}")
        return value


class DatasetEnv:
    """Prompts from a file, a named reward; see the module docstring."""

    name = "dataset"

    def __init__(self, path: str, split: str | None = None, prompt: str = "prompt", answer: str | None = "answer",
                 reward: str = "exact", reward_args: dict[str, str] | None = None, chat: bool | str = "auto",
                 chat_template: str | None = None, system_prompt: str | None = None, shuffle: bool = True,
                 seed: int = 0, on_error: str = "fail"):
        self.prompt_column, self.answer_column = prompt, answer
        self.chat, self.template, self.system_prompt = chat, read_template(chat_template), system_prompt
        self.reward_name = reward
        self.reward_fn, self.reward_args = _reward_function(reward, reward_args or {}, answer)
        needed = [prompt] + ([answer] if answer else []) + sorted(set(self.reward_args.values()) - {answer})
        columns = columns_of(path, split)
        missing = [c for c in needed if c not in columns]
        if missing:
            raise ValueError(f"env.path: {path} has no column(s) {', '.join(missing)}; it has columns {columns}")
        self.rows = read_rows(path, split, on_error, "env.on_error", convert=self._check)
        self.order = EpochOrder(len(self.rows.rows), seed, shuffle)

    def _check(self, row: dict[str, Any]) -> dict[str, Any]:
        value = row.get(self.prompt_column)
        if isinstance(value, list):
            check_messages(value, self.prompt_column)
        elif not isinstance(value, str) or not value:
            raise RowError(f"{self.prompt_column!r} must be a non-empty string or a list of messages, got {value!r}")
        for column in ([self.answer_column] if self.answer_column else []) + list(self.reward_args.values()):
            if row.get(column) is None:
                raise RowError(f"{column!r} is missing")
        return row

    def __len__(self) -> int:
        return len(self.rows.rows)

    def example(self, index: int) -> Example:
        """Row order(index): prompt text (a chat shown as "role: content" lines), answer, the row in info."""
        row = self.rows.rows[self.order.row(index)]
        value = row[self.prompt_column]
        text = value if isinstance(value, str) else "\n".join(f"{m['role']}: {m['content']}" for m in value)
        answer = "" if self.answer_column is None else str(row[self.answer_column])
        return Example(index=index, prompt=text, answer=answer, info={"row": row})

    def messages(self, example: Example) -> list[dict[str, Any]]:
        """The example's prompt as a chat."""
        value = example.info["row"][self.prompt_column]
        if isinstance(value, list):
            return value
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": value}]

    def episode(self, example: Example, tokenizer: Any) -> "DatasetEpisode":
        return DatasetEpisode(self, example, tokenizer)

    def uses_chat(self, tokenizer: Any) -> bool:
        if self.chat == "auto":
            return self.template is not None or bool(getattr(tokenizer, "chat_template", None))
        return bool(self.chat)

    def score(self, example: Example, completion: str) -> Reward:
        if self.reward_name == "exact":
            return Reward({"exact": exact_reward(completion, example.answer)})
        if self.reward_name == "math":
            return math_reward(completion, example.answer)
        row = example.info["row"]
        return as_reward(self.reward_fn(completion=completion, **{k: row[c] for k, c in self.reward_args.items()}))

    def sft_completion(self, example: Example) -> str:
        """The answer column's value (the model appends eos)."""
        return example.answer


class DatasetEpisode(SingleTurnEpisode):
    """One turn whose prompt is rendered with the chat template when the environment uses one."""

    def prompt_ids(self) -> list[int]:
        env, tok = self.env, self.tokenizer
        if not env.uses_chat(tok):
            if not isinstance(self.example.info["row"][env.prompt_column], str):
                raise ValueError("a chat prompt needs a chat template: the tokenizer has none (set env.chat_template)")
            return tok.encode(self.example.prompt, add_special_tokens=False)
        text = chat_prompt(tok, env.messages(self.example), env.template)
        return tok.encode(text, add_special_tokens=False)


def _reward_function(name: str, reward_args: dict[str, str], answer: str | None):
    """(the function of a Python reward or None, its argument -> column map)."""
    if name in BUILTIN_REWARDS:
        if reward_args:
            raise ValueError(f"env.reward_args apply to a Python reward function, not {name!r}")
        if answer is None:
            raise ValueError(f"env.reward = {name!r} compares with the answer column: set env.answer")
        return None, {}
    module_name, attr = name.split(":", 1)
    try:
        fn: Callable[..., Any] = importlib.import_module(module_name)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.reward: cannot load {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"env.reward: {name!r} is not a function")
    return fn, dict(reward_args) if reward_args else ({"answer": answer} if answer else {})


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return float(completion.strip() == answer.strip())


_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}$")


def final_answer(completion: str) -> str | None:
    """The last \\boxed{...} (braces balanced), else the last number in the text, else None."""
    start = completion.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[j], 0)
            if depth == 0:
                return completion[i:j].strip()
        return None
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    t = text.strip().rstrip(".").replace(",", "").replace(" ", "").replace("$", "")
    frac = _FRAC.match(t)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    if re.fullmatch(r"-?\d+(\.\d+)?|-?\.\d+", t):
        return Fraction(t)
    if re.fullmatch(r"-?\d+/\d+", t) and not t.endswith("/0"):
        return Fraction(t)
    return None


def _normalize(text: str) -> str:
    t = text.strip().rstrip(".").replace("$", "").replace("\\left", "").replace("\\right", "")
    return re.sub(r"\s+|\\!|\\,", "", t).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def math_equal(predicted: str, answer: str) -> bool:
    """Whether two final answers agree: by value when both are numbers, else as normalised text."""
    a, b = _as_number(predicted), _as_number(answer)
    if a is not None and b is not None:
        return a == b
    return _normalize(predicted) == _normalize(answer)


def math_reward(completion: str, answer: str) -> Reward:
    """``correct`` (1 or 0) with the ``parsed`` metric (a final answer was found)."""
    predicted = final_answer(completion)
    correct = predicted is not None and math_equal(predicted, answer)
    return Reward({"correct": float(correct)}, metrics={"parsed": float(predicted is not None)})


def check_dataset_envs(*configs: Any) -> None:
    """Before launch: build every `dataset` environment among ``configs`` (a mix's members too, None
    skipped), so a missing file or column, a malformed row or an unloadable reward fails at once."""
    for cfg in configs:
        if cfg is None:
            continue
        if cfg.name == "mix":
            check_dataset_envs(*cfg.envs)
        elif cfg.name == "dataset":
            DatasetEnv(**cfg.kwargs())
