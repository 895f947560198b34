"""Environments: the protocols (envs/base.py) and the built-in tasks, by name.

``make_env(name, **kwargs)`` builds one; "mix" takes ``envs=[(name, kwargs, weight), ...]``
(envs/mix.py) and "verifiers" wraps a verifiers taskset (envs/verifiers_adapter.py, imported
only when used).
"""

from typing import Any

from .alphabet_sort import AlphabetSortEnv
from .arithmetic import ArithmeticEnv
from .base import Environment, Episode, EpisodeEnvironment, Example, Reward, Turn, make_episode
from .calculator import CalculatorEnv
from .mix import MixedEnv
from .multiturn_sort import MultiTurnSortEnv
from .reverse_text import ReverseTextEnv
from .wordle import WordleEnv

__all__ = ["ENVIRONMENTS", "AlphabetSortEnv", "ArithmeticEnv", "CalculatorEnv", "Environment", "Episode",
           "EpisodeEnvironment", "Example", "MixedEnv", "MultiTurnSortEnv", "ReverseTextEnv", "Reward", "Turn",
           "WordleEnv", "make_env", "make_episode"]


def _verifiers_env(**kwargs: Any):
    from .verifiers_adapter import VerifiersEnv  # verifiers is an optional extra

    return VerifiersEnv(**kwargs)


def _mix(envs: list[tuple[str, dict, float]]) -> MixedEnv:
    return MixedEnv([(make_env(name, **kwargs), weight) for name, kwargs, weight in envs])


ENVIRONMENTS: dict[str, Any] = {
    "reverse-text": ReverseTextEnv,
    "alphabet-sort": AlphabetSortEnv,
    "multiturn-sort": MultiTurnSortEnv,
    "wordle": WordleEnv,
    "arithmetic": ArithmeticEnv,
    "calculator": CalculatorEnv,
    "verifiers": _verifiers_env,
    "mix": _mix,
}


def make_env(name: str, **kwargs: Any):
    """Build the environment registered as ``name`` with its constructor keyword arguments."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
