"""KV block transfer of P/D disaggregation (runtime/engine/disagg.py) between two GPUs over NCCL.

Two processes, one GPU each; rank 0 sends `--blocks` blocks of a paged cache of the given shape to
rank 1 with `send_blocks` / `recv_blocks`, the code the engines run (bit-for-bit equality is the gpu
test's: tests/dist/test_disagg.py). One JSON line per (shape, cache dtype): bytes moved, the first
transfer (NCCL communicator set-up included) and the median of the next ones, GiB/s.

    python3 benchmarks/gpu/pd_transfer.py                 # Qwen3-8B and 0.6B cache shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrl.runtime.engine.disagg import cache_spec, chunk_blocks, recv_blocks, send_blocks
from meshrl.runtime.engine.kv_cache import KVCache

SHAPES = {"8B": (36, 8, 128), "0.6B": (28, 8, 128)}  # layers, kv heads, head dim


def _rank(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="nccl")
    for name, (layers, heads, dim) in SHAPES.items():
        for fp8 in (False, True):
            kv = KVCache(list(range(layers)), args.blocks + 1, 16, heads, dim, torch.bfloat16,
                         torch.device("cuda", rank), fp8=fp8)
            for t, _ in kv.storages():
                t.random_(0, 100)  # content does not matter here
            blocks = list(range(1, args.blocks + 1))
            chunk = chunk_blocks(kv)
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                dist.barrier(group)
                start = time.perf_counter()
                if rank == 0:
                    send_blocks(kv, blocks, group, 1, chunk)
                else:
                    recv_blocks(kv, cache_spec(kv), blocks, group, 0, chunk)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            nbytes = sum(t.numel() * t.element_size() for t, _ in kv.storages()) * args.blocks // (args.blocks + 1)
            if rank == 1:
                steady = statistics.median(times[1:])
                print(json.dumps({"shape": name, "kv_cache": "fp8" if fp8 else "bf16", "blocks": args.blocks,
                                  "block_size": 16, "bytes": nbytes, "first_s": round(times[0], 4),
                                  "median_s": round(steady, 5), "gib_per_s": round(nbytes / steady / 2**30, 1)}),
                      flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per transfer (16 tokens each)")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args, 29571), nprocs=2)


if __name__ == "__main__":
    main()
