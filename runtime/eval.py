"""The `meshrl eval @ cfg.toml` program: evaluate a checkpoint on environments, in one process.

It loads the checkpoint (model.path, an HF folder) into the native engine, plays
``eval.samples_per_prompt`` episodes of each of ``eval.num_examples`` held-out examples
(``env.example(eval.example_offset + i)``) through the same `EpisodeDriver` as RL (multi-turn and
tools included), prints the summary as one JSON object on stdout and writes
``OUTPUT_DIR/results.json`` and ``OUTPUT_DIR/samples.jsonl`` (one row per sample). The episodes
and the summary's keys live in runtime/rollout/evals.py, which online evals in `meshrl rl` share.
"""

from __future__ import annotations

import json
import queue
import sys
import time
from pathlib import Path
from typing import Any

import torch

from meshrl.envs.dataset import check_dataset_envs
from meshrl.runtime import launch as launching
from meshrl.runtime.config import EvalConfig
from meshrl.runtime.layout import use_cuda
from meshrl.runtime.policy import build_policy, check_model_source, compute_dtype, load_tokenizer_for

__all__ = ["launch", "preflight", "run_eval"]


def preflight(cfg: EvalConfig) -> None:
    check_model_source(cfg.model)
    check_dataset_envs(cfg.env, cfg.eval.env)


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate cfg.model on cfg.env (or cfg.eval.env); write results.json and samples.jsonl; return the summary."""
    from meshrl.envs import make_env  # the engine and the environments: not needed by the pre-flight checks
    from meshrl.runtime.engine.build import build_native_engine
    from meshrl.runtime.rollout.episodes import EpisodeDriver
    from meshrl.runtime.rollout.evals import EvalCollector, evaluate

    start = time.perf_counter()
    device = torch.device("cuda") if use_cuda(cfg.dist.device) else torch.device("cpu")
    dtype = compute_dtype(cfg.model, device)
    tokenizer = load_tokenizer_for(cfg.model)
    model, _ = build_policy(cfg.model, device, dtype, tokenizer=tokenizer)
    engine = build_native_engine(cfg.inference, cfg.model, device, dtype, cfg.seed, model=model)
    settings = cfg.eval
    env_cfg = settings.env or cfg.env
    env = make_env(env_cfg.name, **env_cfg.kwargs())
    events: queue.Queue = queue.Queue()
    max_tokens = settings.max_tokens or cfg.inference.sampling.max_tokens
    driver = EpisodeDriver(tokenizer, max_tokens=max_tokens, max_model_len=cfg.inference.max_model_len,
                           post=events.put, num_workers=cfg.episodes.workers, timeout_s=cfg.episodes.timeout_s,
                           score_memory_mb=cfg.episodes.score_memory_mb, name="eval-env")
    examples = [env.example(settings.example_offset + i) for i in range(settings.num_examples)]
    collector = EvalCollector(settings.num_examples, settings.samples_per_prompt, settings.pass_k,
                              settings.pass_threshold)
    evaluate(engine, driver, events, env, examples, collector, settings.temperature, cfg.seed, max_tokens)
    summary = {"model": cfg.model.path or f"{cfg.model.family}:{cfg.model.flavor}", "env": env_cfg.name,
               **collector.summary(), "time_s": time.perf_counter() - start}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "samples.jsonl").open("w") as f:
        for row in collector.sample_rows(tokenizer):
            f.write(json.dumps(row) + "\n")
    return summary


def launch(cfg: EvalConfig) -> int:
    """`meshrl eval`: run in this process, print the summary as JSON; returns the exit code."""
    summary = run_eval(cfg)
    print(json.dumps(summary), flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    cfg, _ = launching.parse_or_exit(EvalConfig, sys.argv[1:] if argv is None else argv, preflight)
    sys.exit(launch(cfg))


if __name__ == "__main__":
    main()
