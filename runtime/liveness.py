"""Heartbeats of every rank, so that a frozen rank ends the job within dist.heartbeat_timeout_s.

A dead rank closes its connections and its peers fail at once; a frozen one (SIGSTOP, a machine
swapping, a driver stuck in the kernel) keeps them open, and its peers would wait for the
channel timeouts (dist.message_timeout_s, an hour). So every rank runs one thread that

    publishes   meshrl/attempt-A/heartbeat/R = {n, role, phase, since, host, pid, time}
                on torchrun's store every interval (timeout / 6, at most 5 s; at once when the
                rank learns its role), and
    watches     rank 0 watches every other rank, every other rank watches rank 0: a watched rank
                whose n has not changed for the timeout, measured on the watcher's own clock (no
                clock skew), is reported and the job ends.

Reporting is `on_silent(rank, message, beat)`; the rank program's (runtime/launch.py) writes the
message into the silent rank's error file and kills it if it runs on this host (a stopped process
otherwise delays torchrun's teardown by its 30 s grace period), or fails this rank with it, so
torchrun ends the job, or restarts it under dist.max_restarts. A store that stops answering
(its host froze) is reported the same way, with rank -1 and no beat. `role` and `phase` come from runtime/rundir.py's
ACTIVITY (set by setup_logging and by every Heartbeat.set): the message names the rank, its role
and its last activity. A rank that finishes publishes `done` and is not watched after that.

It watches processes, not progress: a rank busy in a long step still beats. A rank that never
published (frozen before its thread started) is left to the rendezvous and the collectives'
dist.timeout_s. The store is torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE), or rank 0's
when the agent does not share one; the thread has its own client connection.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from meshrl.runtime.rundir import ACTIVITY, log


def interval_for(timeout_s: float) -> float:
    """How often a rank publishes and checks: six beats per timeout, at most every 5 s."""
    return min(5.0, timeout_s / 6)


def describe(rank: int, beat: dict[str, Any], silent_s: float) -> str:
    """One line: which rank fell silent, its role, and its last known activity."""
    clock = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
    return (f"rank {rank} ({beat['role']}) sent no heartbeat for {silent_s:.1f}s (dist.heartbeat_timeout_s); "
            f"its last activity: {beat['phase']!r} since {clock(beat['since'])} (as of its last heartbeat, "
            f"{clock(beat['time'])}), on host {beat['host']} pid {beat['pid']}")


class Liveness:
    """One rank's heartbeat thread: publish its own beat, watch its peers' (see the module docstring)."""

    def __init__(self, store_factory: Callable[[], Any], rank: int, world_size: int, timeout_s: float, prefix: str,
                 on_silent: Callable[[int, str, dict[str, Any] | None], None]):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = interval_for(timeout_s)
        self.prefix = prefix
        self.on_silent = on_silent
        self._store_factory = store_factory
        self._n = 0
        self._done = threading.Event()
        self.watched = list(range(1, world_size)) if rank == 0 else [0]
        self._seen: dict[int, tuple[int, float, dict[str, Any]]] = {}  # rank -> (n, when it changed, beat)
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def key(self, rank: int) -> str:
        return f"{self.prefix}/heartbeat/{rank}"

    def beat(self, done: bool = False) -> dict[str, Any]:
        self._n += 1
        return {"n": self._n, "done": done, "role": ACTIVITY["role"], "phase": ACTIVITY["phase"],
                "since": ACTIVITY["since"], "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}

    def close(self) -> None:
        """This rank is finishing: say so (its watchers stop watching it), then stop the thread."""
        self._done.set()
        self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        import torch.distributed as dist

        try:
            store = self._store_factory()
            role, last = None, -self.interval_s
            while not self._done.is_set():
                now = time.monotonic()
                if now - last >= self.interval_s or ACTIVITY["role"] != role:  # a new role is said at once
                    role, last = ACTIVITY["role"], now
                    store.set(self.key(self.rank), json.dumps(self.beat()))
                    self.check(store, now)
                self._done.wait(min(0.5, self.interval_s))
            store.set(self.key(self.rank), json.dumps(self.beat(done=True)))
        except (dist.DistStoreError, dist.DistNetworkError) as e:  # its host (agent or rank 0) froze or went
            self.on_silent(-1, f"torchrun's store did not answer this rank's heartbeats: {e}", None)

    def check(self, store, now: float) -> None:
        """Read the watched ranks' beats; report the first one silent for longer than the timeout."""
        present = [r for r in self.watched if r in self._seen or store.check([self.key(r)])]
        values = store.multi_get([self.key(r) for r in present]) if present else []
        for r, raw in zip(present, values):
            beat = json.loads(raw)
            if beat["done"]:
                self.watched.remove(r)
                continue
            last = self._seen.get(r)
            if last is None or last[0] != beat["n"]:
                self._seen[r] = (beat["n"], now, beat)
            elif now - last[1] > self.timeout_s:
                self.watched.remove(r)  # reported once; torchrun ends or restarts the job
                self.on_silent(r, describe(r, beat, now - last[1]), beat)
                return


def start_liveness(timeout_s: float, on_silent: Callable[[int, str, dict[str, Any] | None], None]) -> Liveness | None:
    """Start this rank's heartbeat thread under torchrun (None outside torchrun: nothing to watch)."""
    env = os.environ
    if "MASTER_ADDR" not in env or "RANK" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    import torch.distributed as dist

    # a prefix per attempt on the agent's store, which outlives attempts (one agent: one count);
    # without it (several agents) each attempt has a fresh store on rank 0 and the agents' counts differ
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) if shared else 0

    def connect():
        # its own client (the thread's only), so it never waits behind the process group's requests
        return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=max(timeout_s, 60.0)))

    liveness = Liveness(connect, int(env["RANK"]), int(env["WORLD_SIZE"]), timeout_s, f"meshrl/attempt-{attempt}",
                        on_silent)
    log.debug("heartbeats every %.1fs, timeout %.0fs", liveness.interval_s, timeout_s)
    return liveness.start()
