"""End to end on CPU: RL on a fresh Qwen3-MoE with expert parallelism over 2 trainer ranks.

Synchronous mode (max_off_policy_steps = 0), so the inference engine must sample from exactly
the weights the trainer holds: mismatch_kl ~ 0 proves the expert shards (split over ep, then
FSDP-sharded) are gathered and broadcast to the engine correctly after every step. The MoE load
statistics must reach metrics.jsonl.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RL = str(ROOT / "configs/reverse_text/rl.toml")

# heavy: the per-family EP RL jobs (test_moe_families_rl.py) run the same path by default
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_moe_rl_with_expert_parallel_is_on_policy(tmp_path):
    run = tmp_path / "rl"
    # the reverse-text RL config without its warm-start model.path: a fresh model instead
    config = tmp_path / "rl.toml"
    config.write_text(Path(RL).read_text().replace('path = "runs/reverse_text/sft/checkpoints/final"', ""))
    args = ["rl", "@", str(config), "--model.flavor", "debug", "--model.family", "qwen3_moe", "--model.tokenizer", "char",
            "--layout.num-trainer-ranks", "2", "--trainer.parallel.ep", "2",
            "--trainer.parallel.activation-checkpointing", "selective",
            "--max-off-policy-steps", "0", "--max-steps", "4", "--prompts-per-step", "4",
            "--samples-per-prompt", "4", "--output-dir", str(run), "--log.console", "false"]
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["policy_lag/max"] == 0
        assert row["mismatch_kl"] <= 1e-6, row["mismatch_kl"]
        assert row["moe/load_max"] >= 1.0 >= row["moe/load_min"] >= 0.0 and row["moe/aux_loss"] > 0
    assert rows[-1]["weights/version"] == 4
