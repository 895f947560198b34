"""Issue 16's small things: eval text, step names on the console, the throughput of every step
(the last one included)."""

import types

from meshrl.envs.base import Example
from meshrl.runtime.rollout.controller import Controller
from meshrl.runtime.rollout.episodes import EpisodeResult, completion_text
from meshrl.runtime.rundir import ProgressLine
from meshrl.runtime.tokenizer import build_char_tokenizer


def test_eval_text_is_decoded_like_rl_samples():
    tok = build_char_tokenizer()
    ids = tok.encode("cba", add_special_tokens=False) + [tok.eos_token_id]
    single = EpisodeResult(key=0, example=Example(index=0, prompt="abc", answer="cba"), env="e", prompt_ids=[],
                           token_ids=ids, mask=[True] * len(ids))
    assert completion_text(tok, single) == "cba" and "<eos>" not in completion_text(tok, single)
    multi = EpisodeResult(key=0, example=Example(index=0, prompt="abc", answer="cba"), env="e", prompt_ids=[],
                          token_ids=ids + ids, mask=[True] * 4 + [False] * 4)
    assert completion_text(tok, multi) == "cba<eos>cba<eos>"  # a multi-turn stream keeps its turn ends


def test_the_console_names_steps_as_the_files_do(capsys):
    line = ProgressLine(total=3, enabled=True, label="rl")
    line.update(0, "reward 0.5")
    line.update(2, "reward 0.7")
    assert capsys.readouterr().err.splitlines() == ["rl step 0 (1/3) reward 0.5", "rl step 2 (3/3) reward 0.7"]


def test_every_step_has_its_rollout_throughput_the_last_one_too():
    owner = types.SimpleNamespace(_previous_done_at=0.0)
    steps = [types.SimpleNamespace(dispatched_at=0.0, done_at=2.0, sampled_tokens=200),   # 100 tok/s
             types.SimpleNamespace(dispatched_at=1.0, done_at=3.0, sampled_tokens=100),   # engines busy until 2
             types.SimpleNamespace(dispatched_at=5.0, done_at=9.0, sampled_tokens=400)]   # the last step
    rates = [Controller._rollout_rate(owner, s) for s in steps]
    assert rates == [100.0, 100.0, 100.0]
