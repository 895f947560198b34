"""Helpers shared by the seeded synthetic environments: per-example RNGs, random words, parsing."""

from __future__ import annotations

import random
import re
import string

__all__ = ["check_range", "example_rng", "first_line", "last_integer", "random_words"]

_INTEGER = re.compile(r"-?\d+")


def example_rng(name: str, seed: int, index: int) -> random.Random:
    """The RNG of example ``index``: a pure function of (environment name, seed, index).

    A string seed is hashed with SHA-512 by `random`, the same in every process.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return random.Random(f"{name}:{seed}:{index}")


def random_words(rng: random.Random, num_words: int, min_len: int, max_len: int) -> list[str]:
    """``num_words`` words of random lowercase letters, each ``min_len``..``max_len`` long."""
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len))) for _ in range(num_words)]


def check_range(what: str, low: int, high: int, minimum: int = 1) -> None:
    """ValueError unless minimum <= low <= high."""
    if low < minimum or high < low:
        raise ValueError(f"{what}: need {minimum} <= min <= max, got min={low}, max={high}")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (commas inside numbers ignored), None if there is none."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def first_line(text: str) -> str:
    """``text`` stripped and cut at its first newline (how the built-in tasks read an answer)."""
    return text.strip().split("\n", 1)[0].strip()
