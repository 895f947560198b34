"""Starting a job: config checks before any process group, torchrun, signals and failure reports.

Two ways in, one code path:

- `meshrl rl @ cfg.toml` (or `meshrl.runtime.rl.launch(cfg)` from Python) validates the
  config, takes the run directory's lock, writes RUN_DIR/config.json and starts torchrun's agent
  (agent_main: torchrun's elastic launch, plus the record below) with the rank module on that
  file. On Linux the agent is the launcher forked, so torch is not imported a second time. CPU
  jobs fork their ranks (rank_start): the launcher imports what they all import (the rank module's
  PRELOAD), the agent forks a fork server at its start, while it is one thread (rank_server.py says
  why), and torchrun starts the ranks through it; each runs the rank module's `main` as `python -m`
  would. GPU jobs (or MESHRL_RANK_START=exec) run `python -m MODULE` ranks, as torchrun's;
- `torchrun --nproc-per-node N -m meshrl.runtime.rl @ cfg.toml` runs the rank module
  directly (multi-node, Slurm). Every rank validates the config and the world size before
  `init_process_group`, so a mistake costs no rendezvous; rank 0 takes the lock.

Process tree and signals (no orphans):

    meshrl (launcher)   holds RUN_DIR/job.lock; forwards SIGINT/SIGTERM to the agent and waits;
      |                 a second Ctrl-C kills the agent. Exit 130 (SIGINT) / 143 (SIGTERM) with
      |                 one line: where the run stopped and how to resume it.
      +- agent          torchrun's agent, in a session of its own (the terminal's Ctrl-C reaches the
           |            launcher only); dies with the launcher (parent-death signal SIGTERM, which
           |            makes torchrun stop its workers); on a failure writes torchrun's record of
           |            the failed ranks (logs/torchrun-failure.json)
           +- (rank server: forked CPU ranks only; dies with the agent, parent-death signal SIGKILL)
           +- ranks     die with their agent or rank server (parent-death signal SIGKILL, or a watchdog thread
                        where prctl is missing); SIGINT kills a rank at once (no traceback);
                        heartbeats (runtime/liveness.py) end the job when a rank freezes

A rank that raises writes its traceback to RUN_DIR/logs/error-rank{R}.txt and exits at once
with status 1 (no graceful teardown that could hang on a dead peer); torchrun then stops the
other ranks and the launcher names the rank that failed first from torchrun's record (the ranks
that had failed when torchrun first saw a failure, their exit codes and times), with the last
line of its error file, then the others.

With `dist.max_restarts = K` the launcher passes `--max-restarts K` to torchrun: when a rank
dies, torchrun stops the others and starts all of them again (TORCHELASTIC_RESTART_COUNT counts
the attempts), up to K times; every new attempt builds its process groups from scratch and
resumes from the latest complete checkpoint (runtime/checkpoint.py, docs/checkpoints.md).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshrl.runtime import rank_server
from meshrl.runtime.config import Base, ConfigError, load_config
from meshrl.runtime.liveness import start_liveness
from meshrl.runtime.rundir import (ACTIVITY, LOCK_ENV, check_run_dir_fresh, clear_run_dir, lock_run_dir, log, mark_run_dir, restart_count,
                                   release_locks, run_dir_contents, unlock_run_dir, write_config, write_error)
from meshrl.runtime.summary import print_summary

EXIT_CONFIG = 2


def fail(message: str, code: int = EXIT_CONFIG) -> None:
    """Print one line and exit (once per job: only local rank 0 prints under torchrun)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"meshrl: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


BARE_FLAGS = ("resume", "overwrite")  # options that may stand alone: `--resume` means `--resume true`


