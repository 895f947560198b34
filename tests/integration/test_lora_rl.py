"""LoRA end to end on CPU: a short RL job completes (2 FSDP2 trainer ranks, merged weights to the
engine, mismatch_kl ~ 0 in sync mode) and exports a PEFT adapter; an SFT run resumed from its
adapter-only checkpoint ends where an uninterrupted run ends."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_resume import meshrl, rows

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

CONFIG = """
max_off_policy_steps = 0
prompts_per_step = 4
samples_per_prompt = 4
[model]
flavor = "debug"
tokenizer = "char"
[model.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj", "down_proj"]
[env]
name = "reverse-text"
seed = 1
[trainer]
micro_batch_tokens = 256
[trainer.optim]
lr = 1e-2
[inference]
max_num_seqs = 32
max_model_len = 48
[inference.sampling]
max_tokens = 12
[log]
console = false
"""

SFT = """
batch_size = 4
[model]
flavor = "debug"
tokenizer = "char"
[model.lora]
rank = 4
alpha = 8
[trainer.optim]
lr = 1e-2
[checkpoint]
async_save = false
"""


def test_a_lora_rl_job_completes_and_exports_a_peft_adapter(tmp_path):
    (tmp_path / "rl.toml").write_text(CONFIG)
    run = tmp_path / "run"
    meshrl("rl", "@", str(tmp_path / "rl.toml"), "--max-steps", "3", "--checkpoint.every", "2",
           "--layout.num-trainer-ranks", "2", "--output-dir", str(run))
    got = rows(run)
    assert [r["step"] for r in got] == [0, 1, 2]
    assert all(r["mismatch_kl"] < 1e-6 for r in got), [r["mismatch_kl"] for r in got]  # merged sync is exact
    final = run / "checkpoints" / "final"
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 3 * 2  # (A, B) x 3 targets x 2 layers
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # it trained
    merged = load_file(final / "model.safetensors")
    assert not any("lora" in k for k in merged)
    # the resumable checkpoint holds the adapters and their AdamW state, not the frozen base
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(run / "checkpoints" / "step_2" / "trainer")).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith("model.")}
    assert len(model_keys) == 12 and all(k.rpartition(".")[2] in ("lora_a", "lora_b") for k in model_keys), keys
    assert {k.split(".")[-1] for k in keys if k.startswith("optim.")} == {"exp_avg", "exp_avg_sq", "step"}

def test_a_resumed_lora_sft_run_ends_like_an_uninterrupted_one(tmp_path):
    (tmp_path / "sft.toml").write_text(SFT)
    cfg, run = str(tmp_path / "sft.toml"), tmp_path / "run"
    final = run / "checkpoints" / "final"
    names = ("model.safetensors", "adapter/adapter_model.safetensors")
    meshrl("sft", "@", cfg, "--max-steps", "4", "--checkpoint.every", "2", "--output-dir", str(run))
    want = {name: load_file(final / name) for name in names}  # uninterrupted
    # again from step_2's adapter-only checkpoint (the frozen base rebuilt from the seed)
    meshrl("sft", "@", cfg, "--max-steps", "4", "--checkpoint.every", "2", "--output-dir", str(run),
           "--resume.step", "2")
    assert "loaded the trainer state" in (run / "logs" / "rank0-trainer.log").read_text()
    for name in names:
        got = load_file(final / name)
        assert got.keys() == want[name].keys()
        for key in got:
            torch.testing.assert_close(got[key], want[name][key], rtol=0, atol=1e-6, msg=key)
    assert any(v.abs().max() > 0 for k, v in want[names[1]].items() if "lora_B" in k)  # it trained
