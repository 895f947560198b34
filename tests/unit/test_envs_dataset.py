"""The `dataset` environment: prompts from files, chat rendering, rewards by name, bad input."""

from __future__ import annotations

import json

import pytest

from meshrl.envs import make_env
from meshrl.envs.base import make_episode
from meshrl.envs.dataset import final_answer, math_equal
from meshrl.runtime.config import RLConfig, validate
from meshrl.runtime.tokenizer import build_bpe_tokenizer, build_char_tokenizer

ROWS = [{"prompt": "2+3=", "answer": "5", "unit": "apples"}, {"prompt": "half of one?", "answer": "1/2", "unit": ""}]


def jsonl(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_examples_cover_every_row_each_epoch_in_a_seeded_order(tmp_path):
    env = make_env("dataset", path=jsonl(tmp_path, ROWS * 3), seed=1)
    first = [env.example(i).prompt for i in range(6)]
    assert sorted(first) == sorted(r["prompt"] for r in ROWS * 3)
    again = make_env("dataset", path=jsonl(tmp_path, ROWS * 3), seed=1)
    assert [again.example(i).prompt for i in range(6, 12)] == [env.example(i).prompt for i in range(6, 12)]
    assert env.example(0).info["row"]["unit"] in ("apples", "")


def test_exact_and_math_rewards(tmp_path):
    path = jsonl(tmp_path, ROWS)
    exact = make_env("dataset", path=path, shuffle=False)
    assert exact.score(exact.example(0), " 5\n").total == 1.0 and exact.score(exact.example(0), "5.").total == 0.0
    math = make_env("dataset", path=path, reward="math", shuffle=False)
    half = math.example(1)
    for completion in ("It is 0.5", "so \\boxed{\\frac{1}{2}}", "1/2.", "\\boxed{\\dfrac{1}{2}}"):
        assert math.score(half, completion).total == 1.0, completion
    wrong = math.score(half, "about 2")
    assert wrong.total == 0.0 and wrong.metrics["parsed"] == 1.0
    assert math.score(half, "no idea").metrics["parsed"] == 0.0
    assert final_answer("\\boxed{x^{2}} then 3") == "x^{2}" and math_equal("1,000", "1000")
    assert math_equal("\\left(1, 2\\right)", "(1,2)") and not math_equal("3", "4")


def test_a_python_reward_gets_its_arguments_from_the_rows_columns(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def unit_reward(completion, answer, unit):\n"
        "    return float(completion.strip() == f'{answer} {unit}'.strip())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("dataset", path=jsonl(tmp_path, ROWS), reward="my_rewards:unit_reward",
                   reward_args={"answer": "answer", "unit": "unit"}, shuffle=False)
    assert env.score(env.example(0), "5 apples").total == 1.0 and env.score(env.example(0), "5").total == 0.0
    with pytest.raises(ValueError, match="env.reward: cannot load 'my_rewards:nope'"):
        make_env("dataset", path=jsonl(tmp_path, ROWS), reward="my_rewards:nope")
    with pytest.raises(ValueError, match="no column\\(s\\) weight; it has columns \\['prompt', 'answer', 'unit'\\]"):
        make_env("dataset", path=jsonl(tmp_path, ROWS), reward="my_rewards:unit_reward", reward_args={"unit": "weight"})


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one(tmp_path):
    rows = [{"prompt": "2+3=", "answer": "5"},
            {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}], "answer": "2"}]
    env = make_env("dataset", path=jsonl(tmp_path, rows), system_prompt="Be brief.", shuffle=False)
    bpe = build_bpe_tokenizer()
    text = bpe.decode(make_episode(env, env.example(0), bpe).prompt_ids())
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    chat = bpe.decode(make_episode(env, env.example(1), bpe).prompt_ids())
    assert chat.startswith("<|im_start|>system\nAdd.<|im_end|>") and chat.endswith("<|im_start|>assistant\n")
    char = build_char_tokenizer()  # no template: the string as it is; a chat prompt cannot be rendered
    assert char.decode(make_episode(env, env.example(0), char).prompt_ids()) == "2+3="
    with pytest.raises(ValueError, match="needs a chat template"):
        make_episode(env, env.example(1), char).prompt_ids()
    # a reply that ends on the end-of-turn token is scored without it
    episode = make_episode(env, env.example(0), bpe)
    episode.prompt_ids()
    episode.step(bpe.encode("5", add_special_tokens=False) + [bpe.convert_tokens_to_ids("<|im_end|>")], "stop")
    assert episode.score().total == 1.0


def test_bad_rows_and_missing_columns(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "", "answer": "1"}) + "\n[1]\n")
    with pytest.raises(ValueError, match=rf"{path}:2: 'prompt' must be a non-empty string.*env.on_error"):
        make_env("dataset", path=str(path))
    env = make_env("dataset", path=str(path), on_error="skip")
    assert len(env) == 1 and len(env.rows.skipped) == 2 and env.rows.skipped[1].startswith(f"{path}:3: a JSON list")
    with pytest.raises(ValueError, match=r"has no column\(s\) question; it has columns \['prompt', 'answer', 'unit'\]"):
        make_env("dataset", path=jsonl(tmp_path, ROWS), prompt="question")


def test_config_checks_the_reward_name_and_rl_preflight_reads_the_file(tmp_path, monkeypatch):
    base = {"model": {"flavor": "debug", "tokenizer": "char"}}
    with pytest.raises(ValueError, match="env.reward must be exact, math or package.module:function"):
        validate(RLConfig, {**base, "env": {"name": "dataset", "path": "x.jsonl", "reward": "rm -rf"}})
    from meshrl.runtime import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = validate(RLConfig, {**base, "output_dir": str(tmp_path / "run"),
                              "env": {"name": "dataset", "path": str(tmp_path / "missing.jsonl")}})
    with pytest.raises(ValueError, match="missing.jsonl: no such file or folder"):
        rl.preflight(cfg)


def test_the_sft_chat_example_configs_validate():
    from pathlib import Path

    from meshrl.runtime.config import EvalConfig, SFTConfig, load_config

    root = Path(__file__).resolve().parents[2] / "configs" / "sft_chat"
    sft, _ = load_config(SFTConfig, ["@", str(root / "sft.toml")])
    assert sft.data is not None and sft.data.has_validation and sft.data.loss_on == "assistant"
    rl, _ = load_config(RLConfig, ["@", str(root / "rl.toml")])
    assert rl.env.name == "dataset" and rl.env.reward == "math"
    ev, _ = load_config(EvalConfig, ["@", str(root / "eval.toml")])
    assert ev.eval.example_offset == 0