def expand_flags(argv: list[str]) -> list[str]:
    """Give the bare `--resume` and `--overwrite` their value `true` (other options always need a value)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg[2:] in BARE_FLAGS and arg.startswith("--") and (nxt is None or nxt.startswith(("--", "@"))):
            out.append("true")
    return out


def parse_or_exit(cls: type[Base], argv: list[str], preflight: Callable[[Base], None]) -> tuple[Base, list[str]]:
    """Validate argv into `cls` and run the pre-flight checks; exit 2 with one line on a mistake."""
    cfg = validate_or_exit(cls, argv)
    preflight_or_exit(cfg, preflight)
    return cfg, []


def validate_or_exit(cls: type[Base], argv: list[str]) -> Base:
    """argv (`@ files`, overrides) validated into `cls`; exit 2 with one line on a mistake. Needs only
    the config models: the CLI calls it before importing torch or any rank program."""
    try:
        cfg, flags = load_config(cls, expand_flags(argv))
        if flags:
            raise ConfigError(f"unknown flag(s) {' '.join('--' + f for f in flags)}: every option needs a value")
    except ConfigError as e:
        fail(str(e))
    return cfg


def preflight_or_exit(cfg: Base, preflight: Callable[[Base], None]) -> None:
    """Run a program's pre-flight checks (model folder, world size, devices); exit 2 with one line."""
    try:
        preflight(cfg)
    except ValueError as e:
        fail(str(e))


def check_world_size(cfg: Base) -> None:
    """Under torchrun, the job must have exactly the ranks the config lays out; and a job of several
    agents (nodes) that may restart must not share the agents' store (layout.init_world says why:
    a restart would hang in the rendezvous or in init_process_group; docs/multinode.md)."""
    env = os.environ
    world = env.get("WORLD_SIZE")
    if world is not None and int(world) != cfg.world_size:
        raise ConfigError(
            f"the config lays out {cfg.world_size} ranks but torchrun started {world} "
            f"(set --nproc-per-node/--nnodes to match, or change the layout)")
    agents = int(env.get("GROUP_WORLD_SIZE", "1"))
    if agents > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 \
            and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max-restarts over {agents} agents needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every "
            "agent's environment (torchrun/slurm.sbatch sets it; see docs/multinode.md)")


