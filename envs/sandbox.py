"""Running untrusted code with time and memory limits: model output (tools) and user reward code.

`run_python(code, limits)` runs ``code`` in a fresh ``python -I -S`` subprocess: its own
session (the whole process group is killed on timeout), an empty temporary working directory,
an empty environment, and resource limits set before it starts:

    RLIMIT_AS     memory_mb of address space (a larger allocation raises MemoryError)
    RLIMIT_CPU    the timeout, rounded up (a busy loop is killed by the kernel too)
    RLIMIT_FSIZE  files of at most 1 MiB; RLIMIT_CORE 0 (no core dumps)

and no network: the child enters a new network namespace (``unshare(CLONE_NEWNET)``, or a
user + network namespace when it lacks CAP_SYS_ADMIN), which has no interfaces but loopback.
Where the kernel allows neither, ``network="auto"`` runs the child with the network it has
and says so (`network_isolation()` is False; a warning is logged once), while
``network="required"`` raises instead. This is a resource guard, not a security boundary
against a determined attacker: the child runs as the same user and sees the same files.

`call_in_subprocess(fn, *args, limits)` runs a Python callable (a user's reward function) in a
forked child with the same time limit and ``memory_mb`` of address space beyond what the
parent had mapped, and returns its (picklable) result.

Both raise `SandboxError` with ``kind`` "timeout", "memory" or "crashed" when the limits or the
child's death end the run; `run_python` returns normally when the code itself fails (a tool's
error message is the model's business), `call_in_subprocess` raises kind "error" with the
child's traceback.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Literal

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "call_in_subprocess", "network_isolation", "run_python"]

log = logging.getLogger("meshrl")

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_MAX_FILE_BYTES = 1 << 20
_MAX_OUTPUT_BYTES = 1 << 16


class SandboxError(RuntimeError):
    """A sandboxed run ended by its limits or its death; ``kind``: timeout, memory, crashed, error."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    memory_mb: int = 256
    network: Literal["auto", "required"] = "auto"

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 16:
            raise ValueError(f"memory_mb must be >= 16, got {self.memory_mb}")


@dataclass
class SandboxResult:
    """A finished run: exit code and (truncated) output."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


_namespace_flags: int | None = None  # probed once: the unshare flags that work here (0: none)
_warned = False


_libc = None


def _load_libc() -> None:
    # In the parent: a child must not dlopen after fork (another thread may hold the loader's lock).
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


def _probe_flags(flags: int) -> bool:
    """Whether a child can enter these namespaces (tried in a throw-away child process)."""
    pid = os.fork()
    if pid == 0:  # the child only calls unshare and exits: safe after fork in a threaded parent
        os._exit(0 if _unshare(flags) else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def network_isolation() -> bool:
    """Whether sandboxed children run without network on this machine."""
    global _namespace_flags
    if _namespace_flags is None:
        _load_libc()
        _namespace_flags = next((f for f in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET) if _probe_flags(f)), 0)
    return _namespace_flags != 0


def _check_network(limits: SandboxLimits) -> int:
    global _warned
    if network_isolation():
        return _namespace_flags  # type: ignore[return-value]
    if limits.network == "required":
        raise SandboxError("crashed", "network isolation is required but this kernel allows no new network "
                                      "namespace (unshare CLONE_NEWNET / CLONE_NEWUSER failed)")
    if not _warned:
        log.warning("sandbox: no network namespace available here; sandboxed code keeps the host's network")
        _warned = True
    return 0


def _set_limits(memory_bytes: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` with ``python -I -S`` under ``limits`` (see the module docstring).

    Returns the exit code and output, whatever the code did; raises SandboxError (timeout,
    memory, crashed) when the limits or a signal ended it.
    """
    flags = _check_network(limits)
    memory_bytes = limits.memory_mb << 20
    cpu_s = max(1, int(limits.timeout_s + 0.999))

    def prepare() -> None:  # in the child, before exec: only async-signal-safe work
        if flags and not _unshare(flags):
            os._exit(125)
        _set_limits(memory_bytes, cpu_s)

    with tempfile.TemporaryDirectory(prefix="meshrl-sandbox-") as workdir:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env={},
                                start_new_session=True, preexec_fn=prepare)
        try:
            out, err = proc.communicate(stdin.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise SandboxError("timeout", f"the code ran longer than {limits.timeout_s:g}s") from None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    stdout = out[:_MAX_OUTPUT_BYTES].decode(errors="replace")
    stderr = err[-_MAX_OUTPUT_BYTES:].decode(errors="replace")
    code_ = proc.returncode
    if code_ == 125:
        raise SandboxError("crashed", "could not enter a network namespace")
    if code_ == -signal.SIGXCPU or code_ == -signal.SIGKILL:
        raise SandboxError("timeout", f"the code used more than {cpu_s}s of CPU")
    if code_ < 0:
        raise SandboxError("crashed", f"killed by signal {-code_}")
    last_line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if code_ != 0 and last_line.startswith("MemoryError"):
        raise SandboxError("memory", f"the code exceeded {limits.memory_mb} MiB")
    return SandboxResult(code_, stdout, stderr)


def _mapped_bytes() -> int:
    """Address space the calling process maps now (VmSize), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(conn, fn: Callable[..., Any], args: tuple, memory_mb: int, cpu_s: int) -> None:
    try:
        limit = _mapped_bytes() + (memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        result = fn(*args)
        conn.send(("ok", result))
    except MemoryError:
        conn.send(("memory", f"exceeded {memory_mb} MiB"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it as SandboxError
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def call_in_subprocess(fn: Callable[..., Any], *args: Any, limits: SandboxLimits = SandboxLimits()) -> Any:
    """``fn(*args)`` in a forked child under ``limits`` (time; memory beyond the parent's own).

    The child starts as a copy of this process (fn and args need not be picklable; the result
    must be). Raises SandboxError: timeout, memory, crashed, or error (fn raised; its traceback).
    """
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    cpu_s = max(1, int(limits.timeout_s + 0.999))
    proc = ctx.Process(target=_child, args=(send, fn, args, limits.memory_mb, cpu_s), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(limits.timeout_s):
            raise SandboxError("timeout", f"the call ran longer than {limits.timeout_s:g}s")
        try:
            status, payload = recv.recv()
        except EOFError:
            proc.join(1.0)
            raise SandboxError("crashed", f"the child died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
    if status == "ok":
        return payload
    if status == "memory":
        raise SandboxError("memory", payload)
    raise SandboxError("error", payload)
