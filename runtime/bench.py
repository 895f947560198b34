"""`meshrl bench rl @ cfg.toml [overrides]`: synchronous vs asynchronous RL on the same config;
`meshrl bench checkpoint [--flavor 0.6B]`: what hashing and verifying a checkpoint costs.

Runs the RL job twice, with max_off_policy_steps = 0 and with the config's value (or
`--async-steps K`, default 1 when the config says 0), each in its own run directory under
`--output-dir`, then prints one JSON line per mode: rollout tokens/s, train tokens/s, step
time, weight-sync time and reward, averaged over the steps after the first `--warmup` (the
first steps pay for process start-up and communicator set-up). Nothing here is asserted:
benchmarks report, tests check.

`bench checkpoint` writes files of a trainer checkpoint's size for a model flavor (fp32
parameters + AdamW's two moments, split into one shard per trainer rank; random bytes), then
times the checksums a save computes (right after writing: page cache warm), a resume's
verification with the page cache dropped for those files (cold: the disk's read speed counts), a
plain cold read of the same bytes (so hashing and I/O can be told apart) and a warm verification.
`--parts K` writes and measures the shards in K groups, removing each, for disks smaller than the
checkpoint; the times add up.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from meshrl.runtime import launch as launching
from meshrl.runtime.config import ConfigError, RLConfig, parse_args, validate

USAGE = ("usage: meshrl bench rl @ cfg.toml [--async-steps K] [--warmup N] [--dotted.key value ...]\n"
         "       meshrl bench checkpoint [--family qwen3] [--flavor 0.6B] [--ranks 1] [--parts 1] [--threads N] "
         "[--dir /tmp/meshrl-ckpt-bench]\n"
         "       meshrl bench trainer --help")


def summarize(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:] or rows
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    return {
        "steps_measured": len(rows),
        "rollout_tokens_per_s": mean("tokens/rollout_per_s"),
        "train_tokens_per_s": mean("tokens/train_per_s"),
        "step_s": mean("time/step_s"),
        "train_s": mean("time/train_s"),
        "weight_sync_s": mean("time/weight_sync_s"),
        "reward_mean": mean("reward/mean"),
        "policy_lag_max": max(r["policy_lag/max"] for r in rows),
    }


def bench_rl(argv: list[str]) -> None:
    from meshrl.runtime import rl  # torch and the whole job: only once a benchmark runs
    raw, flags = parse_args(argv)
    async_steps = raw.pop("async_steps", None)
    warmup = int(raw.pop("warmup", 2))
    if flags:
        launching.fail(f"unknown flag(s) {flags}\n{USAGE}")
    try:
        base = validate(RLConfig, raw)
        root = Path(base.output_dir)
        # each mode runs afresh in its own run directory (an earlier benchmark's is cleared)
        base = base.model_copy(update={"overwrite": True, "resume": False})
        rl.preflight(base.model_copy(update={"output_dir": str(root / "sync")}))
    except (ConfigError, ValueError) as e:
        launching.fail(str(e))
    k = async_steps if async_steps is not None else (base.max_off_policy_steps or 1)
    for mode, steps in (("sync", 0), ("async", k)):
        cfg = base.model_copy(update={"max_off_policy_steps": steps, "output_dir": str(root / mode)})
        cfg.log.console = False
        start = time.perf_counter()
        code = launching.launch(cfg, rl.MODULE, rl.PRELOAD)
        if code != 0:
            sys.exit(code)
        rows = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
        result = {"mode": mode, "max_off_policy_steps": steps, "steps": cfg.max_steps,
                  "wall_s": time.perf_counter() - start, **summarize(rows, warmup)}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


def trainer_state_bytes(family: str, flavor: str) -> tuple[int, int]:
    """(parameters, bytes of the checkpointed trainer state: fp32 parameters + AdamW exp_avg and
    exp_avg_sq) of a model flavor, counted on the meta device."""
    import torch

    from meshrl.models import MODEL_FAMILIES

    fam = MODEL_FAMILIES[family]
    with torch.device("meta"):
        model = fam.model_cls(fam.flavors[flavor])
    params = sum(p.numel() for p in model.parameters())
    return params, params * 4 * 3


def _write_shards(folder: Path, names: list[str], size: int) -> None:
    block = os.urandom(64 * 2**20)
    for name in names:
        with open(folder / name, "wb") as f:
            left = size
            while left:
                left -= f.write(block[:min(len(block), left)])
            f.flush()
            os.fsync(f.fileno())


def _drop_cache(folder: Path, names: list[str]) -> None:
    """Evict these files from the page cache (only them: other processes keep theirs)."""
    for name in names:
        fd = os.open(folder / name, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _read_all(folder: Path, names: list[str]) -> None:
    buf = memoryview(bytearray(8 * 2**20))
    for name in names:
        with open(folder / name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def bench_checkpoint(argv: list[str]) -> None:
    from meshrl.runtime.checkpoint import checksums

    args = dict(zip(argv[::2], argv[1::2]))
    family, flavor = args.pop("--family", "qwen3"), args.pop("--flavor", "0.6B")
    ranks, parts = int(args.pop("--ranks", 1)), int(args.pop("--parts", 1))
    threads = int(args["--threads"]) if "--threads" in args else None
    folder = Path(args.pop("--dir", "/tmp/meshrl-ckpt-bench"))
    args.pop("--threads", None)
    if args or len(argv) % 2:
        launching.fail(USAGE)
    params, total = trainer_state_bytes(family, flavor)
    names = [f"__{r}_0.distcp" for r in range(ranks)]
    times = {"save_hash_s": 0.0, "verify_cold_s": 0.0, "read_cold_s": 0.0, "verify_warm_s": 0.0}
    folder.mkdir(parents=True, exist_ok=True)
    for group in (names[i::parts] for i in range(parts)):
        _write_shards(folder, group, total // ranks)
        for key, fn in (("save_hash_s", lambda: checksums(folder, group, threads)),
                        ("verify_cold_s", lambda: (_drop_cache(folder, group), checksums(folder, group, threads))),
                        ("read_cold_s", lambda: (_drop_cache(folder, group), _read_all(folder, group))),
                        ("verify_warm_s", lambda: checksums(folder, group, threads))):
            start = time.perf_counter()
            fn()
            times[key] += time.perf_counter() - start
        for name in group:
            (folder / name).unlink()
    shutil.rmtree(folder, ignore_errors=True)
    gib = total / 2**30
    result = {"family": family, "flavor": flavor, "params": params, "checkpoint_gib": round(gib, 2),
              "ranks": ranks, "threads": threads or min(16, os.cpu_count() or 1), "cpus": os.cpu_count(),
              **{k: round(v, 2) for k, v in times.items()},
              **{k.replace("_s", "_gib_per_s"): round(gib / v, 2) for k, v in times.items()}}
    print(json.dumps(result), flush=True)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "checkpoint":
        bench_checkpoint(argv[1:])
        return
    if argv and argv[0] == "trainer":
        from meshrl.runtime.train import bench as bench_trainer

        bench_trainer.main(argv[1:])
        return
    if not argv or argv[0] != "rl":
        launching.fail(USAGE)
    bench_rl(argv[1:])