OVERSUBSCRIBE_ENV = "MESHRL_ALLOW_OVERSUBSCRIBE"


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_compute_ranks(cfg: Base) -> int:
    """The config's trainer + inference ranks that run on this node (all of them on one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return cfg.num_compute_ranks if local is None else max(1, min(cfg.num_compute_ranks, int(local)))


def check_cpu_cores(cfg: Base) -> None:
    """A CPU job may not start more trainer + inference ranks on a node than it has cores, unless
    dist.allow_oversubscribe (or MESHRL_ALLOW_OVERSUBSCRIBE=1) says so. Call only for CPU jobs."""
    ranks, cores = local_compute_ranks(cfg), cpu_cores()
    if ranks <= cores or cfg.dist.allow_oversubscribe or os.environ.get(OVERSUBSCRIBE_ENV) == "1":
        return
    raise ValueError(f"dist: this CPU job runs {ranks} trainer + inference ranks on {cores} CPU cores (the "
                     f"{cfg.world_size} processes would thrash): use at most {cores}, or set "
                     "--dist.allow-oversubscribe true")


def threads_per_rank(cfg: Base) -> int:
    """torch threads of one rank: dist.threads_per_rank; else OMP_NUM_THREADS when the environment
    sets it (`launch` sets it to this default when it is unset); else the node's cores shared by
    its trainer and inference ranks.

    On-policy RL without overlap alternates the two roles, so the active one could take the idle one's
    cores; that default was measured and dropped: on the shared 2-core machine (other jobs running) two
    threads per rank made a reverse-text RL step ~5x slower than one (docs/benchmarks.md, 2026-12-01
    late). With trainer.overlap_rollout (the default) and asynchronous RL both roles compute at once,
    which is what this share of the cores assumes.
    """
    if cfg.dist.threads_per_rank is not None:
        return cfg.dist.threads_per_rank
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, cpu_cores() // local_compute_ranks(cfg))


FAILURE_RECORD = "torchrun-failure.json"
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def launch(cfg: Base, module: str, preload: tuple[str, ...] = ()) -> int:
    """Run `module` under torchrun on one node; returns the exit code (130 after Ctrl-C).

    Takes RUN_DIR's lock first (exit 2 with one line naming the holder if another job has it), then
    writes RUN_DIR/config.json and starts the agent in a session of its own. When the ranks are forked
    (rank_start), `preload` (the modules most of the ranks import) is imported here first, once."""
    run_dir = Path(cfg.output_dir)
    started = time.time()
    try:
        lock_run_dir(run_dir)
        prepare_run_dir(cfg, module.rsplit(".", 1)[-1])
    except ValueError as e:  # another job took it since the pre-flight check
        fail(str(e))
    config_path = write_config(run_dir, cfg.model_dump_json(indent=2))
    logs = run_dir / "logs"
    for stale in (*logs.glob("error-rank*.txt"), *logs.glob("restart*-error-rank*.txt"), logs / FAILURE_RECORD):
        stale.unlink(missing_ok=True)
    restarts = run_dir / "restarts.jsonl"
    before = len(restarts.read_text().splitlines()) if restarts.is_file() else 0
    start = rank_start(cfg)
    # torchrun's arguments; --standalone spelled out (one agent, a fresh rendezvous on a free port)
    argv = [str(logs / FAILURE_RECORD), start, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={uuid.uuid4()}", f"--nproc-per-node={cfg.world_size}",
            f"--max-restarts={cfg.dist.max_restarts}", "-m", module, "@", str(config_path)]
    env = dict(os.environ)
    if cfg.dist.threads_per_rank is not None or "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(cfg))
    env[LOCK_ENV] = f"host {socket.gethostname()} pid {os.getpid()}"
    if start == "fork":
        for name in preload:  # the ranks inherit them: one import here instead of one per rank
            importlib.import_module(name)
    try:
        code, stopped_by = run_forwarding_signals(argv, env)
    finally:
        unlock_run_dir(run_dir)
    rows = restarts.read_text().splitlines()[before:] if restarts.is_file() else []
    num_restarts = sum(json.loads(r)["restart"] > 0 for r in rows)
    if num_restarts:
        print(f"meshrl: the job was restarted {num_restarts} time(s) after a rank failed; see {restarts} and "
              f"{run_dir}/logs/restart*-error-rank*.txt", file=sys.stderr, flush=True)
    if stopped_by is not None:
        print(f"meshrl: {stop_line(run_dir, cfg, module, stopped_by)}", file=sys.stderr, flush=True)
        return EXIT_SIGNAL[stopped_by]
    if code != 0:
        report_failure(run_dir, code)
    else:
        print_summary(cfg, module.rsplit(".", 1)[-1], time.time() - started)
    return code


def prepare_run_dir(cfg: Base, kind: str) -> None:
    """With RUN_DIR's lock held, before any rank writes: clear an earlier run's files when the run starts
    afresh with `overwrite` (or resume = "auto" finds no checkpoint), then mark it as a meshrl run
    directory. A torchrun restart keeps everything (it resumes)."""
    from meshrl.runtime.checkpoint import checkpoints_dir, find_checkpoint

    run_dir = Path(cfg.output_dir)
    if restart_count() == 0 and run_dir_contents(run_dir):
        auto_afresh = cfg.resume == "auto" and find_checkpoint(checkpoints_dir(run_dir), verify=False,
                                                               warn=False) is None
        if cfg.overwrite or auto_afresh:
            removed = clear_run_dir(run_dir)
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"meshrl: {'--overwrite' if cfg.overwrite else 'resume = auto, no checkpoint'}: removed "
                      f"{len(removed)} entries of the earlier run in {run_dir}", file=sys.stderr, flush=True)
        elif cfg.resume is False:
            check_run_dir_fresh(run_dir, overwrite=False)  # refused (the pre-flight check says so earlier)
    mark_run_dir(run_dir, kind)


RANK_START_ENV = "MESHRL_RANK_START"


def rank_start(cfg: Base) -> str:
    """How the agent starts the ranks of a job on this node: "fork" (the default for CPU jobs on Linux)
    forks them from a fork server (rank_server.py) that the agent forked at its start, while it was one
    thread, after the launcher imported torch and the rank program: a rank starts in milliseconds
    instead of importing torch and meshrl again (seconds each, on a few cores). "exec" (the default
    for GPU jobs: a process that touched CUDA cannot fork a CUDA rank) runs `python -m MODULE` for
    each, as plain torchrun does. MESHRL_RANK_START=exec|fork overrides."""
    forced = os.environ.get(RANK_START_ENV)
    if forced is not None:
        if forced not in ("exec", "fork"):
            raise ValueError(f"{RANK_START_ENV}={forced!r}: use exec or fork")
        return forced
    from meshrl.runtime.layout import use_cuda

    return "fork" if sys.platform.startswith("linux") and not use_cuda(cfg.dist.device) else "exec"


def run_forwarding_signals(argv: list[str], env: dict[str, str]) -> tuple[int, signal.Signals | None]:
    """Start the agent (agent_main(argv)) in a session of its own and wait for it, forwarding SIGINT and
    SIGTERM to it; a second one kills it. Returns (its exit code, negative for a signal as
    subprocess reports it; the first signal forwarded or None).

    On Linux the agent is this process, forked (torch is imported already: no second Python start),
    unless another Python thread runs here (launch() called from a threaded program: a lock it holds
    would be copied locked); elsewhere, or then, `python -m meshrl.runtime.launch --agent ARGV`."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:  # (fork_agent says why)
        pid = fork_agent(argv, env)
        send = lambda sig: os.kill(pid, sig)  # noqa: E731
        wait = lambda: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # noqa: E731
    else:
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.runtime.launch", "--agent", *argv], env=env,
                                start_new_session=True)
        send, wait = proc.send_signal, proc.wait
    got: list[signal.Signals] = []

    def forward(signum, frame):
        got.append(signal.Signals(signum))
        try:
            send(signal.SIGKILL if len(got) > 1 else signum)  # the agent stops its ranks
        except ProcessLookupError:
            pass  # it has just ended

    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {sig: signal.signal(sig, forward) for sig in EXIT_SIGNAL} if main else {}
    try:
        code = wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, (got[0] if got else None)


