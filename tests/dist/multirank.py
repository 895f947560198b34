"""Run a function on several real processes with gloo (a tiny torchrun for tests).

The ranks are started by multiprocessing's fork server, which imports torch and the heavy modules the
tests use once per pytest session (PRELOAD) and forks every rank from that state: a rank starts in
milliseconds instead of importing torch again (seconds each, on a 2-core machine). The fork server is a
fresh single-threaded process (not pytest forked), so nothing of earlier tests leaks into the ranks;
each rank still imports its test's own module (the function it runs).
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "tensordict", "meshrl.parallel",
           "meshrl.models", "meshrl.runtime.train.trainer", "meshrl.runtime.engine.native", "meshrl.runtime.layout",
           "meshrl.runtime.weight_sync", "meshrl.runtime.transport"]


def _entry(rank: int, world_size: int, port: int, fn, args, errq, backend: str, devices) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # several ranks share a few cores (tests/conftest.py says why)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank if devices is None else devices[rank])
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test
        errq.put((rank, traceback.format_exc()))
        raise


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", devices: list[int] | None = None) -> None:
    """Run fn(rank, world_size, *args) on `world_size` spawned processes; re-raise any failure.

    `backend` "cpu:gloo,cuda:nccl" also pins rank r to GPU r, or to GPU devices[r] (GPU tests)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    errq = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errq, backend, devices)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            errors.append((-1, "a rank hung"))
    if errors or any(p.exitcode != 0 for p in procs):
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in errors) or "a rank failed")
