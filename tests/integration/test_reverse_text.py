"""End to end on CPU: `meshrl sft` warm start, then `meshrl rl`, as a user runs them.

The margin of the learning test comes from measured runs (examples/reverse_text/README.md):
over 40 asynchronous steps the mean reward of the last 10 steps exceeds that of the first 10
by 0.06-0.10 across seeds; the test asks for 0.03.
"""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs/reverse_text/sft.toml")
RL = str(ROOT / "configs/reverse_text/rl.toml")
METRICS = ["step", "reward/mean", "reward/std", "loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm",
           "policy_lag/mean", "policy_lag/max", "tokens/rollout_per_s", "tokens/train_per_s", "time/step_s",
           "time/weight_sync_s", "time/train_tail_s", "batch/train_parts"]

pytestmark = pytest.mark.slow


def meshrl(*args, timeout=600, check=True):
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args, "--log.console", "false"]
                       if args[0] == "rl" else [sys.executable, "-m", "meshrl.runtime.cli", *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and r.returncode != 0:
        raise AssertionError(f"meshrl {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sft")
    meshrl("sft", "@", SFT, "--output-dir", str(run))
    rows = read_metrics(run)
    assert len(rows) == tomllib.loads(Path(SFT).read_text())["max_steps"] and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["eval/reward"] > rows[0].get("eval/reward", rows[19]["eval/reward"]) - 1e-9
    return run / "checkpoints" / "final"


def test_rl_reward_rises_asynchronously(warm_start, tmp_path):
    run = tmp_path / "rl"
    proc = meshrl("rl", "@", RL, "--model.path", str(warm_start), "--max-steps", "40", "--output-dir", str(run))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(40))
    for key in METRICS:
        assert all(key in r for r in rows), key
    assert all(row["tokens/rollout_per_s"] > 0 for row in rows)  # the last step's too
    summary = proc.stderr[proc.stderr.index("meshrl: rl finished: 40 steps"):].splitlines()
    assert summary[1].split() == ["checkpoint", str(run / "checkpoints" / "final"), "(HF", "folder)"]
    assert any(line.split()[:3] == ["meshrl", "eval", "@"] for line in summary)
    assert max(r["policy_lag/max"] for r in rows) <= 1  # max_off_policy_steps = 1
    assert max(r["policy_lag/max"] for r in rows) == 1  # and it did run ahead
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last - first >= 0.03, (first, last)
    # the run directory a user reads
    assert json.loads((run / "config.json").read_text())["max_steps"] == 40
    sample = json.loads((run / "samples" / "step_0.jsonl").read_text().splitlines()[0])
    assert {"prompt", "completion", "reward", "answer"} <= sample.keys()
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == ["rank0-trainer.log", "rank1-inference.log", "rank2-controller.log"]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = run / "checkpoints" / "final"
    AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final).eos_token_id == 1


def test_synchronous_two_trainer_ranks_and_two_engines_are_on_policy(warm_start, tmp_path):
    """One job for what were two (sync 1+1 for 4 steps, async 2+2 for 3 steps): synchronous, 2 FSDP
    trainer ranks, 2 engines. The asynchronous path runs in test_rl_reward_rises_asynchronously."""
    run = tmp_path / "sync"
    meshrl("rl", "@", RL, "--model.path", str(warm_start), "--max-steps", "3", "--max-off-policy-steps", "0",
           "--layout.num-trainer-ranks", "2", "--layout.num-inference-ranks", "2", "--output-dir", str(run))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["policy_lag/max"] == 0 for r in rows)
    # the trainer recomputes the logprobs both engines sampled with, with the same (gathered, broadcast)
    # weights: equal in fp32
    assert all(r["mismatch_kl"] <= 1e-6 for r in rows), [r["mismatch_kl"] for r in rows]
    # trainer.overlap_rollout (default): groups that finished were trained in parts while the others
    # generated, over 2 FSDP ranks, and the weights stayed those of the rollouts' policy (above)
    assert all(r["batch/train_parts"] >= 1 for r in rows)
    assert len(list((run / "logs").glob("rank*-inference.log"))) == 2


def test_a_failing_rank_ends_the_job_with_a_clear_message(warm_start, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in warm_start.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    # the subprocess timeout is the bound: a job that hangs instead of ending fails the test
    r = meshrl("rl", "@", RL, "--model.path", str(broken), "--output-dir", str(tmp_path / "run"), check=False,
               timeout=300)
    assert r.returncode != 0
    assert "failed first" in r.stderr and ("(trainer)" in r.stderr or "(inference)" in r.stderr), r.stderr[-3000:]


def test_a_killed_rank_ends_the_job_instead_of_hanging(warm_start, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshrl.runtime.cli", "rl", "@", RL, "--model.path", str(warm_start),
           "--max-steps", "1000", "--output-dir", str(run), "--log.console", "false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run / "logs" / "rank1-inference.log"
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.5)
    assert (run / "metrics.jsonl").read_text(), "the run never finished a step"
    pid = int(log.read_text().split("pid ")[1].split(";")[0])
    os.kill(pid, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job hung after a rank was killed")
    assert proc.returncode != 0
    assert "meshrl:" in err, err[-3000:]
