"""The SFT rank program: `torchrun --nproc-per-node N -m meshrl.runtime.sft @ cfg.toml`.

Every rank validates the config, starts the default group and runs the SFT loop
(runtime/train/sft.py): supervised training on an environment's reference completions or on a
data set (`[data]`, docs/data.md), on the same trainer stack as RL, with no controller. From
Python, `launch(SFTConfig(...))` starts the job under torchrun.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime import launch as launching
from meshrl.runtime.config import SFTConfig
from meshrl.runtime.layout import init_world, pick_device, use_cuda
from meshrl.runtime.policy import check_model_source, load_tokenizer_for
from meshrl.runtime.rundir import setup_logging
from meshrl.runtime.train.sft_data import check_data

MODULE = "meshrl.runtime.sft"
# imported by the launcher once when it forks the ranks (launch.rank_start), not by each rank
PRELOAD = ("transformers.tokenization_utils_tokenizers", "meshrl.runtime.train.sft")


def check_sft_env(env) -> None:
    """ValueError unless every environment of `env` (a mix's members) has reference completions
    (`sft_completion`): multi-turn and verifiers environments have none."""
    from meshrl.envs.registry import REGISTRY

    able = [name for name, (_, make) in REGISTRY.items() if isinstance(make, type) and name != "mix"
            and callable(getattr(make, "sft_completion", None))]
    for name in [e.name for e in env.envs] if env.name == "mix" else [env.name]:
        if name not in able:
            raise ValueError(f"env: {name!r} has no reference completions, so meshrl sft cannot train on it "
                             f"(environments with them: {', '.join(able)}); train it with meshrl rl")


def preflight(cfg: SFTConfig) -> None:
    check_model_source(cfg.model, cfg.trainer.parallel.ep, cfg.trainer.parallel.cp)
    if cfg.data is not None:  # the files, their columns and a chat template, before any process starts
        check_data(cfg.data, load_tokenizer_for(cfg.model))
    else:
        check_sft_env(cfg.env)
    launching.check_world_size(cfg)
    if not use_cuda(cfg.dist.device):
        launching.check_cpu_cores(cfg)
    if "WORLD_SIZE" not in os.environ:  # the launcher; under torchrun, rank 0 decides (decide_resume)
        ckpt.check_resume(cfg, "sft")


def launch(cfg: SFTConfig) -> int:
    """Run `cfg` as a torchrun job on this node; returns the exit code. Raises ValueError early."""
    preflight(cfg)
    return launching.launch(cfg, MODULE, PRELOAD)


def main(argv: list[str] | None = None) -> None:
    launching.rank_main(SFTConfig, sys.argv[1:] if argv is None else argv, preflight, "trainer", run_rank)


def run_rank(cfg: SFTConfig, run_dir: Path) -> None:
    cuda = use_cuda(cfg.dist.device)
    device = pick_device(cuda)
    rank, world = init_world(cuda, cfg.dist.timeout_s)
    setup_logging(run_dir, rank, "trainer")
    # checkpoint collectives run in a background thread: a gloo group of their own
    ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
    start = ckpt.decide_resume(cfg, "sft")
    from meshrl.runtime.train.sft import run_sft  # the trainer stack: not needed by the launcher

    run_sft(cfg, rank, world, device, start, ckpt_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
