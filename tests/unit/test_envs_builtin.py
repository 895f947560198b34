"""Built-in environments: seeded data, rewards on known good and bad completions, multi-turn
episodes whose tokens are exactly the engine's plus the environment's, with correct masks."""

import queue

import pytest

from meshrl.envs import (AlphabetSortEnv, ArithmeticEnv, CalculatorEnv, MixedEnv, MultiTurnSortEnv, ReverseTextEnv,
                         WordleEnv, make_env)
from meshrl.envs.base import Reward
from meshrl.envs.mix import integer_ratios, mix_cycle
from meshrl.envs.wordle import feedback
from meshrl.runtime.rollout.episodes import EpisodeDriver, EpisodeResult, Generate
from meshrl.runtime.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()


def play(env, example, replies, finish=None):
    """Drive one episode with scripted replies as the "engine"; returns (result, prompts, sampled)."""
    events = queue.Queue()
    driver = EpisodeDriver(TOK, max_tokens=64, max_model_len=1024, post=events.put, num_workers=1, timeout_s=20)
    driver.start("k", env, example)
    prompts, sampled = [], []
    while True:
        action = driver.handle(events.get(timeout=30))
        if isinstance(action, Generate):
            prompts.append(action.prompt_ids)
            ids = TOK.encode(replies[action.turn], add_special_tokens=False) + [TOK.eos_token_id]
            sampled.append(ids)
            logprobs = [-0.1 * (action.turn + 1)] * len(ids)
            driver.on_completion("k", ids, logprobs, [action.turn] * len(ids), (finish or {}).get(action.turn, "stop"))
        elif isinstance(action, EpisodeResult):
            return action, prompts, sampled


def check_tokens(result, prompts, sampled):
    """Token in / token out: every turn's prompt is all earlier tokens; the mask marks the sampled ones."""
    assert prompts[0] == result.prompt_ids
    position = 0
    for turn, ids in enumerate(sampled):
        start = len(prompts[turn]) - len(result.prompt_ids)
        assert prompts[turn] == result.prompt_ids + result.token_ids[:start]  # earlier turns verbatim
        assert result.token_ids[start:start + len(ids)] == ids
        assert result.mask[start:start + len(ids)] == [True] * len(ids)
        assert result.logprobs[start:start + len(ids)] == pytest.approx([-0.1 * (turn + 1)] * len(ids))
        end = len(prompts[turn + 1]) - len(result.prompt_ids) if turn + 1 < len(prompts) else len(result.token_ids)
        assert result.mask[start + len(ids):end] == [False] * (end - start - len(ids))  # environment tokens
        assert all(lp == 0.0 for lp in result.logprobs[start + len(ids):end])
        position = end
    assert position == len(result.token_ids) == len(result.mask) == len(result.logprobs)
    assert len(result.versions) == sum(result.mask)


@pytest.mark.parametrize("env", [AlphabetSortEnv(seed=3), MultiTurnSortEnv(seed=3), WordleEnv(seed=3),
                                 ArithmeticEnv(seed=3), ArithmeticEnv(seed=3, style="word"), CalculatorEnv(seed=3)])
def test_examples_are_a_pure_function_of_seed_and_index(env):
    twin = type(env)(**{k: getattr(env, k) for k in ("seed",)}, **({"style": env.style} if hasattr(env, "style") else {}))
    assert [env.example(i) for i in (4, 0, 9)] == [twin.example(i) for i in (4, 0, 9)]
    assert env.example(1) != env.example(2) or isinstance(env, WordleEnv)
    with pytest.raises(ValueError):
        env.example(-1)


def test_alphabet_sort_rewards():
    env = AlphabetSortEnv(seed=0, min_words=3, max_words=3)
    ex = env.example(0)
    words = ex.prompt.removeprefix("sort: ").split()
    assert ex.prompt.startswith("sort: ") and len(words) == 3 and ex.answer == " ".join(sorted(words))
    good = env.score(ex, ex.answer + "\nanything after the first line")
    assert isinstance(good, Reward) and good.total == 1.0 and good.metrics["exact"] == 1.0
    unsorted = env.score(ex, " ".join(words[::-1]) if words != sorted(words)[::-1] else "zzz")
    assert unsorted.total < 1.0 and unsorted.metrics["exact"] == 0.0
    assert env.score(ex, "").total == 0.0
    assert env.sft_completion(ex) == ex.answer
    assert AlphabetSortEnv(weights={"similarity": 2.0}).score(ex, ex.answer).total == 2.0


def test_arithmetic_rewards():
    env = ArithmeticEnv(seed=0, num_ops=2)
    ex = env.example(5)
    expression = ex.prompt.strip().removesuffix("=")
    assert str(eval(expression)) == ex.answer
    assert env.score(ex, ex.answer).total == 1.0
    assert env.score(ex, f"the answer is {ex.answer}").total == 1.0  # the last integer counts
    assert env.score(ex, f"{ex.answer} or maybe {int(ex.answer) + 1}").total == 0.0
    wrong = env.score(ex, "no idea")
    assert wrong.total == 0.0 and wrong.metrics["parsed"] == 0.0
    words = ArithmeticEnv(seed=0, style="word")
    for i in range(20):
        ex = words.example(i)
        assert ex.prompt.endswith("?\n") and int(ex.answer) >= 0
        assert words.score(ex, ex.answer).total == 1.0


def test_wordle_feedback_marks_repeated_letters_once():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("slate", "crane") == "..G.G"
    assert feedback("eerie", "theme") == "Y...G"   # one spare e besides the green one
    assert feedback("allee", "eagle") == "YY.YG"
    assert feedback("zzzzz", "crane") == "....."