def fork_agent(argv: list[str], env: dict[str, str]) -> int:
    """Fork the agent: a session of its own, `env` as its environment, agent_main(argv); returns its pid.
    The child never returns into the caller's code: it ends with os._exit (no interpreter teardown).
    Called only while this process runs no other Python thread: fork copies the calling thread alone,
    and a lock another thread held would stay locked in the agent. (Native pools are their libraries'
    business: numpy's OpenBLAS, the one started by importing numpy, stops its threads before a fork.)"""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        release_locks()  # the launcher holds RUN_DIR's lock; the agent and ranks must not keep it alive
        os.environ.clear()
        os.environ.update(env)
        code = agent_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the agent ends here, loudly
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def stop_line(run_dir: Path, cfg: Base, module: str, sig: signal.Signals) -> str:
    """Where an interrupted run stopped and how to continue it."""
    from meshrl.runtime.checkpoint import checkpoints_dir, find_checkpoint

    metrics = run_dir / "metrics.jsonl"
    done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    found = find_checkpoint(checkpoints_dir(run_dir), verify=False, warn=False)
    what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else f"stopped by {sig.name}"
    command = f"meshrl {module.rsplit('.', 1)[-1]} @ {run_dir / 'config.json'}"
    if found is None:
        return (f"{what} after {done} of {cfg.max_steps} steps; no checkpoint was complete yet, so `{command} "
                f"--overwrite` starts it over (set checkpoint.every to make runs resumable)")
    return (f"{what} after {done} of {cfg.max_steps} steps; the latest checkpoint is step_{found[0]}: resume with "
            f"`{command} --resume`")


