"""Starting a job: config checks before any process group, torchrun, and failure reports.

Two ways in, one code path:

- `meshrl rl @ cfg.toml` (or `meshrl.runtime.rl.launch(cfg)` from Python) validates the
  config, writes RUN_DIR/config.json and starts `torchrun --nproc-per-node <world size>`
  with the rank module on that file;
- `torchrun --nproc-per-node N -m meshrl.runtime.rl @ cfg.toml` runs the rank module
  directly (multi-node, Slurm). Every rank validates the config and the world size before
  `init_process_group`, so a mistake costs no rendezvous.

A rank that raises writes its traceback to RUN_DIR/logs/error-rank{R}.txt and exits at once
with status 1 (no graceful teardown that could hang on a dead peer); torchrun then stops the
other ranks and the launcher prints which rank failed and why.

With `dist.max_restarts = K` the launcher passes `--max-restarts K` to torchrun: when a rank
dies, torchrun stops the others and starts all of them again (TORCHELASTIC_RESTART_COUNT counts
the attempts), up to K times; every new attempt builds its process groups from scratch and
resumes from the latest complete checkpoint (runtime/checkpoint.py, docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from meshrl.runtime.config import Base, ConfigError, load_config
from meshrl.runtime.rundir import log, restart_count, write_config, write_error

EXIT_CONFIG = 2


def fail(message: str, code: int = EXIT_CONFIG) -> None:
    """Print one line and exit (once per job: only local rank 0 prints under torchrun)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"meshrl: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


BARE_FLAGS = ("resume",)  # options that may stand alone: `--resume` means `--resume true`


def expand_flags(argv: list[str]) -> list[str]:
    """Give the bare `--resume` its value `true` (other options always need a value)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg[2:] in BARE_FLAGS and arg.startswith("--") and (nxt is None or nxt.startswith(("--", "@"))):
            out.append("true")
    return out


def parse_or_exit(cls: type[Base], argv: list[str], preflight: Callable[[Base], None]) -> tuple[Base, list[str]]:
    """Validate argv into `cls` and run the pre-flight checks; exit 2 with one line on a mistake."""
    try:
        cfg, flags = load_config(cls, expand_flags(argv))
        if flags:
            raise ConfigError(f"unknown flag(s) {' '.join('--' + f for f in flags)}: every option needs a value")
        preflight(cfg)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    return cfg, flags


def check_world_size(cfg: Base) -> None:
    """Under torchrun, the job must have exactly the ranks the config lays out."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != cfg.world_size:
        raise ConfigError(
            f"the config lays out {cfg.world_size} ranks but torchrun started {world} "
            f"(set --nproc-per-node/--nnodes to match, or change the layout)")


def launch(cfg: Base, module: str, extra_torchrun: list[str] | None = None) -> int:
    """Write RUN_DIR/config.json and run `module` under torchrun on one node; returns the exit code."""
    run_dir = Path(cfg.output_dir)
    config_path = write_config(run_dir, cfg.model_dump_json(indent=2))
    for stale in (*(run_dir / "logs").glob("error-rank*.txt"), *(run_dir / "logs").glob("restart*-error-rank*.txt")):
        stale.unlink()
    restarts = run_dir / "restarts.jsonl"
    before = len(restarts.read_text().splitlines()) if restarts.is_file() else 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.world_size}",
           f"--max-restarts={cfg.dist.max_restarts}", *(extra_torchrun or []), "-m", module, "@", str(config_path)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.world_size)))
    code = subprocess.call(cmd, env=env)
    rows = restarts.read_text().splitlines()[before:] if restarts.is_file() else []
    num_restarts = sum(json.loads(r)["restart"] > 0 for r in rows)
    if num_restarts:
        print(f"meshrl: the job was restarted {num_restarts} time(s) after a rank failed; see {restarts} and "
              f"{run_dir}/logs/restart*-error-rank*.txt", file=sys.stderr, flush=True)
    if code != 0:
        report_failure(run_dir, code)
    return code


def report_failure(run_dir: Path, code: int) -> None:
    """Name the rank that failed and the last line of its error."""
    # the first error written is the root cause; the others are usually its consequences
    errors = sorted((run_dir / "logs").glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime)
    if not errors:
        print(f"meshrl: the job failed (exit {code}) and no rank left a Python error: a rank was killed or "
              f"crashed; see the torchrun output above and {run_dir}/logs/", file=sys.stderr)
        return
    for i, path in enumerate(errors):
        lines = path.read_text().strip().splitlines()
        who = lines[0] if lines else path.stem
        last = lines[-1] if len(lines) > 1 else "unknown error"
        what = "failed first" if i == 0 else "then failed"
        print(f"meshrl: {who} {what}: {last}  (traceback: {path})", file=sys.stderr)


def rank_main(cls: type[Base], argv: list[str], preflight: Callable[[Base], None], role: str,
              body: Callable[[Base, Path], None]) -> None:
    """The start of every rank program: validate, then run `body(cfg, run_dir)` guarded."""
    cfg, _ = parse_or_exit(cls, argv, preflight)
    run_dir = Path(cfg.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    archive_error(run_dir, rank)
    guarded(run_dir, rank, role, lambda: body(cfg, run_dir))


def archive_error(run_dir: Path, rank: int) -> None:
    """On a torchrun restart, keep an earlier attempt's error file of this rank as
    restart{A}-error-rank{R}.txt (A: the attempt that wrote it), so that the launcher's report
    names only errors of the last attempt."""
    old = run_dir / "logs" / f"error-rank{rank}.txt"
    if restart_count() and old.is_file():
        first = old.read_text().split("\n", 1)[0]
        attempt = first.rsplit("in restart ", 1)[1] if "in restart " in first else "0"
        old.replace(old.with_name(f"restart{attempt}-error-rank{rank}.txt"))


def guarded(run_dir: Path, rank: int, role: str, fn: Callable[[], None]) -> None:
    """Run a rank's program; on any exception record it and exit immediately with status 1."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the rank ends here, loudly
        if isinstance(e, SystemExit) and not e.code:
            raise
        text = traceback.format_exc()
        write_error(run_dir, rank, role, text)
        log.error("failed:\n%s", text)
        print(f"[rank {rank} {role}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
