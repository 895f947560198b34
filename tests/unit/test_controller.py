"""The controller's batch building, without processes."""

import time

import pytest

from meshrl.envs.base import Example
from meshrl.runtime import transport
from meshrl.runtime.config import AdvantageConfig, ModelConfig, RLConfig
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
    per_group, stats = ctl._build_samples(step=2)
    assert len(per_group) == 2 and per_group[1] == []
    samples = per_group[0]
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


def _step(ctl, tok, texts, finish=None):
    """Put one step of groups (rows of rollout texts) into the controller; rewards as `rollout` gives them."""
    ex = Example(0, "abc\n", "cba", {})
    groups = []
    for g, row in enumerate(texts):
        rollouts = [rollout(tok, text) for text in row]
        for j, r in enumerate(rollouts):
            if finish is not None:
                r.finish_reason = finish[g][j]
        groups.append(Group(ex, tok.encode(ex.prompt, add_special_tokens=False), rollouts))
    ctl.steps[0] = StepState(groups, time.perf_counter(), pending=0)
    per_group, stats = ctl._build_samples(step=0)
    return [s for group in per_group for s in group], stats


def test_advantage_type_rloo_and_difficulty_filter(tmp_path):
    ctl, tok = make_controller(tmp_path)
    ctl.cfg = ctl.cfg.model_copy(update={"advantage": AdvantageConfig(type="rloo", max_pass_rate=0.5)})
    samples, stats = _step(ctl, tok, [["good", "bad", "bad", "bad"], ["good", "good", "good", "bad"]])
    # group 0: leave-one-out 1 - 0 and 0 - 1/3; group 1 passes 3/4 > 0.5: dropped as too easy
    assert [round(s.advantage, 6) for s in samples] == [1.0, round(-1 / 3, 6), round(-1 / 3, 6), round(-1 / 3, 6)]
    assert stats["batch/groups_dropped_too_easy"] == 1 and stats["batch/groups_filtered"] == 1
    assert stats["batch/groups_dropped_flat"] == 0 and stats["batch/groups_dropped_too_hard"] == 0


def test_overlong_samples_are_masked_but_stay_in_the_baseline(tmp_path):
    ctl, tok = make_controller(tmp_path)
    ctl.cfg = ctl.cfg.model_copy(update={"advantage": AdvantageConfig(mask_truncated=True)})
    finish = [["stop", "length", "stop", "stop"], ["stop"] * 4]
    samples, stats = _step(ctl, tok, [["good", "bad", "bad", "bad"], ["bad"] * 4], finish)
    # the group mean counts the truncated sample (1/4); it is not trained on
    assert [round(s.advantage, 6) for s in samples] == [0.75, -0.25, -0.25]
    assert stats["batch/samples_masked_truncated"] == 1 and stats["batch/groups_dropped_flat"] == 1


def test_length_penalty_shapes_the_advantage_not_the_logged_reward(tmp_path):
    ctl, tok = make_controller(tmp_path)
    ctl.cfg = ctl.cfg.model_copy(update={"advantage": AdvantageConfig(length_penalty=0.64)})
    max_tokens = ctl.cfg.inference.sampling.max_tokens  # 64: the penalty is 0.01 per sampled token
    samples, stats = _step(ctl, tok, [["good", "goodgood", "good", "good"]])
    # rewards 1, 0, 1, 1 ("goodgood" is not "good"); sampled tokens 5, 9, 5, 5 (eos included)
    shaped = [1 - 0.05, 0 - 0.09, 1 - 0.05, 1 - 0.05]
    mean = sum(shaped) / 4
    assert max_tokens == 64
    assert [round(s.advantage, 6) for s in samples] == [round(x - mean, 6) for x in shaped]
    assert stats["reward/mean"] == 0.75


def test_drgrpo_divides_by_samples_times_max_tokens(tmp_path):
    from meshrl.runtime.train.packing import pack

    ctl, tok = make_controller(tmp_path)
    samples, _ = _step(ctl, tok, [["good", "bad", "bad", "bad"]])
    batches = pack(samples, 64, 1)
    assert ctl.feed.loss_normaliser(samples, batches) == 4 + 4 + 4 + 5  # loss tokens: completions with eos
    ctl.feed.cfg = ctl.cfg.model_copy(update={"advantage": AdvantageConfig(type="drgrpo")})
    assert ctl.feed.loss_normaliser(samples, batches) == 4 * 64


