"""The run directory, per-rank logs, metrics.jsonl, samples/ and the console progress line.

    RUN_DIR/
      config.json          the resolved configuration
      metrics.jsonl        one JSON object per step (each step exactly once, also across resumes)
      samples/step_N.jsonl a few prompts and completions per step, for a person to read
      checkpoints/         step_N/ resumable checkpoints, final/ the policy as an HF folder
                           (runtime/checkpoint.py, docs/checkpoints.md)
      restarts.jsonl       one line per resume or torchrun restart: from which step, steps lost
      wandb/, wandb_run_id W&B files when wandb.enabled (runtime/wandb_logger.py)
      logs/rank{R}-{role}.log   one file per rank, appended across restarts; every line names the
                                rank and role (and the restart, after one)
      logs/error-rank{R}.txt    the traceback of a rank that failed (read by the launcher); a
                                restart renames earlier ones to restart{A}-error-rank{R}.txt
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("meshrl")


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def setup_logging(run_dir: Path, rank: int, role: str, console_level: int = logging.WARNING) -> None:
    """Log INFO and above to logs/rank{R}-{role}.log, and `console_level` and above to stderr."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    attempt = restart_count()
    tag = f"rank {rank} {role}" + (f" restart {attempt}" if attempt else "")
    fmt = logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s")
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
    attempt = restart_count()
    (logs / f"error-rank{rank}.txt").write_text(f"rank {rank} ({role})" + (f" in restart {attempt}" if attempt else "")
                                                + f"\n{text}")


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


class MetricsSink(Protocol):
    """Somewhere else the rows of metrics.jsonl go (W&B: runtime/wandb_logger.py)."""

    def log(self, row: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and samples to samples/step_N.jsonl.

    A fresh run (`start_step` 0) empties metrics.jsonl. A resumed one keeps the rows of the steps
    before `start_step` and drops the later ones, which the resumed run computes again, so every
    step appears exactly once; `steps_lost` counts the dropped steps. Rows also go to `sinks`.
    """

    def __init__(self, run_dir: Path, start_step: int = 0, sinks: Iterable[MetricsSink] = ()):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.sinks = list(sinks)
        rows = [r for r in _rows(self.path) if isinstance(r.get("step"), int)]
        kept = [r for r in rows if r["step"] < start_step]
        self.steps_lost = len({r["step"] for r in rows if r["step"] >= start_step})
        self.steps = {r["step"] for r in kept}
        """Steps that have a row."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def write(self, metrics: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if isinstance(row.get("step"), int):
            self.steps.add(row["step"])
        for sink in self.sinks:
            sink.log(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.finish()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        with (folder / f"step_{step}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def record_restart(run_dir: Path, resumed_from: int | None, steps_lost: int) -> None:
    """Append a line to restarts.jsonl and log it: which restart, from which step, steps redone."""
    attempt = restart_count()
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "restart": attempt, "resumed_from": resumed_from,
           "steps_lost": steps_lost}
    with (run_dir / "restarts.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    what = f"torchrun restart {attempt}" if attempt else "resume"
    where = f"from checkpoint step_{resumed_from}" if resumed_from is not None else "from scratch (no checkpoint)"
    log.warning("%s: continuing %s; %d step(s) done before are computed again", what, where, steps_lost)


class Heartbeat:
    """Says in the log which phase a rank is in once it has been there for `interval_s` seconds.

    The rank names its phase (`set("train step 12")`); a daemon thread logs "heartbeat: in <phase>
    for N s" every `interval_s` while the phase does not change, so the log of a stuck rank shows
    where it is stuck, while the collective or receive it waits in runs into its timeout.
    """

    def __init__(self, interval_s: float, phase: str = "starting"):
        self.interval_s = interval_s
        self._phase = phase
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def set(self, phase: str) -> None:
        self._phase, self._since = phase, time.monotonic()

    def _run(self) -> None:
        current, logged = None, 0
        while not self._stop.wait(min(self.interval_s / 4, 5.0)):
            phase, since = self._phase, self._since
            if since != current:
                current, logged = since, 0
            waited = time.monotonic() - since
            if waited >= (logged + 1) * self.interval_s:  # at 1x, 2x, ... the interval
                logged += 1
                log.info("heartbeat: in %s for %.0fs", phase, waited)

    def close(self) -> None:
        self._stop.set()


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
