"""The one table of environments: name -> (config class, constructor).

Everything else about "which environments exist" is derived from `REGISTRY`:

- `EnvConfig`, the union of the config classes tagged by their ``name`` field, which
  runtime/config.py uses for ``env``, ``eval.env`` (and ``meshrl sft``/``eval``'s ``env``);
- `SingleEnvConfig`, the same without "mix", for the ``[[env.envs]]`` of a mix;
- `ENV_NAMES`, the tags (runtime/config.py drops them from error locations);
- `ENVIRONMENTS` (name -> constructor) and `make_env`.

A config class declares ``name: Literal[key] = key`` and one field per keyword argument of its
constructor: ``make_env(cfg.name, **cfg.kwargs())`` builds the environment a config describes.
Adding an environment is one file in envs/ (the environment and its config class) and one entry
here; docs/environments.md ("Writing an environment") has the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field

from .alphabet_sort import AlphabetSortEnv, AlphabetSortEnvConfig
from .arithmetic import ArithmeticEnv, ArithmeticEnvConfig
from .calculator import CalculatorEnv, CalculatorEnvConfig
from .dataset import DatasetEnv, DatasetEnvConfig
from .mix import MixedEnv, MixEnvConfig
from .multiturn_sort import MultiTurnSortEnv, MultiTurnSortEnvConfig
from .reverse_text import ReverseTextEnv, ReverseTextEnvConfig
from .verifiers_config import VerifiersEnvConfig, make_verifiers_env
from .wordle import WordleEnv, WordleEnvConfig

__all__ = ["ENVIRONMENTS", "ENV_NAMES", "REGISTRY", "EnvConfig", "SingleEnvConfig", "make_env"]


def _make_mix(envs: list[tuple[str, dict, float]]) -> MixedEnv:
    """A `MixedEnv` of ``(name, kwargs, weight)`` entries, each built by `make_env`."""
    return MixedEnv([(make_env(name, **kwargs), weight) for name, kwargs, weight in envs])


# The order is the order of the union's members (and of docs/configs.md's env sections).
REGISTRY: dict[str, tuple[type[BaseModel], Callable[..., Any]]] = {
    "reverse-text": (ReverseTextEnvConfig, ReverseTextEnv),
    "alphabet-sort": (AlphabetSortEnvConfig, AlphabetSortEnv),
    "multiturn-sort": (MultiTurnSortEnvConfig, MultiTurnSortEnv),
    "wordle": (WordleEnvConfig, WordleEnv),
    "arithmetic": (ArithmeticEnvConfig, ArithmeticEnv),
    "calculator": (CalculatorEnvConfig, CalculatorEnv),
    "dataset": (DatasetEnvConfig, DatasetEnv),  # your own file of prompts (meshrl.data reads it)
    "verifiers": (VerifiersEnvConfig, make_verifiers_env),  # imports verifiers only when built
    "mix": (MixEnvConfig, _make_mix),  # a mix of the others; never nested
}

ENV_NAMES: tuple[str, ...] = tuple(REGISTRY)
ENVIRONMENTS: dict[str, Callable[..., Any]] = {name: make for name, (_, make) in REGISTRY.items()}

EnvConfig = Annotated[Union[tuple(cfg for cfg, _ in REGISTRY.values())], Field(discriminator="name")]
SingleEnvConfig = Annotated[Union[tuple(cfg for name, (cfg, _) in REGISTRY.items() if name != "mix")],
                            Field(discriminator="name")]
# MixEnvConfig.envs is annotated with the name SingleEnvConfig (envs/mix.py cannot import this module,
# which imports it); pydantic resolves the name from the namespace of this call's module.
MixEnvConfig.model_rebuild()

# a config whose tag differs from its key would validate as one environment and build another
assert all(cfg.model_fields["name"].default == name for name, (cfg, _) in REGISTRY.items()), \
    "each REGISTRY key must equal its config class's `name` default"


def make_env(name: str, **kwargs: Any):
    """Build the environment registered as ``name`` with its constructor keyword arguments."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