def report_failure(run_dir: Path, code: int) -> None:
    """Name the rank that failed first, from torchrun's record, then the others (one line each)."""
    logs = run_dir / "logs"
    errors = _error_files(logs)
    record_path = logs / FAILURE_RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    if record is None:
        if code < 0:
            print(f"meshrl: the torchrun agent was killed ({signal.Signals(-code).name}); its ranks died with it. "
                  f"See {logs}/", file=sys.stderr)
            return
        record = {"failures": []}  # the agent failed before any rank did (a rendezvous error, say)
    # torchrun lists the ranks that had failed when it first saw a failure, then those it stopped
    # itself (SIGTERM), all with times in whole seconds: within a second, a rank killed by a signal
    # (it did not fail because of a peer) comes first, then ranks by the time of their error files.
    # (Forked ranks: the rank server times every rank's end when it reaps it, launch.RankExits.)
    stopped = -int(signal.SIGTERM)
    order = sorted(record["failures"], key=lambda f: (f["exitcode"] == stopped, f["timestamp"], f["exitcode"] >= 0,
                                                      errors.get(f["rank"], {}).get("time", float("inf")), f["rank"]))
    ranks = [f["rank"] for f in order if f["exitcode"] != stopped or f["rank"] in errors or f is order[0]]
    ranks += sorted((r for r in errors if r not in ranks), key=lambda r: errors[r]["time"])
    if not ranks:
        print(f"meshrl: the job failed (exit {code}) and no rank left a Python error; see the torchrun output "
              f"above and {logs}/", file=sys.stderr)
    exits = {f["rank"]: f["exitcode"] for f in record["failures"]}
    for i, rank in enumerate(ranks[:6]):
        print(f"meshrl: {_failure_line(logs, rank, errors.get(rank), exits.get(rank))} "
              f"{'failed first' if i == 0 else 'then failed'}{_failure_reason(errors.get(rank), exits.get(rank))}",
              file=sys.stderr)
    if len(ranks) > 6:
        print(f"meshrl: ... and {len(ranks) - 6} more ranks (see {logs}/)", file=sys.stderr)


def _error_files(logs: Path) -> dict[int, dict[str, Any]]:
    """rank -> {who, last, time, path} of the error files of the last attempt."""
    out = {}
    for path in logs.glob("error-rank*.txt"):
        lines = path.read_text().strip().splitlines()
        time_line = lines[1] if len(lines) > 1 and lines[1].startswith("time ") else ""
        out[int(path.stem.removeprefix("error-rank"))] = {
            "who": lines[0] if lines else path.stem, "last": lines[-1] if len(lines) > 2 else "unknown error",
            "time": float(time_line[5:]) if time_line else path.stat().st_mtime, "path": path}
    return out


def _failure_line(logs: Path, rank: int, error: dict[str, Any] | None, exitcode: int | None) -> str:
    if error is not None:
        return error["who"]
    roles = [p.stem.split("-", 1)[1] for p in logs.glob(f"rank{rank}-*.log")]
    return f"rank {rank} ({roles[0] if roles else 'starting'})"


def _failure_reason(error: dict[str, Any] | None, exitcode: int | None) -> str:
    if error is not None:
        return f": {error['last']}  (traceback: {error['path']})"
    if exitcode is not None and exitcode < 0:
        return f": killed by {signal.Signals(-exitcode).name} (no Python error)"
    return f": exit code {exitcode} and no error file (see its output above)" if exitcode is not None else ""


# ----------------------------------------------------------------------------- the agent


