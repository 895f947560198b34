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
      logs/torchrun-failure.json  torchrun's own record of the failed ranks (exit codes, times),
                                written by the launcher's agent (runtime/launch.py)
      job.lock             flock held by the job using the directory (its host and pid inside):
                           a second job on the same directory is refused
      .meshrl-run          marker: this is a meshrl run directory (what `--overwrite` may clear)

A fresh run (no `--resume`) needs an empty or missing directory: one holding an earlier run is
refused (`check_run_dir_fresh`), unless `--overwrite` clears it first (`clear_run_dir`, which
touches only directories with the marker). So a directory never mixes two runs' files.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("meshrl")


LOCK_FILE = "job.lock"
LOCK_ENV = "MESHRL_RUN_LOCK"
"""Set by `meshrl rl|sft` for the ranks it starts: it holds the run directory's lock for them."""
_held_locks: dict[str, int] = {}  # lock file -> descriptor, for the locks this process holds

ACTIVITY: dict[str, Any] = {"role": "starting", "phase": "starting", "since": time.time()}
"""What this rank is doing (its role, and the phase its Heartbeat names): carried by its heartbeats
(runtime/liveness.py), so a silent rank's last activity is known."""


def note_activity(phase: str) -> None:
    """Record this rank's current phase (a Heartbeat does it on every `set`)."""
    ACTIVITY["phase"], ACTIVITY["since"] = phase, time.time()


def _lock_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace").strip() or "a process that has not written its name yet"


def lock_run_dir(run_dir: Path) -> None:
    """Hold RUN_DIR/job.lock (flock) until this process exits, writing its host and pid into it;
    ValueError (one line naming the holder) if another job holds it. The lock dies with its
    process, so a killed job leaves nothing to clean up."""
    path = run_dir / LOCK_FILE
    if str(path.resolve()) in _held_locks:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise ValueError(f"{run_dir} is in use by another job ({holder}): wait for it to end, or choose "
                         "another output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
             .encode())
    _held_locks[str(path.resolve())] = fd


