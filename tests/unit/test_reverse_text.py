"""The reverse-text environment and the environment registry."""

import pytest

from meshrl.envs import ENVIRONMENTS, Example, ReverseTextEnv, make_env
from meshrl.envs.reverse_text import lcs_length, lcs_reward

ARGS = dict(min_words=2, max_words=4, min_word_len=3, max_word_len=6)


def test_deterministic_from_seed_and_index():
    a, b = ReverseTextEnv(seed=7, **ARGS), ReverseTextEnv(seed=7, **ARGS)
    assert a.example(3) == b.example(3)
    assert a.example(3) != a.example(4)
    assert a.example(3) != ReverseTextEnv(seed=8, **ARGS).example(3)
    # Order of access does not matter: the cursor is just the index.
    first_a = [a.example(i) for i in (5, 1)]
    first_b = [b.example(i) for i in (1, 5)]
    assert first_a == first_b[::-1]


def test_example_shape():
    env = ReverseTextEnv(seed=0, **ARGS)
    for i in range(50):
        ex = env.example(i)
        text = ex.prompt[:-1]
        words = text.split(" ")
        assert ex.index == i and ex.prompt == text + "\n"
        assert 2 <= len(words) <= 4 and all(3 <= len(w) <= 6 and w.isalpha() and w.islower() for w in words)
        assert ex.answer == text[::-1]
        assert env.sft_completion(ex) == ex.answer


def test_scores():
    env = ReverseTextEnv(seed=0, **ARGS)
    ex = Example(index=0, prompt="abc de\n", answer="ed cba", info={})
    assert env.score(ex, "ed cba").total == 1.0
    assert env.score(ex, "  ed cba \nanything after the newline").total == 1.0
    assert env.score(ex, "").total == 0.0
    assert env.score(ex, "xyz").total == 0.0
    # "ed c" keeps 4 of the answer's 6 characters in order: LCS 4 / max(4, 6)
    assert env.score(ex, "ed c").total == pytest.approx(4 / 6)
    assert env.score(ex, "abc de").total == pytest.approx(1 / 6)  # LCS of a string and its reverse: one char
    real = env.example(11)
    assert env.score(real, env.sft_completion(real)).total == 1.0


def test_reward_does_not_pay_for_dropped_or_added_characters():
    env = ReverseTextEnv(seed=0, **ARGS)
    ex = Example(index=0, prompt="amm\n", answer="mma", info={})
    dropped, wrong, added = (env.score(ex, text) for text in ("ma", "mmm", "mmaa"))
    # a dropped character costs as much as a wrong one (difflib's ratio gave "ma" 0.8 and "mmm" 0.67)
    assert dropped.total == pytest.approx(2 / 3) and wrong.total == pytest.approx(2 / 3)
    assert added.total == pytest.approx(3 / 4)
    assert dropped.components == {"lcs": pytest.approx(2 / 3)}
    assert dropped.metrics == {"exact": 0.0, "length_ratio": pytest.approx(2 / 3)}
    assert added.metrics["length_ratio"] == pytest.approx(4 / 3)
    assert env.score(ex, "mma").metrics == {"exact": 1.0, "length_ratio": 1.0}


def test_lcs_by_hand():
    assert lcs_length("abcbdab", "bdcaba") == 4  # the textbook example: "bcba"
    assert lcs_length("", "abc") == 0 and lcs_length("abc", "abc") == 3
    assert lcs_reward("", "") == 1.0 and lcs_reward("ab", "") == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_words=0),
        dict(min_words=3, max_words=2),
        dict(min_word_len=0),
        dict(min_word_len=5, max_word_len=4),
        dict(seed="1"),
    ],
)
def test_argument_validation(bad):
    with pytest.raises(ValueError):
        ReverseTextEnv(**{"seed": 0, **ARGS, **bad})


def test_negative_index_rejected():
    with pytest.raises(ValueError, match="index"):
        ReverseTextEnv(seed=0, **ARGS).example(-1)


def test_registry():
    assert ENVIRONMENTS["reverse-text"] is ReverseTextEnv
    env = make_env("reverse-text", seed=1, **ARGS)
    assert env.name == "reverse-text" and env.example(0) == ReverseTextEnv(seed=1, **ARGS).example(0)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env("nope")
