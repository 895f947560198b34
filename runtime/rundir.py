"""The run directory, per-rank logs, metrics.jsonl, samples/ and the console progress line.

    RUN_DIR/
      config.json          the resolved configuration
      metrics.jsonl        one JSON object per step
      samples/step_N.jsonl a few prompts and completions per step, for a person to read
      checkpoints/final/   the final policy as an HF folder (config, safetensors, tokenizer)
      logs/rank{R}-{role}.log   one file per rank; every line names the rank and role
      logs/error-rank{R}.txt    the traceback of a rank that failed (read by the launcher)
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")


def setup_logging(run_dir: Path, rank: int, role: str, console_level: int = logging.WARNING) -> None:
    """Log INFO and above to logs/rank{R}-{role}.log, and `console_level` and above to stderr."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank} {role}] %(levelname)s %(message)s")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    file_handler = logging.FileHandler(logs / f"rank{rank}-{role}.log")
    file_handler.setFormatter(fmt)
    log.addHandler(file_handler)
    stream = logging.StreamHandler(sys.stderr)
    stream.setLevel(console_level)
    stream.setFormatter(fmt)
    log.addHandler(stream)


def write_error(run_dir: Path, rank: int, role: str, text: str) -> None:
    """Leave the traceback of a failed rank where the launcher finds it."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"error-rank{rank}.txt").write_text(f"rank {rank} ({role})\n{text}")


def write_config(run_dir: Path, config_json: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(config_json)
    tmp.replace(path)
    return path


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and samples to samples/step_N.jsonl."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.path.write_text("")

    def write(self, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        with (folder / f"step_{step}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


class ProgressLine:
    """A live status line (rich) on a terminal; one plain line per step elsewhere (CI, files)."""

    def __init__(self, total: int, enabled: bool, label: str):
        self.enabled = enabled
        self.total = total
        self.label = label
        self.start = time.perf_counter()
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.console import Console
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                      TextColumn("{task.fields[status]}"), console=Console(stderr=True))
            self._task = self._progress.add_task(label, total=total, status="starting")
            self._progress.start()

    def update(self, done: int, status: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=done, status=status)
        else:
            print(f"{self.label} {done}/{self.total} {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
