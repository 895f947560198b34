"""Environments: the `Environment` protocol and the built-in tasks, by name."""

from .base import Environment, Example
from .reverse_text import ReverseTextEnv

__all__ = ["ENVIRONMENTS", "Environment", "Example", "ReverseTextEnv", "make_env"]

ENVIRONMENTS: dict[str, type] = {"reverse-text": ReverseTextEnv}


def make_env(name: str, **kwargs) -> Environment:
    """Build the environment registered as ``name`` with its constructor keyword arguments."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
