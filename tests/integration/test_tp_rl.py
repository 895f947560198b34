"""End to end on CPU: RL with a tensor-parallel engine replica (inference.tensor_parallel = 2).

1 controller + 1 trainer + 2 inference ranks forming one replica, each holding half of every
attention and FFN matrix of a fresh Qwen3. Synchronous mode, so the engine samples from exactly
the trainer's weights: mismatch_kl ~ 0 proves that every weight sync reached both shards as the
right slices and that the two ranks stayed in lockstep (a divergence would hang or fail the run).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RL = str(ROOT / "configs/reverse_text/rl.toml")

pytestmark = pytest.mark.slow


def run_rl(tmp_path: Path, *extra: str) -> list[dict]:
    run = tmp_path / "rl"
    # the reverse-text RL config without its warm-start model.path: a fresh model instead
    config = tmp_path / "rl.toml"
    config.write_text(Path(RL).read_text().replace('path = "runs/reverse_text/sft/checkpoints/final"', ""))
    args = ["rl", "@", str(config), "--model.flavor", "debug", "--model.tokenizer", "char",
            "--inference.tensor-parallel", "2", "--max-steps", "3", "--prompts-per-step", "4",
            "--samples-per-prompt", "4", "--output-dir", str(run), "--log.console", "false", *extra]
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    logs = sorted(p.name for p in (run / "logs").glob("rank*-inference.log"))
    assert len(logs) == int(extra[extra.index("--layout.num-inference-ranks") + 1]), logs
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rl_with_a_tensor_parallel_replica_is_on_policy(tmp_path):
    rows = run_rl(tmp_path, "--layout.num-inference-ranks", "2", "--max-off-policy-steps", "0")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert "reward/mean" in row and row["rollouts/failed"] == 0
        assert row["policy_lag/max"] == 0
        assert row["mismatch_kl"] <= 1e-6, row["mismatch_kl"]
    assert rows[-1]["weights/version"] == 3


@pytest.mark.heavy  # 6 processes, ~35 s on a 2-core CPU; the on-policy test above covers TP's weight path
def test_two_tensor_parallel_replicas_asynchronously(tmp_path):
    rows = run_rl(tmp_path, "--layout.num-inference-ranks", "4", "--max-off-policy-steps", "1")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(row["policy_lag/max"] <= 1 and row["rollouts/failed"] == 0 for row in rows)
