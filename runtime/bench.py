"""`meshrl bench rl @ cfg.toml [overrides]`: synchronous vs asynchronous RL on the same config.

Runs the RL job twice, with max_off_policy_steps = 0 and with the config's value (or
`--async-steps K`, default 1 when the config says 0), each in its own run directory under
`--output-dir`, then prints one JSON line per mode: rollout tokens/s, train tokens/s, step
time, weight-sync time and reward, averaged over the steps after the first `--warmup` (the
first steps pay for process start-up and communicator set-up). Nothing here is asserted:
benchmarks report, tests check.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from meshrl.runtime import launch as launching
from meshrl.runtime import rl
from meshrl.runtime.config import ConfigError, RLConfig, parse_args, validate

USAGE = ("usage: meshrl bench rl @ cfg.toml [--async-steps K] [--warmup N] [--dotted.key value ...]\n"
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
    raw, flags = parse_args(argv)
    async_steps = raw.pop("async_steps", None)
    warmup = int(raw.pop("warmup", 2))
    if flags:
        launching.fail(f"unknown flag(s) {flags}\n{USAGE}")
    try:
        base = validate(RLConfig, raw)
        rl.preflight(base)
    except (ConfigError, ValueError) as e:
        launching.fail(str(e))
    k = async_steps if async_steps is not None else (base.max_off_policy_steps or 1)
    root = Path(base.output_dir)
    for mode, steps in (("sync", 0), ("async", k)):
        cfg = base.model_copy(update={"max_off_policy_steps": steps, "output_dir": str(root / mode)})
        cfg.log.console = False
        start = time.perf_counter()
        code = launching.launch(cfg, rl.MODULE)
        if code != 0:
            sys.exit(code)
        rows = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
        result = {"mode": mode, "max_off_policy_steps": steps, "steps": cfg.max_steps,
                  "wall_s": time.perf_counter() - start, **summarize(rows, warmup)}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "trainer":
        from meshrl.runtime.train import bench as bench_trainer

        bench_trainer.main(argv[1:])
        return
    if not argv or argv[0] != "rl":
        launching.fail(USAGE)
    bench_rl(argv[1:])
