"""End to end on CPU: every loss type in a short synchronous RL job on a fresh debug model.

One run per `trainer.loss.type`; the mismatch corrections (token and sequence level) and the
advantage types and filters are spread over the same five runs, so every option runs end to end
at the cost of five short jobs (2 steps, 4 prompts x 4 samples). In synchronous mode the engine
samples from exactly the trainer's weights: mismatch_kl ~ 0, so no correction touches a token and
no trust region or clip drops one; the losses' values are checked by hand in tests/unit/test_losses.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RL = str(ROOT / "configs/reverse_text/rl.toml")

pytestmark = pytest.mark.slow

CASES = {
    "dppo": [],
    "aipo": ["--trainer.loss.correction", "tis", "--advantage.type", "grpo_std"],
    "ppo_clip": ["--trainer.loss.correction", "mis", "--trainer.loss.correction-level", "sequence",
                 "--advantage.type", "rloo"],
    "gspo": ["--trainer.loss.correction", "icepop", "--advantage.type", "drgrpo"],
    "cispo": ["--trainer.loss.correction", "icepop", "--trainer.loss.correction-level", "sequence",
              "--advantage.mask-truncated", "true", "--advantage.length-penalty", "0.1",
              "--advantage.max-pass-rate", "0.99"],
}


# cispo, with the most options (sequence-level icepop, truncation masking, length penalty, difficulty
# filter), runs by default; dppo, the default loss, runs in every other RL job of the suite; the other
# three are `pytest -m heavy`
@pytest.mark.parametrize("loss", [loss if loss == "cispo" else pytest.param(loss, marks=pytest.mark.heavy)
                                  for loss in sorted(CASES)])
def test_loss_runs_on_policy(loss, tmp_path):
    run = tmp_path / "rl"
    config = tmp_path / "rl.toml"  # the reverse-text RL config on a fresh model instead of the warm start
    config.write_text(Path(RL).read_text().replace('path = "runs/reverse_text/sft/checkpoints/final"', ""))
    args = ["rl", "@", str(config), "--model.flavor", "debug", "--model.tokenizer", "char",
            "--trainer.loss.type", loss, *CASES[loss], "--max-off-policy-steps", "0", "--max-steps", "2",
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--output-dir", str(run), "--log.console", "false"]
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["policy_lag/max"] == 0
        assert row["mismatch_kl"] <= 1e-6, row["mismatch_kl"]
        assert row["loss/correction_fraction"] == 0.0 and row["masked_fraction"] == 0.0
        assert row["loss/clipped_fraction"] == 0.0
        assert row["batch/groups_filtered"] == sum(row[f"batch/groups_dropped_{reason}"]
                                                   for reason in ("too_few", "flat", "too_hard", "too_easy"))
    resolved = json.loads((run / "config.json").read_text())
    assert resolved["trainer"]["loss"]["type"] == loss
