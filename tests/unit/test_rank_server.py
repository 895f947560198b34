"""The rank server (runtime/rank_server.py): ranks forked from a process whose other threads hold
locks do not inherit those locks, and every rank's end reaches the agent.

The script runs in a fresh interpreter (one thread, as the agent is when it forks the server): a
thread then takes a lock and keeps it, as one of torchrun's threads may hold one of its own. A
process forked from that state directly (start method "fork") finds the lock taken forever, which
is how a forked rank of a 6-rank job hung before init_process_group; one started through the rank
server finds it free.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, threading, time
    from meshrl.runtime import rank_server

    held = threading.Lock()

    def try_lock(q):
        q.put((held.acquire(timeout=2), rank_server.thread_count(), os.getppid()))

    def report(fd):
        kind, pid, code, _ = os.read(fd, 200).decode().split()
        return kind, int(pid), int(code)

    read, write = os.pipe()
    server = rank_server.install(write, lambda: None)
    holder = threading.Thread(target=lambda: (held.acquire(), time.sleep(120)), daemon=True)
    holder.start()
    while not held.locked():
        time.sleep(0.01)
    try:
        rank_server.install(write, lambda: None)
        print("second install: allowed")
    except RuntimeError as e:
        print("second install:", e)
    for method in ("fork", "forkserver"):
        ctx = mp.get_context(method)
        q = ctx.SimpleQueue()
        p = ctx.Process(target=try_lock, args=(q,))
        p.start()
        p.join(30)
        free, threads, parent = q.get()
        print(method, "lock free:", free, threads, "exit", p.exitcode, "parent is the server:", parent == server)
        if method == "forkserver":
            print("reported", report(read) == ("E", p.pid, 0))
    p = mp.get_context("forkserver").Process(target=time.sleep, args=(60,))
    p.start()
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    print("killed: exit", p.exitcode, "reported", report(read) == ("E", p.pid, -9))
""")


def test_ranks_from_the_rank_server_do_not_inherit_locks_held_by_other_threads(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "second install: the rank server must be forked from a process of one thread, not 2"
    # forked directly: the holder's lock stays taken in the child
    assert lines[1] == "fork lock free: False 1 exit 0 parent is the server: False"
    # through the server: free; the rank is the server's child, and its end is reported on the pipe
    assert lines[2] == "forkserver lock free: True 1 exit 0 parent is the server: True"
    assert lines[3] == "reported True"
    assert lines[4] == "killed: exit -9 reported True"
