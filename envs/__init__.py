"""Environments: the protocols (envs/base.py), the built-in tasks and their registry.

envs/registry.py holds the one table name -> (config class, constructor); `make_env(name,
**kwargs)` builds one, and `EnvConfig` is the union of the config classes that runtime/config.py
uses. "mix" takes ``envs=[(name, kwargs, weight), ...]`` (envs/mix.py) and "verifiers" wraps a
verifiers taskset (envs/verifiers_adapter.py, imported only when used).
"""

from .alphabet_sort import AlphabetSortEnv
from .arithmetic import ArithmeticEnv
from .base import Environment, Episode, EpisodeEnvironment, Example, Reward, Turn, make_episode
from .calculator import CalculatorEnv
from .mix import MixedEnv
from .multiturn_sort import MultiTurnSortEnv
from .registry import ENV_NAMES, ENVIRONMENTS, REGISTRY, EnvConfig, SingleEnvConfig, make_env
from .reverse_text import ReverseTextEnv
from .wordle import WordleEnv

__all__ = ["ENVIRONMENTS", "ENV_NAMES", "REGISTRY", "AlphabetSortEnv", "ArithmeticEnv", "CalculatorEnv", "EnvConfig",
           "Environment", "Episode", "EpisodeEnvironment", "Example", "MixedEnv", "MultiTurnSortEnv",
           "ReverseTextEnv", "Reward", "SingleEnvConfig", "Turn", "WordleEnv", "make_env", "make_episode"]
