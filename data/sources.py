"""Rows of a user's data set from a local file or folder; no hub access.

Sources, chosen by the path:

- ``*.jsonl`` (also ``*.json`` written as JSON lines): one JSON object per line, blank lines
  ignored. Read with the standard library.
- ``*.parquet``: read with pyarrow (the `data` extra).
- a folder: written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``'s, then ``split``
  picks one, "train" by default); read with ``datasets.load_from_disk`` (the `data` extra),
  which reads Arrow files and runs no code from the folder.

Every row keeps where it came from (``where[i]``: "data.jsonl:17" with the 1-based line,
"data.parquet row 17" with the 0-based row), so a malformed row can be named. A line that is
not a JSON object is malformed here; `check_row` (used by callers for their own checks) applies
``on_error``: "fail" raises ValueError naming the row, "skip" drops it and records why.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["RowError", "Rows", "columns_of", "read_rows", "check_row", "source_kind"]

EXTRA_HINT = "pip install 'meshrl[data]'"


class RowError(ValueError):
    """One row's problem (a missing field, a wrong type); the caller adds where the row is."""


@dataclass
class Rows:
    """The rows of a source, where each came from, and the rows skipped (``on_error = "skip"``)."""

    rows: list[dict[str, Any]]
    where: list[str]
    skipped: list[str] = field(default_factory=list)  # "where: why" of each skipped row


def source_kind(path: str | Path) -> str:
    """"jsonl", "parquet" or "disk" (a save_to_disk folder); ValueError for anything else."""
    p = Path(path)
    if p.is_dir():
        return "disk"
    if not p.is_file():
        raise ValueError(f"{path}: no such file or folder")
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    if p.suffix == ".parquet":
        return "parquet"
    raise ValueError(f"{path}: unknown data file type {p.suffix!r} (expected .jsonl, .parquet or a folder "
                     "written by datasets' save_to_disk)")


def _require(module: str, what: str):
    """Import an optional dependency, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs the {module.split('.')[0]} package: {EXTRA_HINT}") from None


def _load_disk(path: str | Path, split: str | None):
    datasets = _require("datasets", f"{path} (a datasets save_to_disk folder)")
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise ValueError(f"{path}: no split {name!r} (it has {sorted(ds)}); set the split")
        return ds[name]
    if split is not None:
        raise ValueError(f"{path}: split {split!r} given, but the folder holds one dataset, not a DatasetDict")
    return ds


def columns_of(path: str | Path, split: str | None = None) -> list[str]:
    """The column names of a source without reading it all (JSONL: the keys of its first object)."""
    kind = source_kind(path)
    if kind == "parquet":
        pq = _require("pyarrow.parquet", f"{path} (parquet)")
        return list(pq.read_schema(str(path)).names)
    if kind == "disk":
        return list(_load_disk(path, split).column_names)
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                row = _parse_line(line, f"{path}:{number}")
                return list(row)
    raise ValueError(f"{path}: no rows")


def read_rows(path: str | Path, split: str | None = None, on_error: str = "fail",
              setting: str = "data.on_error", convert: Callable[[dict[str, Any]], Any] | None = None) -> Rows:
    """Every row of the source at ``path`` (module docstring), passed through ``convert`` (a caller's
    check or transformation; its RowError marks the row malformed) in file order, so the first
    malformed row is the one named. ValueError when no row is left. ``setting`` names the
    on_error setting in messages."""
    kind = source_kind(path)
    out = Rows([], [])
    convert = convert or (lambda row: row)
    if kind == "jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    check_row(out, f"{path}:{number}", on_error, lambda: convert(_parse_line(line, "")), setting)
    else:
        if kind == "parquet":
            pq = _require("pyarrow.parquet", f"{path} (parquet)")
            rows = pq.read_table(str(path)).to_pylist()
        else:
            rows = _load_disk(path, split).to_list()
        for i, row in enumerate(rows):
            check_row(out, f"{path} row {i}", on_error, lambda: convert(row), setting)
    if not out.rows:
        raise ValueError(f"{path}: no usable rows" + (f" ({len(out.skipped)} skipped; the first: "
                                                      f"{out.skipped[0]})" if out.skipped else ""))
    return out


def check_row(out: Rows, where: str, on_error: str, make: Callable[[], Any], setting: str = "data.on_error") -> None:
    """Append ``make()`` to ``out`` (with ``where``); a RowError from it fails naming the row
    (``on_error = "fail"``) or records the row as skipped ("skip")."""
    try:
        value = make()
    except RowError as e:
        if on_error == "fail":
            raise ValueError(f"{where}: {e} (set {setting} = \"skip\" to skip such rows)") from None
        out.skipped.append(f"{where}: {e}")
        return
    out.rows.append(value)
    out.where.append(where)


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RowError(f"{where + ': ' if where else ''}not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise RowError(f"{where + ': ' if where else ''}a JSON {type(row).__name__}, not an object")
    return row
