"""The order of a data set's rows over epochs, as a pure function of one integer cursor.

Cursor ``c`` (examples consumed so far, over all ranks) is in epoch ``c // n`` at position
``c % n``; each epoch visits every row once, in a permutation seeded by (seed, epoch) (or in file
order without shuffling). Every rank computes the same rows for the same cursor, and a checkpoint
that stores the cursor resumes at exactly the example an uninterrupted run would see next: the
state of the loader is that one integer, nothing else (no worker processes, no buffers).
"""

from __future__ import annotations

import random

__all__ = ["EpochOrder", "split_validation"]


class EpochOrder:
    """Row indices for cursor positions (module docstring)."""

    def __init__(self, num_rows: int, seed: int = 0, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._epoch, self._perm = -1, list(range(num_rows))

    def permutation(self, epoch: int) -> list[int]:
        """The rows of ``epoch`` in order."""
        if epoch != self._epoch:
            perm = list(range(self.num_rows))
            if self.shuffle:
                # A string seed is hashed with SHA-512 by `random`: the same order in every process.
                random.Random(f"epoch-order:{self.seed}:{epoch}").shuffle(perm)
            self._epoch, self._perm = epoch, perm
        return self._perm

    def row(self, cursor: int) -> int:
        """The row at cursor position ``cursor``."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        return self.permutation(cursor // self.num_rows)[cursor % self.num_rows]

    def rows(self, start: int, count: int) -> list[int]:
        """The rows at positions start .. start + count - 1 (crossing epochs as needed)."""
        return [self.row(c) for c in range(start, start + count)]

    def epoch(self, cursor: int) -> float:
        """Epochs completed at ``cursor`` (fractional)."""
        return cursor / self.num_rows


def split_validation(num_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training rows, validation rows): a seeded ``fraction`` of the rows (at least one, and at
    least one row left to train on) held out, each list in row order."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    if num_rows < 2:
        raise ValueError(f"a validation split needs at least 2 rows, the data has {num_rows}")
    count = min(max(1, round(num_rows * fraction)), num_rows - 1)
    held = set(random.Random(f"validation:{seed}").sample(range(num_rows), count))
    return [i for i in range(num_rows) if i not in held], sorted(held)
