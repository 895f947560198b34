"""The "verifiers" environment's config and constructor, without importing verifiers.

verifiers is an optional extra, and the config union (envs/registry.py) is built whenever a
config is read, so the config class lives here rather than in envs/verifiers_adapter.py, which
imports verifiers at its top. `make_verifiers_env` imports the adapter only when an environment
is built.
"""

from __future__ import annotations

from typing import Any, Literal

from .config import EnvConfigBase

__all__ = ["VerifiersEnvConfig", "make_verifiers_env"]


class VerifiersEnvConfig(EnvConfigBase):
    """A verifiers (0.4, verifiers.v1) taskset run by our engine (envs/verifiers_adapter.py; the `verifiers` extra)."""

    name: Literal["verifiers"] = "verifiers"
    """Environment name."""
    taskset: str
    """The taskset: an import path `package.module:attr` (a Taskset subclass or instance, or a function
    returning one) or the id of an installed taskset package."""
    taskset_args: dict[str, Any] = {}
    """Fields of the taskset's config (its TasksetConfig subclass)."""
    mode: Literal["auto", "direct", "harness"] = "auto"
    """direct: prompt -> one completion -> the task's reward and metric functions; harness: each episode runs
    the task through a verifiers agent harness (multi-turn, tools, task setup) with an in-process client over
    our engine; auto: harness when the task needs a runtime or has tool servers, else direct."""
    harness: str = "null"
    """Harness id for harness mode (a built-in verifiers harness that runs on the host, e.g. null or bash)."""
    seed: int | None = None
    """Shuffle the task order with this seed (unset: the taskset's own order)."""
    label: str | None = None
    """Name used in metrics (env/<label>/...); unset: the taskset's name."""


def make_verifiers_env(**kwargs: Any):
    """A `VerifiersEnv` (envs/verifiers_adapter.py) built with ``kwargs``; imports verifiers."""
    from .verifiers_adapter import VerifiersEnv  # verifiers is an optional extra

    return VerifiersEnv(**kwargs)
