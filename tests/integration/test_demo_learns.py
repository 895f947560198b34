"""End to end on CPU: the reverse-text demo learns the task, not the reward.

The demo's two stages as examples/reverse_text/run.sh runs them (configs/reverse_text/sft.toml, then
rl.toml from its checkpoint), each checkpoint evaluated by `meshrl eval` with
configs/reverse_text/eval.toml on held-out words: RL must raise greedy exact-match pass@1 over the
SFT checkpoint by EXACT_MARGIN and the held-out reward by REWARD_MARGIN, and keep the answers' length
ratio near 1 (the old difflib reward was raised by answering short). The margins are below the
smallest gains of the three seeds in the README's table (examples/reverse_text/README.md, "Result";
2026-12-01): exact match +0.152, +0.012, +0.113 (seeds 0, 1, 2), reward +0.111, +0.040, +0.093,
length ratio after RL 0.960-0.966. Seed 1's exact-match gain is the smallest and sets EXACT_MARGIN;
this test runs seed 0. Seed 0 rerun on a less loaded machine (asynchronous RL's trajectory depends
on timing) gave +0.078 exact match, +0.092 reward, but a length ratio of 0.869 after RL: the bound
below (0.85) is set under that, the lowest measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs/reverse_text"
EXACT_MARGIN = 0.01  # worst seed: +0.012
REWARD_MARGIN = 0.03  # worst seed: +0.040
SEED = 0

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _meshrl(*args: str) -> subprocess.CompletedProcess:
    # one thread per process: the RL job's launcher sets it for its ranks, SFT and eval run alone
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                       timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, f"meshrl {' '.join(args)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def _evaluate(checkpoint: Path, out: Path) -> dict:
    _meshrl("eval", "@", str(CONFIGS / "eval.toml"), "--model.path", str(checkpoint), "--output-dir", str(out))
    return json.loads((out / "results.json").read_text())


def test_rl_raises_held_out_exact_match(tmp_path):
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    _meshrl("sft", "@", str(CONFIGS / "sft.toml"), "--model.init-seed", str(SEED), "--output-dir", str(sft))
    _meshrl("rl", "@", str(CONFIGS / "rl.toml"), "--seed", str(SEED), "--model.path", str(sft / "checkpoints/final"),
            "--output-dir", str(rl), "--log.console", "false")
    before = _evaluate(sft / "checkpoints/final", tmp_path / "eval_sft")
    after = _evaluate(rl / "checkpoints/final", tmp_path / "eval_rl")
    key = "env/reverse-text/"
    assert before["num_examples"] == after["num_examples"] == 256
    # pass@1 at threshold 1 is exact match: the lcs reward is 1 only for the exact answer
    assert after["pass@1"] == after[key + "exact"] and before["pass@1"] == before[key + "exact"]
    gain = after[key + "exact"] - before[key + "exact"]
    assert gain >= EXACT_MARGIN, (before[key + "exact"], after[key + "exact"])
    assert after[key + "lcs"] - before[key + "lcs"] >= REWARD_MARGIN, (before[key + "lcs"], after[key + "lcs"])
    assert 0.85 <= after[key + "length_ratio"] <= 1.1, after[key + "length_ratio"]