def unlock_run_dir(run_dir: Path) -> None:
    """Give RUN_DIR/job.lock back (the job that held it has ended)."""
    fd = _held_locks.pop(str((run_dir / LOCK_FILE).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def release_locks() -> None:
    """In a child forked from a lock holder: close its copies of the lock descriptors. The parent keeps
    the locks; a forked child that kept a copy would hold the flock alive after the parent gave it back."""
    for fd in _held_locks.values():
        os.close(fd)
    _held_locks.clear()


def check_run_dir_free(run_dir: Path) -> None:
    """ValueError naming the holder if another job holds RUN_DIR's lock (this process may hold it)."""
    path = run_dir / LOCK_FILE
    if not path.is_file() or str(path.resolve()) in _held_locks:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise ValueError(f"{run_dir} is in use by another job ({_lock_holder(fd)}): wait for it to end, or choose "
                         "another output_dir") from None
    finally:
        os.close(fd)


MARKER_FILE = ".meshrl-run"
KEEP = (LOCK_FILE, MARKER_FILE)  # what a fresh run may find in its directory


def run_dir_contents(run_dir: Path) -> list[str]:
    """Names in RUN_DIR other than the lock and the marker (an earlier run's files), sorted."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in KEEP)


def check_run_dir_fresh(run_dir: Path, overwrite: bool) -> None:
    """ValueError (one line) when a fresh run would mix its files with an earlier run's in RUN_DIR, or
    when --overwrite is asked for a folder that is not a meshrl run directory."""
    used = run_dir_contents(run_dir)
    if not used:
        return
    shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
    if not overwrite:
        raise ValueError(f"{run_dir} holds an earlier run ({shown}): pass --overwrite to clear it, --resume to "
                         "continue it, or choose another output_dir")
    if not (run_dir / MARKER_FILE).is_file():
        raise ValueError(f"--overwrite: {run_dir} is not a meshrl run directory (no {MARKER_FILE} marker; it "
                         f"holds {shown}); it is left alone: remove it yourself or choose another output_dir")


def clear_run_dir(run_dir: Path) -> list[str]:
    """Remove an earlier run's files from RUN_DIR (a marked run directory; the lock, held by the caller,
    and the marker stay). Returns the names removed."""
    import shutil

    check_run_dir_fresh(run_dir, overwrite=True)
    removed = run_dir_contents(run_dir)
    for name in removed:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


def mark_run_dir(run_dir: Path, kind: str) -> None:
    """Write the marker that makes RUN_DIR a meshrl run directory (kept if there is one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / MARKER_FILE
    if not marker.is_file():
        marker.write_text(json.dumps({"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def setup_logging(run_dir: Path, rank: int, role: str, console_level: int = logging.WARNING) -> None:
    """Log INFO and above to logs/rank{R}-{role}.log, and `console_level` and above to stderr."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ACTIVITY["role"] = role
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
    """Leave the traceback of a failed rank where the launcher finds it (first line: who and when).
    A file that cannot be written (a full disk) is said on stderr instead: the rank is ending anyway."""
    logs = run_dir / "logs"
    attempt = restart_count()
    head = f"rank {rank} ({role})" + (f" in restart {attempt}" if attempt else "")
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"error-rank{rank}.txt").write_text(f"{head}\ntime {time.time():.3f}\n{text}")
    except OSError as e:
        (logs / f"error-rank{rank}.txt").unlink(missing_ok=True)  # an empty file would name no error
        print(f"[{head}] could not write {logs}/error-rank{rank}.txt ({e}); the error was:\n{text}",
              file=sys.stderr, flush=True)


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
    step appears exactly once; `steps_lost` counts the dropped steps. The samples of the dropped
    steps go too, and the plots (made from the old rows). Rows also go to `sinks`.
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
        for path in (run_dir / "samples").glob("step_*.jsonl"):
            if not path.stem.removeprefix("step_").isdigit() or int(path.stem.removeprefix("step_")) >= start_step:
                path.unlink()
        for path in (run_dir / "plots").glob("*.png"):
            path.unlink()

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


class NotTrainingError(RuntimeError):
    """The run's recent steps taught the policy nothing (every rollout failed, or every update was
    non-finite and skipped): it stops rather than burn the allocation."""


class TrainingWatch:
    """Ends a run that is not training: `window` consecutive steps each of which had every rollout
    failed (RL) or only a non-finite update (the optimizer step skipped). The window is the run's
    checkpoint.every (10 when it saves no checkpoints), so such a run stops before it saves a
    checkpoint of nothing learned."""

    def __init__(self, window: int):
        self.window = max(window, 1)
        self.bad: list[tuple[int, str]] = []  # the latest run of bad steps: (step, why)

    def step(self, step: int, grad_norm: float, rollouts: int = 0, failed: int = 0) -> None:
        """Record step `step`; NotTrainingError once the last `window` steps were all bad."""
        if rollouts and failed >= rollouts:
            self.bad.append((step, "every rollout failed"))
        elif not math.isfinite(grad_norm):
            self.bad.append((step, "the update was non-finite (skipped)"))
        else:
            self.bad.clear()
            return
        if len(self.bad) >= self.window:
            counts = {why: sum(w == why for _, w in self.bad) for why in dict.fromkeys(w for _, w in self.bad)}
            what = next(iter(counts)) if len(counts) == 1 else " or ".join(f"{why} ({n} steps)" for why, n in counts.items())
            raise NotTrainingError(
                f"the run is not training: in each of its last {self.window} steps ({self.bad[0][0]}-{step}) {what}, "
                "so it stops. Failed rollouts: see the reward function's traceback in logs/rank*-controller.log; "
                "non-finite updates: lower the learning rate or check the data")


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
        note_activity(phase)

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
    """A live status line (rich) on a terminal; one plain line per step elsewhere (CI, files). Steps are
    named as in metrics.jsonl, samples/ and the logs (from 0): "rl step 4 (5/20) ..." after step 4."""

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

    def update(self, step: int, status: str) -> None:
        """Step `step` (metrics.jsonl's number) is done."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, status=f"step {step}  {status}")
        else:
            print(f"{self.label} step {step} ({step + 1}/{self.total}) {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
