"""The pieces of issue 13 on their own: the run directory's lock, heartbeats naming a silent rank,
the launcher's failure report from torchrun's record, the watch that stops a run that is not
training, and ranks dying with their parent. The end-to-end tests under torchrun are in
tests/integration/test_run_safety.py."""

import json
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshrl.runtime import launch
from meshrl.runtime.liveness import Liveness, interval_for
from meshrl.runtime.rundir import (NotTrainingError, TrainingWatch, check_run_dir_free, lock_run_dir,
                                   unlock_run_dir, write_error)

HOLD = """
import sys, time
from pathlib import Path
from meshrl.runtime.rundir import lock_run_dir
lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_job_on_a_run_dir_is_refused_with_the_holders_host_and_pid(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for attempt in (lock_run_dir, check_run_dir_free):
            with pytest.raises(ValueError, match=rf"is in use by another job \(host {socket.gethostname()} pid "
                                                 rf"{holder.pid} since .*\): wait for it to end"):
                attempt(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    check_run_dir_free(tmp_path)  # the lock died with its process: nothing to clean up
    lock_run_dir(tmp_path)
    lock_run_dir(tmp_path)  # this process holds it already
    check_run_dir_free(tmp_path)
    probe = [sys.executable, "-c", "import sys; from pathlib import Path; from meshrl.runtime.rundir import "
             "check_run_dir_free; check_run_dir_free(Path(sys.argv[1]))", str(tmp_path)]
    assert "is in use by another job" in subprocess.run(probe, capture_output=True, text=True).stderr
    unlock_run_dir(tmp_path)  # a launcher gives it back when its job has ended
    assert subprocess.run(probe, capture_output=True, text=True).returncode == 0


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_heartbeats_name_a_silent_rank_its_role_and_its_last_activity():
    store = _store()
    silent = []
    watcher = Liveness(lambda: store, 0, 3, 6.0, "meshrl/attempt-0", lambda *a: silent.append(a))
    beat = {"n": 1, "done": False, "role": "inference", "phase": "engine step with weights v3", "since": time.time(),
            "host": "node7", "pid": 4242, "time": time.time()}
    store.set(watcher.key(1), json.dumps(beat))
    store.set(watcher.key(2), json.dumps({**beat, "role": "controller"}))
    watcher.check(store, now=100.0)
    store.set(watcher.key(2), json.dumps({**beat, "n": 2, "role": "controller"}))  # rank 2 beats on
    watcher.check(store, now=105.0)
    assert not silent
    watcher.check(store, now=106.5)  # rank 1: 6.5 s without a new beat
    assert len(silent) == 1 and silent[0][0] == 1
    message = silent[0][1]
    assert message.startswith("rank 1 (inference) sent no heartbeat for 6.5s (dist.heartbeat_timeout_s); its last "
                              "activity: 'engine step with weights v3' since ")
    assert "(as of its last heartbeat, " in message
    assert "on host node7 pid 4242" in message
    # a rank that finished says so and is not watched any more; the others watch rank 0 only
    assert watcher.watched == [2]  # reported once
    store.set(watcher.key(2), json.dumps({**beat, "n": 3, "done": True}))
    watcher.check(store, now=200.0)
    assert watcher.watched == [] and len(silent) == 1
    assert Liveness(lambda: store, 2, 3, 6.0, "p", None).watched == [0]
    assert interval_for(60.0) == 5.0 and interval_for(3.0) == 0.5


def test_a_heartbeat_thread_publishes_says_its_new_role_at_once_and_says_done():
    from meshrl.runtime.rundir import ACTIVITY

    store = _store()
    old_role = ACTIVITY["role"]
    live = Liveness(lambda: store, 1, 2, 6.0, "meshrl/attempt-0", lambda *a: None).start()  # a beat a second
    try:
        time.sleep(0.3)
        first = json.loads(store.get(live.key(1)))
        ACTIVITY["role"] = "trainer"  # as setup_logging does once the roles are known
        time.sleep(0.8)
        second = json.loads(store.get(live.key(1)))
        assert second["n"] == first["n"] + 1 and second["role"] == "trainer" and not first["done"]
    finally:
        live.close()
        ACTIVITY["role"] = old_role
    assert json.loads(store.get(live.key(1)))["done"]


def test_a_store_that_stops_answering_is_reported_too():
    def gone():
        raise dist.DistStoreError("Socket Timeout")

    silent = []
    live = Liveness(gone, 1, 2, 0.6, "p", lambda *a: silent.append(a)).start()
    live._thread.join(5)
    assert silent == [(-1, "torchrun's store did not answer this rank's heartbeats: Socket Timeout", None)]


def test_the_launcher_names_the_rank_torchrun_saw_fail_first(tmp_path, capsys):
    """The issue's case: the trainer is SIGKILLed; the controller, whose PeerError is the only Python
    error, must not be named first. Ranks torchrun stopped itself (SIGTERM) are left out."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0-trainer.log").write_text("")
    write_error(tmp_path, 2, "controller", "Traceback ...\nPeerError: receiving from rank 0 (trainer) failed")
    t = int(time.time())
    record = {"root": 2, "failures": [
        {"rank": 0, "local_rank": 0, "pid": 10, "exitcode": -9, "timestamp": t, "message": ""},
        {"rank": 1, "local_rank": 1, "pid": 11, "exitcode": -15, "timestamp": t, "message": ""},
        {"rank": 2, "local_rank": 2, "pid": 12, "exitcode": 1, "timestamp": t, "message": ""}]}
    (logs / launch.FAILURE_RECORD).write_text(json.dumps(record))
    launch.report_failure(tmp_path, 1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "meshrl: rank 0 (trainer) failed first: killed by SIGKILL (no Python error)"
    assert lines[1].startswith("meshrl: rank 2 (controller) then failed: PeerError: receiving from rank 0")
    assert len(lines) == 2
    # a failure one second earlier comes first whatever its kind
    record["failures"][2]["timestamp"] = t - 1
    (logs / launch.FAILURE_RECORD).write_text(json.dumps(record))
    launch.report_failure(tmp_path, 1)
    assert capsys.readouterr().err.startswith("meshrl: rank 2 (controller) failed first: PeerError")


def test_a_run_that_is_not_training_stops_after_its_window():
    watch = TrainingWatch(3)
    watch.step(0, 1.0, rollouts=16, failed=16)
    watch.step(1, float("nan"), rollouts=16, failed=0)
    watch.step(2, 0.5, rollouts=16, failed=3)  # a good step resets the count
    watch.step(3, 0.0, rollouts=16, failed=0)  # a step with nothing to learn from (all groups filtered) is fine
    watch.step(4, float("inf"))
    watch.step(5, 1.0, rollouts=16, failed=16)
    with pytest.raises(NotTrainingError, match=r"in each of its last 3 steps \(4-6\) the update was non-finite "
                                               r"\(skipped\) \(1 steps\) or every rollout failed \(2 steps\)"):
        watch.step(6, 1.0, rollouts=16, failed=16)


CHILD = """
import sys, time, signal
from meshrl.runtime.launch import die_with_parent
die_with_parent(signal.SIGKILL)
print("ready", flush=True)
time.sleep(60)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_rank_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_agent_does_not_keep_the_run_dirs_lock(tmp_path):
    """The launcher forks the agent while it holds RUN_DIR's lock: once the launcher gives the lock back,
    the directory is free even while the agent (or a rank forked from it) still runs."""
    import os

    from meshrl.runtime.rundir import release_locks

    lock_run_dir(tmp_path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the agent: lets go of its copy of the descriptor, then lives on for a while
        release_locks()
        os.write(write, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(read, 1) == b"x"
        unlock_run_dir(tmp_path)
        check_run_dir_free(tmp_path)  # would raise if the child still held the flock
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_cpu_jobs_fork_their_ranks_unless_told_otherwise(monkeypatch):
    from meshrl.runtime.config import RLConfig

    cfg = RLConfig(model={"flavor": "debug", "tokenizer": "char"}, dist={"device": "cpu"})
    monkeypatch.delenv(launch.RANK_START_ENV, raising=False)
    assert launch.rank_start(cfg) == "fork"  # a CPU job on Linux
    monkeypatch.setenv(launch.RANK_START_ENV, "fork")
    assert launch.rank_start(cfg) == "fork"
    monkeypatch.setenv(launch.RANK_START_ENV, "exec")
    assert launch.rank_start(cfg) == "exec"
    monkeypatch.setenv(launch.RANK_START_ENV, "spawn")
    with pytest.raises(ValueError, match="MESHRL_RANK_START='spawn': use exec or fork"):
        launch.rank_start(cfg)
