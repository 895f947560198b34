"""Where the SFT loop's documents come from: an environment's reference completions, or your own
data set (`[data]`, meshrl.data; docs/data.md).

Both give the documents at a cursor (examples consumed so far, over all ranks) as
``(prompt_ids, completion_ids[, completion_mask])`` for `pack_sft`, as a pure function of the cursor,
so every rank packs the same batch and a checkpoint that stores the cursor resumes exactly.

`DataDocuments` reads, checks and tokenizes the whole data set once when the run starts, on every
rank (each needs every step's batch); a malformed row fails naming its file and line, or is skipped
and counted (``data.on_error``). Rows are then visited in a seeded order per epoch (meshrl.data.order).
"""

from __future__ import annotations

import math
from typing import Any

from meshrl.data import Document, EpochOrder, Formatter, columns_of, read_rows, resolve_format, split_validation
from meshrl.data.formats import read_template
from meshrl.data.sources import RowError, Rows
from meshrl.runtime.config import DataConfig

__all__ = ["DataDocuments", "EnvDocuments", "check_data"]


class EnvDocuments:
    """Example i is the environment's example i with its reference completion, then eos."""

    def __init__(self, env: Any, tokenizer: Any):
        self.env, self.tokenizer = env, tokenizer
        self.validation: list[tuple] = []

    def examples(self, start: int, count: int) -> list[tuple[list[int], list[int]]]:
        tok, out = self.tokenizer, []
        for index in range(start, start + count):
            ex = self.env.example(index)
            prompt = tok.encode(ex.prompt, add_special_tokens=False)
            completion = tok.encode(self.env.sft_completion(ex), add_special_tokens=False) + [tok.eos_token_id]
            out.append((prompt, completion))
        return out

    def num_steps(self, max_steps: int, batch_size: int) -> int:
        return max_steps

    def batch_size_at(self, cursor: int, batch_size: int) -> int:
        return batch_size

    def summary(self) -> dict[str, float]:
        return {}

    def epoch(self, cursor: int) -> float | None:
        return None


def _documents(path: str, cfg: DataConfig, formatter: Formatter, max_tokens: int) -> Rows:
    """The Documents of the rows at ``path``; malformed ones fail or are skipped per cfg.on_error."""

    def document(row: dict) -> Document:
        doc = formatter(row)
        if len(doc.ids) > max_tokens:
            raise RowError(f"a document of {len(doc.ids)} tokens does not fit trainer.micro_batch_tokens "
                           f"({max_tokens})")
        if doc.num_trained == 0:
            raise RowError("no token to train on")
        return doc

    return read_rows(path, cfg.split, cfg.on_error, convert=document)


def _format(cfg: DataConfig, path: str) -> str:
    return resolve_format(cfg.format, columns_of(path, cfg.split), path)


class DataDocuments:
    """The rows of `[data]` as documents in a seeded epoch order, and the validation documents."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, max_tokens: int):
        self.cfg = cfg
        formatter = Formatter(tokenizer, _format(cfg, cfg.path), cfg.loss_on, read_template(cfg.chat_template))
        docs = _documents(cfg.path, cfg, formatter, max_tokens)
        self.skipped = list(docs.skipped)
        train, val = docs.rows, []
        if cfg.validation_fraction > 0:
            keep, held = split_validation(len(train), cfg.validation_fraction, cfg.seed)
            train, val = [train[i] for i in keep], [train[i] for i in held]
        elif cfg.validation_path is not None:
            val_formatter = Formatter(tokenizer, _format(cfg, cfg.validation_path), cfg.loss_on,
                                      read_template(cfg.chat_template))
            held = _documents(cfg.validation_path, cfg, val_formatter, max_tokens)
            self.skipped += held.skipped
            val = held.rows
        self.train = train
        self.validation = [d.as_example() for d in val]
        self.order = EpochOrder(len(train), cfg.seed, cfg.shuffle)

    def examples(self, start: int, count: int) -> list[tuple[list[int], list[int], list[bool]]]:
        return [self.train[i].as_example() for i in self.order.rows(start, count)]

    @property
    def total(self) -> int | None:
        """Examples in the whole run with data.epochs (None: unbounded)."""
        return None if self.cfg.epochs is None else self.cfg.epochs * len(self.train)

    def num_steps(self, max_steps: int, batch_size: int) -> int:
        """max_steps, or fewer when data.epochs ends the run first."""
        return max_steps if self.total is None else min(max_steps, math.ceil(self.total / batch_size))

    def batch_size_at(self, cursor: int, batch_size: int) -> int:
        """batch_size, or what is left of the last epoch."""
        return batch_size if self.total is None else min(batch_size, self.total - cursor)

    def epoch(self, cursor: int) -> float:
        return self.order.epoch(cursor)

    def summary(self) -> dict[str, float]:
        """The data set's counts, logged on the first metrics row."""
        return {"data/rows": len(self.train), "data/validation_rows": len(self.validation),
                "data/skipped_rows": len(self.skipped)}


def check_data(cfg: DataConfig, tokenizer: Any) -> None:
    """Before launch: every source exists and has the columns of its format; chats have a template."""
    sources = [("data.path", cfg.path)] + ([("data.validation_path", cfg.validation_path)] if cfg.validation_path else [])
    for field, path in sources:
        try:
            Formatter(tokenizer, _format(cfg, path), cfg.loss_on, read_template(cfg.chat_template))
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