def test_overlap_sends_finished_groups_as_parts_and_the_step_count_last(tmp_path):
    """trainer.overlap_rollout: a group whose rollouts are all in goes to the trainer while the other
    generates; the next part waits for PART_TRAINED; the last part carries the loss tokens of both."""
    from meshrl.runtime import protocol
    from meshrl.runtime.train.packing import count_loss_tokens

    ctl, tok = make_controller(tmp_path)
    assert ctl.feed.overlap  # the default
    sent = []
    ctl.feed._send = lambda step, batches, n, scale: sent.append((step, batches, n, scale))
    ex = Example(0, "abc\n", "cba", {})
    prompt = tok.encode(ex.prompt, add_special_tokens=False)
    texts = [["good", "bad", "bad", "good"], ["bad", "good", "bad", "bad"]]
    ctl.steps[0] = StepState([Group(ex, prompt, [None] * 4) for _ in texts], time.perf_counter(), pending=8)
    for g in range(2):  # every turn with an engine (request id -> episode key)
        for j in range(4):
            ctl.where[10 * g + j] = ("train", 0, g, j)

    def finish(g, j):
        ctl.where.pop(10 * g + j)  # generated
        ctl.steps[0].groups[g].rollouts[j] = rollout(tok, texts[g][j])  # and scored
        ctl.steps[0].pending -= 1

    for j in range(3):
        finish(1, j)
    finish(0, 0)
    ctl._maybe_train()
    assert sent == []  # no group is complete
    finish(1, 3)
    ctl._maybe_train()
    (step, part, n, scale), = sent
    assert step == 0 and n is None and scale == 2 * 4 * 64  # provisional: prompts x samples x max_tokens
    assert sum(int(mb["loss_mask"].sum()) for mb in part[0]) == 4 + 5 + 4 + 4  # group 1 alone
    for j in range(1, 4):
        finish(0, j)
    ctl._maybe_train()
    assert len(sent) == 1 and not ctl.clock.training  # the part is still with the trainer
    ctl._handle(transport.Message(protocol.Kind.PART_TRAINED, {"step": 0}))
    ctl._maybe_train()
    (_, last, n, last_scale) = sent[1]
    assert last_scale == scale and n == count_loss_tokens([part[0], last[0]]) == 17 + 5 + 4 + 4 + 5
    assert ctl.clock.training and ctl._pending_stats["batch/train_parts"] == 2


def test_without_overlap_a_step_is_one_train_message(tmp_path):
    ctl, tok = make_controller(tmp_path)
    ctl.feed.overlap = False
    sent = []
    ctl.feed._send = lambda step, batches, n, scale: sent.append((step, batches, n, scale))
    ex = Example(0, "abc\n", "cba", {})
    groups = [Group(ex, tok.encode(ex.prompt, add_special_tokens=False), [rollout(tok, t) for t in row])
              for row in (["good", "bad", "bad", "good"], ["bad", "good", "bad", "bad"])]
    ctl.steps[0] = StepState(groups, time.perf_counter(), pending=4)
    ctl.steps[0].groups[0].rollouts[0] = None
    ctl._maybe_train()
    assert sent == []
    ctl.steps[0].groups[0].rollouts[0] = rollout(tok, "good")
    ctl.steps[0].pending = 0
    ctl._maybe_train()
    (_, batches, n, scale), = sent
    assert n == 18 + 17 and scale is None and ctl._pending_stats["batch/train_parts"] == 1


def test_overlap_sends_no_part_once_only_scoring_remains(tmp_path):
    """Every rollout generated, some not scored yet: the groups already scored wait for the last part
    (a part then would make the step wait for it), and go with the others."""
    ctl, tok = make_controller(tmp_path)
    sent = []
    ctl.feed._send = lambda step, batches, n, scale: sent.append((step, batches, n, scale))
    ex = Example(0, "abc\n", "cba", {})
    prompt = tok.encode(ex.prompt, add_special_tokens=False)
    ctl.steps[0] = StepState([Group(ex, prompt, [rollout(tok, t) for t in ("good", "bad", "bad", "bad")]),
                              Group(ex, prompt, [None] * 4)], time.perf_counter(), pending=4)
    ctl._maybe_train()
    assert sent == []  # group 0 is complete, but group 1 is only being scored (nothing in ctl.where)
    ctl.where[7] = ("train", 1, 0, 0)  # a turn of the next step on an engine does not count
    ctl._maybe_train()
    assert sent == []
    ctl.where[8] = ("train", 0, 1, 3)  # one of this step's turns still generating: group 0 goes now
    ctl._maybe_train()
    assert len(sent) == 1 and sent[0][2] is None


def test_sleep_while_training_turns_overlap_off(tmp_path):
    """The trainer steps in the memory the sleeping engine frees: no part may train beside the engine."""
    cfg = RLConfig(model=ModelConfig(flavor="debug", tokenizer="char"), max_off_policy_steps=0,
                   layout={"colocate": True}, inference={"sleep_while_training": True}, log={"console": False})
    ctl = Controller(cfg, layout=None, env=FlakyEnv(), tokenizer=build_char_tokenizer(), run_dir=tmp_path)
    assert cfg.trainer.overlap_rollout and not ctl.feed.overlap
