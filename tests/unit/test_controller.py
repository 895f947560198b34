"""The controller's batch building, without processes."""

import time

import pytest

from meshrl.envs.base import Example
from meshrl.runtime.config import ModelConfig, RLConfig
from meshrl.runtime.rollout.controller import Controller, Group, Rollout, StepState
from meshrl.runtime.tokenizer import build_char_tokenizer


class FlakyEnv:
    name = "flaky"


def make_controller(tmp_path, samples_per_prompt=4):
    cfg = RLConfig(model=ModelConfig(flavor="debug", tokenizer="char"), prompts_per_step=2,
                   samples_per_prompt=samples_per_prompt, log={"console": False})
    tok = build_char_tokenizer()
    return Controller(cfg, layout=None, env=FlakyEnv(), tokenizer=tok, run_dir=tmp_path), tok


def rollout(tok, text, version=0):
    """A scored rollout as the episode driver hands it over: reward 1 for "good", 0 otherwise; the
    driver marks "boom" failed (its reward function raised: tests/unit/test_envs_faults.py)."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Rollout(ids, [-0.5] * len(ids), [version] * len(ids), "stop", text=text, reward=float(text == "good"),
                   failed=text == "boom")


def test_failed_rollouts_are_excluded_and_flat_groups_filtered(tmp_path):
    ctl, tok = make_controller(tmp_path)
    ex = Example(0, "abc\n", "cba", {})
    texts = [["good", "bad", "boom", "good"], ["bad", "bad", "bad", "bad"]]
    groups = []
    for g, row in enumerate(texts):
        rollouts = [rollout(tok, text, version=0) for text in row]
        groups.append(Group(ex, tok.encode(ex.prompt, add_special_tokens=False), rollouts))
    ctl.steps[2] = StepState(groups, time.perf_counter(), pending=0, failed=1)
    samples, stats = ctl._build_samples(step=2)
    # group 0: the failed rollout is excluded; advantages over the 3 others (mean 2/3)
    assert [round(s.advantage, 6) for s in samples] == [round(1 - 2 / 3, 6), round(-2 / 3, 6), round(1 - 2 / 3, 6)]
    # group 1: every reward equal -> no signal -> filtered
    assert stats["batch/groups_filtered"] == 1 and stats["batch/samples_trained"] == 3
    assert stats["rollouts/failed"] == 1
    assert stats["policy_lag/max"] == 2 and stats["policy_lag/mean"] == 2
    assert stats["reward/mean"] == pytest.approx(2 / 7)
    assert (tmp_path / "samples" / "step_2.jsonl").exists()
    # the completion handed to the trainer keeps the EOS token the engine sampled
    assert samples[0].completion_ids[-1] == tok.eos_token_id
