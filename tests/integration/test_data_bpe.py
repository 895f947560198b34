"""End to end on CPU, offline, with a real (byte-level BPE) tokenizer built in code: `meshrl sft` on a
chat JSONL ([data], the model folder's ChatML template, assistant-only loss, a validation split),
resumed exactly from a checkpoint; `meshrl rl` on the `dataset` environment (math reward, chat
prompts, two stop ids); `meshrl eval` on it. The model is a fresh debug Qwen3: these runs check
the plumbing, not learning (examples/sft_chat/ shows learning).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def meshrl(*args, timeout=400) -> None:
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if r.returncode != 0:
        raise AssertionError(f"meshrl {' '.join(args)} exited {r.returncode}\n{r.stderr[-5000:]}")


def rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    from meshrl.envs.base import stop_token_ids
    from meshrl.models import get_family
    from meshrl.models.hf import save_hf_model
    from meshrl.runtime.tokenizer import build_bpe_tokenizer, save_tokenizer

    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    sums = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(40)]
    with open(root / "chat.jsonl", "w") as f:
        for a, b in sums:
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for a, b in sums[:16]:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    tok = build_bpe_tokenizer()
    family = get_family("qwen3")
    args = dataclasses.replace(family.flavors["debug"], vocab_size=len(tok))
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tok, tok_dir)
        save_hf_model(model, args, root / "model", tokenizer_dir=tok_dir, eos_token_id=list(stop_token_ids(tok)),
                      pad_token_id=tok.pad_token_id)
    return root


def test_sft_on_a_chat_file_resumes_exactly_then_rl_and_eval_on_a_prompt_file(files, tmp_path):
    sft = ["sft", "--model.path", str(files / "model"), "--data.path", str(files / "chat.jsonl"),
           "--data.validation-fraction", "0.1", "--eval-every", "2", "--max-steps", "4", "--batch-size", "8",
           "--trainer.micro-batch-tokens", "256", "--trainer.optim.lr", "3e-3", "--checkpoint.every", "2"]
    run = tmp_path / "sft"
    meshrl(*sft, "--output-dir", str(run))
    full = rows(run)
    assert sorted(full) == [0, 1, 2, 3] and full[3]["loss"] < full[0]["loss"]
    assert full[0]["data/rows"] == 36 and full[0]["data/validation_rows"] == 4 and full[0]["data/skipped_rows"] == 0
    assert "val/loss" in full[1] and "val/loss" in full[3] and full[3]["data/epoch"] == pytest.approx(32 / 36)
    # a run resumed from step 2 trains on the same examples next: the same losses, step for step
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    meshrl(*sft, "--output-dir", str(resumed), "--resume.step", "2")
    again = rows(resumed)
    for step in (2, 3):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-5), step
        assert again[step]["tokens/train"] == full[step]["tokens/train"]
    final = run / "checkpoints" / "final"
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [0, 3]
    assert (final / "chat_template.jinja").is_file()

    rl = tmp_path / "rl"
    meshrl("rl", "--model.path", str(final), "--env.name", "dataset", "--env.path", str(files / "prompts.jsonl"),
           "--env.reward", "math", "--max-steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
           "--max-off-policy-steps", "0", "--inference.max-model-len", "64", "--inference.sampling.max-tokens", "8",
           "--trainer.micro-batch-tokens", "256", "--output-dir", str(rl), "--log.console", "false")
    steps = rows(rl)
    assert sorted(steps) == [0, 1] and all("env/dataset/correct" in r for r in steps.values())
    sample = json.loads((rl / "samples" / "step_0.jsonl").read_text().splitlines()[0])
    assert sample["env"] == "dataset" and sample["prompt"].endswith("=")

    out = tmp_path / "eval"
    meshrl("eval", "--model.path", str(rl / "checkpoints" / "final"), "--env.name", "dataset", "--env.path",
           str(files / "prompts.jsonl"), "--env.reward", "math", "--eval.num-examples", "8",
           "--eval.example-offset", "0", "--inference.sampling.max-tokens", "8", "--inference.max-model-len", "64",
           "--output-dir", str(out))
    summary = json.loads((out / "results.json").read_text())
    assert summary["env"] == "dataset" and summary["num_examples"] == 8 and summary["failed"] == 0
    assert 0.0 <= summary["env/dataset/correct"] <= 1.0 and "env/dataset/parsed" in summary
