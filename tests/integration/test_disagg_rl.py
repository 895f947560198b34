"""End to end on CPU: RL with prefill/decode disaggregation (inference.prefill_ranks = 1).

1 controller + 1 trainer + 2 inference ranks, one prefill replica and one decode replica, on a mix
of a single-turn and a multi-turn environment (continuations are prefilled on the decode replica).
Synchronous mode samples every step from exactly one version, so the run must give the rewards and
samples of the same run on one engine replica, token for token (seeds are per request and the
sampler's draws do not depend on the replica), also when a backed-up prefill pool makes the decode
replica prefill some first turns itself (inference.prefill_backlog_tokens). Asynchronous mode (max_off_policy_steps = 1) must
keep every token within the staleness bound. Nothing in the run holds a rollout until a weight
update lands, and on this CPU a step's rollouts finish long before the trainer's step (measured: no
rollout spanned two versions), so a weight update mid-rollout is not asserted here: the gloo test
tests/dist/test_disagg.py puts one in flight deterministically ("update", "stale").
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

ENVS = '{envs=[{name="alphabet-sort", min_word_len=1, max_word_len=2}, ' \
       '{name="multiturn-sort", num_turns=3, min_word_len=1, max_word_len=1}]}'


def run_rl(run: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "meshrl.runtime.cli", "rl", "--model.flavor", "tiny", "--model.tokenizer", "char",
           "--env", ENVS, "--prompts-per-step", "4", "--samples-per-prompt", "4",
           "--inference.max-model-len", "96", "--inference.sampling.max-tokens", "10",
           "--trainer.micro-batch-tokens", "512", "--dist.device", "cpu", "--log.console", "false",
           "--log.samples-per-step", "16", "--output-dir", str(run), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-5000:]}"
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def handoffs(run: Path) -> tuple[int, int]:
    """(sequences the prefill replica handed off, sequences the decode replica received), from their logs."""
    text = "\n".join(p.read_text() for p in (run / "logs").glob("rank*-inference.log"))
    sent = re.search(r"handed (\d+) sequences off", text)
    received = re.search(r"received (\d+) prefilled sequences", text)
    assert sent and received, "both replicas log their handoffs at the end"
    return int(sent.group(1)), int(received.group(1))


def first_turns(run: Path) -> tuple[int, int]:
    """(first turns sent through the prefill replica, first turns prefilled by their decode replica),
    from the controller's log."""
    text = "\n".join(p.read_text() for p in (run / "logs").glob("rank*-controller.log"))
    found = re.search(r"P/D: (\d+) first turns went through prefill replicas, (\d+) were prefilled by their decode", text)
    assert found, "the controller logs its routing at the end"
    return int(found.group(1)), int(found.group(2))


def samples(run: Path, step: int) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
    return sorted((r["prompt"], r["completion"], r["reward"], r["finish_reason"], r["versions"]) for r in rows)


PD = ("--layout.num-inference-ranks", "2", "--inference.prefill-ranks", "1")


def test_synchronous_rl_with_a_prefill_and_a_decode_replica_equals_one_replica(tmp_path):
    evals = ("--eval.every", "2", "--eval.num-examples", "4")  # evaluation episodes go through the pools too
    # overlap off in both: the runs must agree to the bit, and overlap's parts depend on timing
    evals = (*evals, "--trainer.overlap-rollout", "false")
    one = run_rl(tmp_path / "one", "--max-steps", "2", "--max-off-policy-steps", "0", *evals)
    # a backlog of one token: a first turn goes to the prefill replica only while it has nothing
    # outstanding, the others are prefilled by the decode replica (both routes, one run)
    pd = run_rl(tmp_path / "pd", "--max-steps", "2", "--max-off-policy-steps", "0", *PD, *evals,
                "--inference.prefill-backlog-tokens", "1")
    assert [row["step"] for row in pd] == [0, 1]
    sent, received = handoffs(tmp_path / "pd")
    assert sent == received > 0
    through_prefill, direct = first_turns(tmp_path / "pd")
    assert through_prefill > 0 and direct > 0, (through_prefill, direct)
    assert max(row["env/multiturn-sort/turns"] for row in pd) > 1  # continuations ran on the decode replica
    for a, b in zip(one, pd):
        assert a["reward/mean"] == b["reward/mean"] and a["rollouts/failed"] == b["rollouts/failed"] == 0
        assert b["mismatch_kl"] <= 1e-6 and b["policy_lag/max"] == 0
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert a.get("eval/reward") == b.get("eval/reward")
    assert "eval/reward" in pd[1]
    for step in range(2):
        assert samples(tmp_path / "one", step) == samples(tmp_path / "pd", step), step


def test_asynchronous_rl_within_the_staleness_bound(tmp_path):
    rows = run_rl(tmp_path / "pd", "--max-steps", "3", "--max-off-policy-steps", "1", *PD)
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(row["policy_lag/max"] <= 1 and row["rollouts/failed"] == 0 for row in rows)
    assert rows[-1]["weights/version"] == 3
    sent, received = handoffs(tmp_path / "pd")
    assert sent == received > 0
    assert first_turns(tmp_path / "pd")[1] == 0  # the default backlog (4 prefill steps) is never reached here
    # The staleness bound, per token: step s is dispatched once v(s-1) went out and v(s+1) needs it
    # trained, so its tokens record versions s-1 and s only (every sample of a step is logged).
    for step in range(3):
        versions = {v for *_, vs in samples(tmp_path / "pd", step) for v in vs}
        assert versions and versions <= {max(step - 1, 0), step}, (step, versions)
