"""The fork server of a job's forked CPU ranks (MESHRL_RANK_START=fork, runtime/launch.py).

fork() copies only the thread that calls it. A lock that another thread holds at that moment (a
mutex of torch's C++ runtime, a Python lock, a libc one) is copied locked, and nothing in the child
ever releases it: the child blocks on it for good. torchrun's agent has threads by the time it
starts its workers: the libuv loops of the rendezvous TCPStores, the rendezvous keep-alive timer,
and the agent's own watch of its ranks (launch.RankExits). Ranks forked from the agent directly
could therefore hang (one did: a rank of a 6-rank job stuck in a futex before init_process_group).

So the agent forks this server first, at its start, while it is still one thread (`install`
checks; the launcher forks the agent only while it runs no other Python thread), and never lets a
thread into it. The
server has every module the ranks need imported already (the launcher imported the rank program's
PRELOAD before forking the agent), and forks the ranks: each starts in milliseconds, from a
process whose state no other thread can have left half-changed.

It speaks multiprocessing's forkserver protocol, so torchrun starts and watches the ranks with its
own start method "forkserver" (their pids, exit codes, SIGTERM on a stop); `install` makes
multiprocessing use this server instead of starting a fresh interpreter. On top of the protocol,
every rank's end (pid, exit code, time) goes to the agent on `report` (launch.RankExits), because
the ranks are not the agent's children and it cannot wait for them itself. The server dies with
the agent (parent-death signal SIGKILL), and the ranks with the server (rank_main's
die_with_parent), so a killed agent leaves no process behind.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable


def thread_count() -> int:
    """Threads of this process, Python's and native ones (/proc/self/task; 1 where that is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def supported() -> bool:
    """The protocol this module speaks is multiprocessing's up to Python 3.13 (3.14 adds an
    authentication step to it); Linux only (the agent is forked there only)."""
    return sys.platform.startswith("linux") and sys.version_info < (3, 14)


def unsupported_reason() -> str:
    """Why the ranks cannot be forked from this process (for a one-line message)."""
    if not supported():
        return f"forked ranks need Linux and Python < 3.14, not {sys.platform} {sys.version.split()[0]}"
    return f"the agent runs {thread_count()} threads, and forking one would copy the others' locks"


def install(report: int, in_server: Callable[[], None]) -> int:
    """In the agent, while it is one thread: fork the server and make it multiprocessing's fork server
    for this process. `report`: the write end of the agent's pipe for rank ends; `in_server` runs first
    in the server (the agent's: die with it). Returns the server's pid."""
    from multiprocessing import connection, forkserver, resource_tracker

    if thread_count() != 1:
        raise RuntimeError(f"the rank server must be forked from a process of one thread, not {thread_count()}")
    resource_tracker.ensure_running()  # shared by the ranks (multiprocessing's semaphores); a fresh interpreter
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # every client holds alive_w: EOF when the agent and all ranks are gone
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(alive_w)
            in_server()
            serve(listener, alive_r, report)
            code = 0
        except BaseException:  # noqa: BLE001 - the server ends here, loudly
            traceback.print_exc()
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def serve(listener: socket.socket, alive_r: int, report: int) -> None:
    """The server's loop (one thread): fork a rank for each request, send each client its rank's pid
    and, once reaped, its exit code; report every end on `report` as "E PID EXITCODE TIME"."""
    from multiprocessing import forkserver, reduction

    sig_r, sig_w = os.pipe()
    for fd in (sig_r, sig_w):
        os.set_blocking(fd, False)
    handlers = {signal.SIGCHLD: lambda *_: None, signal.SIGINT: signal.SIG_IGN}  # SIGCHLD wakes the loop
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    signal.set_wakeup_fd(sig_w)
    clients: dict[int, int] = {}  # rank pid -> the status pipe of the client that asked for it
    with selectors.DefaultSelector() as selector:
        for obj in (listener, alive_r, sig_r):
            selector.register(obj, selectors.EVENT_READ)
        while True:
            ready = [key.fileobj for key, _ in selector.select()]
            if alive_r in ready:
                return
            if sig_r in ready:
                os.read(sig_r, 65536)
                _reap(clients, report)
            if listener in ready:
                with listener.accept()[0] as conn:
                    child_r, child_w, *fds = reduction.recvfds(conn, forkserver.MAXFDS_TO_SEND + 1)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        listener.close()
                        selector.close()
                        unused = [alive_r, child_w, sig_r, sig_w, *clients.values()]
                        code = forkserver._serve_one(child_r, fds, unused, previous)
                    except Exception:  # noqa: BLE001
                        sys.excepthook(*sys.exc_info())
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
                try:
                    forkserver.write_signed(child_w, pid)
                except BrokenPipeError:
                    pass  # the client has gone
                clients[pid] = child_w
                for fd in (child_r, *fds):
                    os.close(fd)


def _reap(clients: dict[int, int], report: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        try:
            os.write(report, f"E {pid} {code} {time.time()}\n".encode())
        except BrokenPipeError:
            pass  # the agent has gone
        client = clients.pop(pid, None)
        if client is not None:
            from multiprocessing import forkserver

            try:
                forkserver.write_signed(client, code)
            except BrokenPipeError:
                pass
            os.close(client)
