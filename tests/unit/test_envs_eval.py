"""Evaluation: the unbiased pass@k, the summary, and `meshrl eval`'s output schema."""

import json
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from meshrl.envs.base import Example, Reward
from meshrl.runtime.rollout.episodes import EpisodeResult
from meshrl.runtime.rollout.evals import EvalCollector, OnlineEval, pass_at_k

ROOT = Path(__file__).resolve().parents[2]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # = 0.5
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - comb(7, 4) / comb(10, 4))
    assert pass_at_k(3, 2, 2) == 1.0  # fewer failures than k: some pick always passes
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def result(env, reward, failed=False, sampled=3):
    r = EpisodeResult(key=None, example=Example(0, "p", "a"), env=env, prompt_ids=[1], token_ids=[5] * sampled,
                      mask=[True] * sampled, reward=None if failed else Reward({"c": reward}, metrics={"m": 2.0}))
    r.failed = failed
    return r


def test_summary_per_environment():
    c = EvalCollector(num_examples=2, samples_per_prompt=2, pass_k=[1, 2], pass_threshold=1.0)
    c.add(0, 0, result("a", 1.0))
    c.add(0, 1, result("a", 0.0))
    c.add(1, 0, result("b", 0.5))
    assert not c.done
    c.add(1, 1, result("b", 0.0, failed=True))
    s = c.summary()
    assert s["reward"] == pytest.approx(0.5) and s["failed"] == 1.0
    assert s["pass@1"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(0.5)
    assert s["env/a/pass@2"] == 1.0 and s["env/b/pass@2"] == 0.0 and s["env/b/failed"] == 1.0
    assert s["env/a/c"] == 0.5 and s["env/a/m"] == 2.0 and s["num_samples"] == 4


def test_online_eval_rows_wait_for_their_evaluation(tmp_path):
    from meshrl.envs import AlphabetSortEnv
    from meshrl.runtime.config import EvalSettings
    from meshrl.runtime.tokenizer import build_char_tokenizer

    class Router:
        def __init__(self):
            self.started = []

        def start(self, key, *args):
            self.started.append(key)

    ev = OnlineEval(EvalSettings(every=2, num_examples=2), AlphabetSortEnv(), max_steps=3, seed=0,
                    tokenizer=build_char_tokenizer(), run_dir=tmp_path)
    assert [v for v in range(5) if ev.due(v)] == [2, 3, 4]
    router = Router()
    ev.start(2, router, [7])
    assert router.started == [("eval", 2, 0, 0), ("eval", 2, 1, 0)] and ev.busy
    assert ev.hold({"step": 0}) == [{"step": 0}]
    assert ev.hold({"step": 1}) == []  # version 2 = the weights after step 1 is being evaluated
    assert ev.hold({"step": 2}) == []  # rows stay in order
    r = result("alphabet-sort", 1.0)
    r.key = ("eval", 2, 0, 0)
    assert ev.add(r) == []
    r = result("alphabet-sort", 0.0)
    r.key = ("eval", 2, 1, 0)
    rows = ev.add(r)
    assert [row["step"] for row in rows] == [1, 2] and rows[0]["eval/reward"] == 0.5 and "eval/reward" not in rows[1]
    assert not ev.busy and len((tmp_path / "eval" / "step_1.jsonl").read_text().splitlines()) == 2


def test_meshrl_eval_prints_json_and_writes_samples(tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "meshrl.runtime.cli", "eval", "--model.flavor", "tiny", "--model.tokenizer", "char",
           "--env", '{envs=[{name="alphabet-sort"}, {name="multiturn-sort", weight=1}, {name="calculator"}]}',
           "--eval.num-examples", "6", "--eval.samples-per-prompt", "3", "--eval.temperature", "1.0",
           "--eval.pass-k", "[1, 3]", "--inference.max-model-len", "128", "--inference.sampling.max-tokens", "12",
           "--dist.device", "cpu", "--output-dir", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads((out / "results.json").read_text()) == summary
    for key in ("model", "env", "reward", "pass@1", "pass@3", "failed", "completion_len", "num_examples",
                "num_samples", "time_s"):
        assert key in summary, key
    assert summary["num_examples"] == 6 and summary["num_samples"] == 18 and summary["env"] == "mix"
    for env in ("alphabet-sort", "multiturn-sort", "calculator"):
        assert f"env/{env}/reward" in summary and f"env/{env}/pass@3" in summary
    assert "env/alphabet-sort/similarity" in summary and "env/calculator/tool_calls" in summary
    assert 0.0 <= summary["pass@1"] <= summary["pass@3"] <= 1.0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 18
    assert {"example", "sample", "env", "prompt", "answer", "completion", "reward", "components", "metrics", "passed",
            "failed", "error", "finish_reason", "turns"} <= rows[0].keys()


def test_eval_settings_are_checked():
    from meshrl.runtime.config import ConfigError, EvalConfig, load_config

    with pytest.raises(ConfigError, match="pass_k"):
        load_config(EvalConfig, ["--model.flavor", "tiny", "--model.tokenizer", "char", "--eval.pass-k", "[2]"])
    with pytest.raises(ConfigError, match="temperature"):
        load_config(EvalConfig, ["--model.flavor", "tiny", "--model.tokenizer", "char",
                                 "--eval.samples-per-prompt", "4"])