def test_wordle_episode_solved_and_unsolved():
    env = WordleEnv(seed=1, max_turns=4)
    ex = env.example(0)
    secret = ex.answer
    wrong = "zzzzz" if "z" not in secret else "qqqqq"
    result, prompts, sampled = play(env, ex, [wrong, "ab", secret, "never played"])
    check_tokens(result, prompts, sampled)
    assert result.turns == 3 and not result.failed
    env_text = TOK.decode(result.token_ids)
    assert f"{wrong} .....\n" in env_text and "invalid\n" in env_text
    assert result.reward.components["solved"] == 1.0 and result.reward.total == pytest.approx(1.2)
    assert result.reward.metrics["valid_fraction"] == pytest.approx(2 / 3)
    result, _, _ = play(env, ex, [wrong] * 4)
    assert result.turns == 4 and result.reward.components["solved"] == 0.0 and result.reward.total == 0.0


def test_multiturn_sort_list_grows_and_each_turn_is_scored():
    env = MultiTurnSortEnv(seed=2, num_turns=3)
    ex = env.example(7)
    turns, answers = ex.info["turns"], ex.info["answers"]
    result, prompts, sampled = play(env, ex, answers)
    check_tokens(result, prompts, sampled)
    assert result.turns == 3 and result.reward.total == 1.0 and result.reward.metrics["exact_turns"] == 1.0
    # the environment adds the next words after each reply, as environment tokens
    env_tokens = [t for t, m in zip(result.token_ids, result.mask) if not m]
    assert TOK.decode(env_tokens) == f"add: {' '.join(turns[1])}\nadd: {' '.join(turns[2])}\n"
    # a wrong middle turn costs a third of the similarity
    result, _, _ = play(env, ex, [answers[0], "", answers[2]])
    assert result.reward.total == pytest.approx(2 / 3) and result.reward.metrics["final_similarity"] == 1.0


def test_a_truncated_turn_ends_the_episode():
    env = MultiTurnSortEnv(seed=2, num_turns=3)
    ex = env.example(0)
    result, prompts, _ = play(env, ex, [ex.info["answers"][0]], finish={0: "length"})
    assert len(prompts) == 1 and result.finish_reason == "length" and result.turns == 1
    assert result.reward.total == pytest.approx(1 / 3)


def test_calculator_tool_results_are_environment_tokens():
    env = CalculatorEnv(seed=0, num_ops=2)
    ex = env.example(3)
    expression = ex.info["expression"]
    result, prompts, sampled = play(env, ex, [f"CALL {expression}", "CALL 1/0", "CALL import os", ex.answer])
    check_tokens(result, prompts, sampled)
    env_text = TOK.decode([t for t, m in zip(result.token_ids, result.mask) if not m])
    assert env_text.startswith(f"= {ex.answer}\n")
    assert "error: ZeroDivisionError: division by zero\n" in env_text
    assert "error: only numbers" in env_text
    r = result.reward
    assert r.total == 1.0 and r.metrics == {"tool_calls": 3.0, "tool_errors": 2.0, "answered": 1.0}
    # a wrong final answer, and running out of calls
    assert play(env, ex, ["12"])[0].reward.total == float(ex.answer == "12")
    capped = CalculatorEnv(seed=0, max_tool_calls=1)
    result, prompts, _ = play(capped, ex, ["CALL 1+1", "CALL 2+2"])
    assert len(prompts) == 2 and result.reward.metrics["answered"] == 0.0 and result.reward.total == 0.0


def test_instructions_prefix():
    assert CalculatorEnv(instructions=True).example(0).prompt.startswith("Use the calculator")


def test_mix_ratios_are_exact_per_cycle_and_deterministic():
    assert integer_ratios([3, 1]) == [3, 1] and integer_ratios([0.75, 0.25]) == [3, 1]
    assert integer_ratios([0.5, 0.5, 1.0]) == [1, 1, 2]
    cycle = mix_cycle([3, 1])
    assert sorted(cycle) == [0, 0, 0, 1] and cycle.count(1) == 1
    mix = make_env("mix", envs=[("alphabet-sort", {"seed": 0}, 3.0), ("reverse-text", {
        "seed": 0, "min_words": 1, "max_words": 1, "min_word_len": 3, "max_word_len": 5}, 1.0)])
    assert isinstance(mix, MixedEnv)
    located = [mix.locate(i) for i in range(40)]
    assert sum(key == "reverse-text" for key, _ in located) == 10
    for key in ("alphabet-sort", "reverse-text"):  # each environment's own examples in order, none skipped
        assert [sub for k, sub in located if k == key] == list(range(sum(k == key for k, _ in located)))
    ex = mix.example(2)
    assert ex.env == "reverse-text" and ex == mix.example(2)
    assert ex.prompt == ReverseTextEnv(0, 1, 1, 3, 5).example(0).prompt
    assert float(mix.score(ex, ex.answer)) == 1.0
    assert mix.sft_completion(ex) == ex.answer
    with pytest.raises(ValueError, match="positive"):
        integer_ratios([1, 0])


def test_mix_of_a_repeated_environment_gets_distinct_keys():
    mix = MixedEnv([(AlphabetSortEnv(seed=0), 1), (AlphabetSortEnv(seed=1), 1)])
    assert mix.keys == ["alphabet-sort", "alphabet-sort-2"]
    a, b = mix.example(0), mix.example(1)
    assert (a.env, b.env) == ("alphabet-sort", "alphabet-sort-2") and a.prompt != b.prompt
    result, _, _ = play(mix, b, [b.answer])
    assert result.env == "alphabet-sort-2" and result.reward.total == 1.0