def agent_main(argv: list[str]) -> int:
    """The agent: `RECORD START TORCHRUN_ARGS...` (START: exec or fork, rank_start). torchrun's agent,
    which dies with the launcher, writes torchrun's record of a failure to RECORD (rank, pid, exit
    code, time of every rank that had failed when torchrun first saw one) and prints torchrun's
    summary without a Python traceback; stopped by a signal, it exits 128 + the signal quietly.
    Returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    die_with_parent(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_quiet_shutdown)
    record, start = Path(argv[0]), argv[1]
    args = parse_args(argv[2:])
    config, entrypoint, entry_args = config_from_args(args)
    exits = None
    if start == "fork" and not (rank_server.supported() and rank_server.thread_count() == 1):
        print(f"meshrl: the ranks are started with exec ({rank_server.unsupported_reason()})", file=sys.stderr)
    elif start == "fork":  # from a server forked now, while this process is one thread (rank_server says why)
        global RANK_EXITS
        exits = RANK_EXITS = RankExits()
        rank_server.install(exits.write, lambda: die_with_parent(signal.SIGKILL))
        exits.start()
        config.start_method = "forkserver"  # multiprocessing's protocol, served by rank_server
        entrypoint, entry_args = forked_rank, [args.training_script, *args.training_script_args]
    try:
        elastic_launch(config, entrypoint)(*entry_args)
    except ChildFailedError as e:
        root, _ = e.get_first_failure()
        failures = {rank: {"rank": rank, "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                           "timestamp": f.timestamp, "message": f.message} for rank, f in e.failures.items()}
        if exits is not None:  # torchrun saw one forked rank fail; these are all of them, timed when reaped
            failures.update(exits.failures())
            for rank, f in failures.items():  # a rank's error file says when it failed, before its exit
                error = record.parent / f"error-rank{rank}.txt"
                if error.is_file():
                    f["timestamp"] = error.stat().st_mtime
                elif isinstance(f["timestamp"], int):  # torchrun's whole second: no report of the server yet
                    f["timestamp"] = time.time()
            root = min(failures.values(), key=lambda f: f["timestamp"])["rank"]
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"root": root, "failures": [failures[r] for r in sorted(failures)]}, indent=1))
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


class RankExits:
    """The agent's record of how its forked ranks ended. torchrun's record of forked (multiprocessing)
    workers holds only the first failure it finds at a poll, the lowest local rank among those already
    dead, not the rank that failed first. Each forked rank announces "S PID ATTEMPT RANK LOCAL_RANK" on
    a pipe at its start, and the rank server (rank_server.py, which reaps them) "E PID EXITCODE TIME"
    at its end; a thread of the agent reads them."""

    def __init__(self):
        self.read, self.write = os.pipe()
        self.ranks: dict[int, tuple[int, int, int]] = {}  # pid -> (attempt, rank, local rank)
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (exit code, negative for a signal; time)

    def start(self) -> None:
        """Start the reading thread (after rank_server.install: the server must be forked without it)."""
        threading.Thread(target=self._read, name="rank-exits", daemon=True).start()

    def announce(self) -> None:
        """In a forked rank, at its start."""
        env = os.environ
        os.write(self.write, f"S {os.getpid()} {env.get('TORCHELASTIC_RESTART_COUNT', '0')} {env['RANK']} "
                             f"{env['LOCAL_RANK']}\n".encode())

    def failures(self) -> dict[int, dict[str, Any]]:
        """rank -> failure (torchrun's record format) of the last attempt's ranks that ended non-zero."""
        time.sleep(0.05)  # the ranks torchrun stopped have ended: let the server's reports arrive
        last = max((a for a, _, _ in self.ranks.values()), default=0)
        return {rank: {"rank": rank, "local_rank": local, "pid": pid, "exitcode": self.exits[pid][0],
                       "timestamp": self.exits[pid][1], "message": ""}
                for pid, (attempt, rank, local) in list(self.ranks.items())
                if attempt == last and pid in self.exits and self.exits[pid][0] != 0}

    def _read(self) -> None:
        pending = b""
        while chunk := os.read(self.read, 4096):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                kind, pid, *rest = line.split()
                if kind == b"S":
                    self.ranks[int(pid)] = tuple(map(int, rest))  # type: ignore[assignment]
                else:
                    self.exits[int(pid)] = (int(rest[0]), float(rest[1]))


RANK_EXITS: RankExits | None = None  # the agent's, inherited by the ranks it forks


def forked_rank(module: str, *argv: str) -> None:
    """A rank forked from the agent: `python -u -m MODULE ARGV` without a new interpreter. The agent's
    signal handlers (torchrun's, which raise in Python) give way to the defaults a fresh rank has."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    if RANK_EXITS is not None:
        RANK_EXITS.announce()
    for stream in (sys.stdout, sys.stderr):  # unbuffered, as torchrun's `python -u`
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [module, *argv]
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, as in a fresh rank
    importlib.import_module(module).main(list(argv))


def _quiet_shutdown(record: logging.LogRecord) -> bool:
    """Drop torchrun's per-process lines of a shutdown ("Received 2 death signal", "Sending process N
    closing signal SIGTERM"): the launcher says in one line what stopped the job."""
    message = record.getMessage()
    return "death signal" not in message and "closing signal" not in message


def die_with_parent(sig: signal.Signals) -> None:
    """Get `sig` when the parent process dies (Linux prctl PR_SET_PDEATHSIG); elsewhere a watchdog
    thread that kills this process when it is re-parented."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), sig)
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def rank_main(cls: type[Base], argv: list[str], preflight: Callable[[Base], None], role: str,
              body: Callable[[Base, Path], None]) -> None:
    """The start of every rank program: die with the agent, validate, lock the run directory (rank
    0 of a job started by torchrun directly), heartbeat, then run `body(cfg, run_dir)` guarded."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the rank ends at once, without a traceback
    cfg, _ = parse_or_exit(cls, argv, preflight)
    import torch

    torch.set_num_threads(threads_per_rank(cfg))  # the ranks of a node share its cores
    run_dir = Path(cfg.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    direct = rank == 0 and LOCK_ENV not in os.environ  # started by torchrun itself, not by `meshrl`
    started = time.time()
    if direct:
        from meshrl.runtime.checkpoint import check_resume

        try:
            lock_run_dir(run_dir)
            check_resume(cfg, role_kind(cls))  # the launcher's pre-flight check of the run directory
            prepare_run_dir(cfg, role_kind(cls))
        except ValueError as e:
            fail(str(e))
    archive_error(run_dir, rank)
    liveness = start_liveness(cfg.dist.heartbeat_timeout_s, lambda *silent: on_silent(run_dir, rank, *silent))
    guarded(run_dir, rank, role, lambda: body(cfg, run_dir))
    if liveness is not None:
        liveness.close()
    # started by torchrun itself: the rank that wrote metrics.jsonl (the controller; sft's rank 0) sums up
    if LOCK_ENV not in os.environ and ACTIVITY["role"] == ("controller" if role_kind(cls) == "rl" else "trainer") \
            and (role_kind(cls) == "rl" or rank == 0):
        print_summary(cfg, role_kind(cls), time.time() - started)


def role_kind(cls: type[Base]) -> str:
    """"rl" or "sft": the program a root config class belongs to."""
    return "sft" if cls.__name__ == "SFTConfig" else "rl"


def on_silent(run_dir: Path, rank: int, silent: int, message: str, beat: dict[str, Any] | None) -> None:
    """A watched rank fell silent (runtime/liveness.py). On this host: its error file says so and it
    is killed (torchrun then ends or restarts the job). Elsewhere, or when the store itself stopped
    answering (no beat): this rank fails with the message."""
    log.error("%s", message)
    if beat is not None and beat["host"] == socket.gethostname():
        write_error(run_dir, silent, beat["role"], f"HeartbeatTimeout: {message}; killed by rank {rank}")
        print(f"[rank {rank} {ACTIVITY['role']}] {message}; killing it", file=sys.stderr, flush=True)
        try:
            os.kill(beat["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died meanwhile: torchrun has seen that
        return
    write_error(run_dir, rank, ACTIVITY["role"], f"HeartbeatTimeout: {message}")
    print(f"[rank {rank} {ACTIVITY['role']}] HeartbeatTimeout: {message}", file=sys.stderr, flush=True)
    os._exit(1)


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


if __name__ == "__main__" and sys.argv[1:2] == ["--agent"]:
    sys.exit(agent_main(sys.argv[2:]))
