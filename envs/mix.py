"""Mixing several environments in one run, with ratios, deterministic per prompt index.

The ratios become small integers ``w_1..w_n`` (cycle length ``L = sum w``). Prompt ``index``
falls at position ``index % L`` of a fixed interleaved cycle in which environment ``i``
appears ``w_i`` times (smooth weighted round robin: the environments alternate as evenly as the
ratios allow), so every window of ``L`` consecutive prompts holds exactly ``w_i`` of
environment ``i``. The example is that environment's own example number ``k``, where ``k``
counts its earlier appearances; both are pure functions of ``index``, so the dataset cursor
stays one integer. Each example records its environment's key in ``Example.env``; scoring,
episodes and metrics (``env/<key>/...``) go through that environment. Keys are the
environments' names, made unique with a ``-2``, ``-3`` suffix when a name repeats.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field

from .base import Example, make_episode
from .config import Base

__all__ = ["MixEnvConfig", "MixedEnv", "integer_ratios", "mix_cycle"]

MAX_CYCLE = 10_000


def integer_ratios(weights: list[float]) -> list[int]:
    """Positive ratios as the smallest integers with the same proportions (to 1/1000 precision)."""
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"mix weights must be positive, got {weights}")
    fractions = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    g = math.gcd(*ints)
    ints = [i // g for i in ints]
    if sum(ints) > MAX_CYCLE:
        raise ValueError(f"mix weights {weights} need a cycle of {sum(ints)} prompts (max {MAX_CYCLE}); "
                         "use simpler ratios")
    return ints


def mix_cycle(ratios: list[int]) -> list[int]:
    """The interleaved cycle: environment indices, ``ratios[i]`` times each (smooth weighted round robin)."""
    total = sum(ratios)
    current = [0] * len(ratios)
    cycle = []
    for _ in range(total):
        for i, w in enumerate(ratios):
            current[i] += w
        pick = max(range(len(ratios)), key=lambda i: (current[i], -i))
        current[pick] -= total
        cycle.append(pick)
    return cycle


class MixEnvConfig(Base):
    """Several environments in one run, each a share of the prompts set by its `weight` (envs/mix.py)."""

    name: Literal["mix"] = "mix"
    """Environment name."""
    # SingleEnvConfig, the union of every registered environment's config but this one, is built by
    # envs/registry.py from its table, which holds this class too: the registry resolves the name
    # (MixEnvConfig.model_rebuild) right after building the union, so mix.py never imports it.
    envs: list[SingleEnvConfig] = Field(min_length=1)  # noqa: F821
    """The environments (`[[env.envs]]` tables, each with its name, settings and weight)."""

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of the mix: (name, kwargs, weight) per environment."""
        return {"envs": [(e.name, e.kwargs(), e.weight) for e in self.envs]}


class MixedEnv:
    """Several environments, each a share of the prompts; see the module docstring."""

    name = "mix"

    def __init__(self, envs: list[tuple[Any, float]]):
        if not envs:
            raise ValueError("a mix needs at least one environment")
        self.keys: list[str] = []
        for env, _ in envs:
            key, n = env.name, 2
            while key in self.keys:
                key, n = f"{env.name}-{n}", n + 1
            self.keys.append(key)
        self.envs = {key: env for key, (env, _) in zip(self.keys, envs)}
        self.ratios = integer_ratios([w for _, w in envs])
        self.cycle = mix_cycle(self.ratios)
        # rank[p]: how many times cycle[p]'s environment appears before position p
        seen = [0] * len(envs)
        self.rank = []
        for e in self.cycle:
            self.rank.append(seen[e])
            seen[e] += 1

    def locate(self, index: int) -> tuple[str, int]:
        """(environment key, that environment's example index) of mixed prompt ``index``."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        rounds, pos = divmod(index, len(self.cycle))
        e = self.cycle[pos]
        return self.keys[e], rounds * self.ratios[e] + self.rank[pos]

    def example(self, index: int) -> Example:
        key, sub = self.locate(index)
        return dataclasses.replace(self.envs[key].example(sub), env=key)

    def episode(self, example: Example, tokenizer: Any):
        return make_episode(self.envs[self._key(example)], example, tokenizer)

    def score(self, example: Example, completion: str):
        return self.envs[self._key(example)].score(example, completion)

    def sft_completion(self, example: Example) -> str:
        env = self.envs[self._key(example)]
        if not hasattr(env, "sft_completion"):
            raise ValueError(f"environment {example.env!r} has no reference completions (multi-turn); "
                             "leave it out of SFT mixes")
        return env.sft_completion(example)

    def _key(self, example: Example) -> str:
        if example.env not in self.envs:
            raise ValueError(f"example {example.index} names environment {example.env!r}, not one of {self.keys}")
        return example.env
