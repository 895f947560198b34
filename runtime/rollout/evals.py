"""Evaluation episodes and their summary, shared by `meshrl eval` and online evals in `meshrl rl`.

`EvalCollector` gathers the episodes of one evaluation and summarises them; `OnlineEval` runs
evaluations during RL on the inference ranks (through the controller's `TurnRouter`);
`evaluate` plays every episode on an engine in this process (`meshrl eval`, runtime/eval.py).

Summary keys (`EvalCollector.summary`; `meshrl rl` logs them with an ``eval/`` prefix):

    reward                mean reward of the samples that did not fail
    pass@k                mean over examples of the unbiased estimate 1 - C(n-c, k) / C(n, k)
                          from n samples of which c passed (reward >= eval.pass_threshold)
    failed                samples whose environment failed (they count as not passed)
    completion_len        mean sampled tokens per episode
    env/<name>/reward, env/<name>/pass@k, env/<name>/<component>, env/<name>/<metric>
                          the same per environment (one entry per environment of a mix)
    num_examples, num_samples
"""

from __future__ import annotations

import json
import math
import queue
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from meshrl.runtime.engine.api import Request, SamplingParams
from meshrl.runtime.rollout.episodes import EpisodeDriver, EpisodeResult, Generate, completion_text

__all__ = ["EvalCollector", "OnlineEval", "evaluate", "pass_at_k", "sample_seed"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passing: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class EvalCollector:
    """Gathers the episodes of one evaluation and summarises them (see the module docstring)."""

    def __init__(self, num_examples: int, samples_per_prompt: int, pass_k: list[int], pass_threshold: float):
        self.num_examples, self.n = num_examples, samples_per_prompt
        self.pass_k, self.threshold = list(pass_k), pass_threshold
        self.results: dict[tuple[int, int], EpisodeResult] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == self.num_examples * self.n

    def add(self, example: int, sample: int, result: EpisodeResult) -> None:
        self.results[example, sample] = result

    def passed(self, r: EpisodeResult) -> bool:
        return not r.failed and r.reward is not None and r.reward.total >= self.threshold

    def summary(self) -> dict[str, float]:
        by_env: dict[str, list[int]] = defaultdict(list)
        for i in range(self.num_examples):
            by_env[self.results[i, 0].env].append(i)
        out = self._summarise(list(range(self.num_examples)))
        for env, examples in sorted(by_env.items()):
            for key, value in self._summarise(examples, components=True).items():
                out[f"env/{env}/{key}"] = value
        out["num_examples"], out["num_samples"] = self.num_examples, len(self.results)
        return out

    def _summarise(self, examples: list[int], components: bool = False) -> dict[str, float]:
        rows = [self.results[i, j] for i in examples for j in range(self.n)]
        ok = [r for r in rows if not r.failed and r.reward is not None]
        out = {"reward": statistics.fmean(r.reward.total for r in ok) if ok else 0.0,
               "failed": float(len(rows) - len(ok)),
               "completion_len": statistics.fmean(r.num_sampled for r in rows) if rows else 0.0}
        for k in self.pass_k:
            out[f"pass@{k}"] = statistics.fmean(
                pass_at_k(self.n, sum(self.passed(self.results[i, j]) for j in range(self.n)), k) for i in examples)
        if components:
            names: dict[str, list[float]] = defaultdict(list)
            for r in ok:
                for name, value in {**r.reward.components, **r.reward.metrics}.items():
                    names[name].append(value)
            for name, values in sorted(names.items()):
                out.setdefault(name, statistics.fmean(values))
        return out

    def sample_rows(self, tokenizer: Any) -> list[dict[str, Any]]:
        """One JSON-ready row per sample, for a person to read."""
        rows = []
        for (i, j), r in sorted(self.results.items()):
            rows.append({"example": i, "sample": j, "env": r.env, "index": r.example.index, "prompt": r.example.prompt,
                         "answer": r.example.answer, "completion": completion_text(tokenizer, r),
                         "reward": r.reward.total if r.reward is not None else None,
                         "components": r.reward.components if r.reward is not None else {},
                         "metrics": r.reward.metrics if r.reward is not None else {},
                         "passed": self.passed(r), "failed": r.failed, "error": r.error.splitlines()[0] if r.error else "",
                         "finish_reason": r.finish_reason, "turns": r.turns})
        return rows


class OnlineEval:
    """Evaluations during `meshrl rl` (eval.every > 0), run by the controller on the inference ranks.

    When the trainer announces weights of version v with v % every == 0 or v == max_steps, the
    controller starts the evaluation episodes (keys ("eval", v, i, j)) on the inference ranks,
    in between the training rollouts, with the eval sampling settings; their requests carry the
    eval temperature and so travel in messages of their own. The summary is logged with an
    ``eval/`` prefix on the metrics row of step v - 1 (the step that produced version v): that
    row, and the rows after it, are held back until the evaluation finishes, so metrics.jsonl
    keeps one row per step in order. Samples go to RUN_DIR/eval/step_{v-1}.jsonl.
    """

    def __init__(self, settings, env, max_steps: int, seed: int, tokenizer, run_dir: Path):
        self.settings, self.env, self.max_steps, self.seed = settings, env, max_steps, seed
        self.tokenizer, self.run_dir = tokenizer, run_dir
        self.running: dict[int, EvalCollector] = {}  # version -> its collector
        self.finished: dict[int, dict[str, float]] = {}  # step -> eval metrics not yet on a row
        self.held: list[dict[str, Any]] = []

    def due(self, version: int) -> bool:
        every = self.settings.every
        return every > 0 and version > 0 and (version % every == 0 or version == self.max_steps)

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def start(self, version: int, router, ranks: list[int]) -> None:
        """Start the episodes of the evaluation of weights ``version`` (router: episodes.TurnRouter)."""
        s = self.settings
        collector = EvalCollector(s.num_examples, s.samples_per_prompt, s.pass_k, s.pass_threshold)
        self.running[version] = collector
        for i in range(s.num_examples):
            example = self.env.example(s.example_offset + i)
            rank = ranks[i % len(ranks)]
            for j in range(s.samples_per_prompt):
                seed = (lambda i, j: lambda turn: sample_seed(self.seed, version, i, j, turn))(i, j)
                router.start(("eval", version, i, j), self.env, example, rank, s.temperature, seed, s.max_tokens)

    def add(self, result: EpisodeResult) -> list[dict[str, Any]]:
        """Record a finished evaluation episode; returns the metrics rows that may now be written."""
        _, version, i, j = result.key
        collector = self.running[version]
        collector.add(i, j, result)
        if not collector.done:
            return []
        del self.running[version]
        step = version - 1
        self.finished[step] = {f"eval/{k}": v for k, v in collector.summary().items()}
        folder = self.run_dir / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"step_{step}.jsonl").open("w") as f:
            for row in collector.sample_rows(self.tokenizer):
                f.write(json.dumps(row) + "\n")
        return self._release()

    def hold(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Queue a step's metrics row; returns the rows that may now be written, in order."""
        self.held.append(row)
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        ready = []
        while self.held:
            step = self.held[0]["step"]
            if step + 1 in self.running:  # its evaluation is still going
                break
            row = self.held.pop(0)
            row.update(self.finished.pop(step, {}))
            ready.append(row)
        return ready


def sample_seed(seed: int, tag: Any, example: int, sample: int, turn: int) -> int:
    """Sampling seed of one turn of one evaluation episode."""
    return random.Random(f"eval:{seed}:{tag}:{example}:{sample}:{turn}").getrandbits(62)


def evaluate(engine, driver: EpisodeDriver, events: queue.Queue, env, examples: list, collector: EvalCollector,
             temperature: float, seed: int, max_tokens: int | None = None) -> None:
    """Play every (example, sample) episode on a local engine until all have finished."""
    for i, example in enumerate(examples):
        for j in range(collector.n):
            driver.start((i, j), env, example, max_tokens)
    keys: dict[int, tuple[int, int]] = {}
    next_id = 0
    while not collector.done:
        pending = []
        try:
            while True:
                pending.append(events.get_nowait())
        except queue.Empty:
            pass
        if not pending and not engine.has_work():
            pending.append(events.get())
        for event in pending:
            action = driver.handle(event)
            if isinstance(action, Generate):
                i, j = action.key
                sampling = SamplingParams(temperature=temperature, max_tokens=action.max_tokens,
                                          stop_token_ids=action.stop_token_ids,
                                          seed=sample_seed(seed, "local", i, j, action.turn))
                engine.add(Request(next_id, action.prompt_ids, sampling))
                keys[next_id] = action.key
                next_id += 1
            elif isinstance(action, EpisodeResult):
                collector.add(*action.key, action)
        if engine.has_work():
            for c in engine.step():
                driver.on_completion(keys.pop(c.request_id), c.token_ids, c.logprobs, c.versions, c.finish_reason)
