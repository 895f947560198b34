"""Faults: a reward function or tool that raises, hangs or exceeds its memory fails only its
rollout; the sandbox's limits; packing of multi-turn samples with loss masks."""

import queue
import time

import pytest
import torch

from meshrl.envs import CalculatorEnv, Example
from meshrl.envs.base import Reward, TextEpisode
from meshrl.envs.sandbox import SandboxError, SandboxLimits, call_in_subprocess, network_isolation, run_python
from meshrl.runtime.rollout.episodes import EpisodeDriver, EpisodeResult, Generate
from meshrl.runtime.train.packing import Sample, pack
from meshrl.runtime.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()


class FaultyEnv:
    """Single-turn env whose reward function misbehaves on demand: the completion names the fault."""

    name = "faulty"

    def example(self, index):
        return Example(index, f"q{index}\n", "ok")

    def score(self, example, completion):
        if completion == "raise":
            raise RuntimeError("reward server down")
        if completion == "hang":
            time.sleep(3600)
        if completion == "memory":
            hog = bytearray(8 << 30)  # more than the limit
            return float(len(hog))
        if completion == "nan":
            return float("nan")
        return Reward({"ok": float(completion == "ok")}, metrics={"len": float(len(completion))})


def play_all(env, replies, timeout_s=2.0, score_memory_mb=0, max_model_len=512, max_tokens=16):
    """Start one episode per reply list; the scripted engine answers every turn at once."""
    events = queue.Queue()
    driver = EpisodeDriver(TOK, max_tokens=max_tokens, max_model_len=max_model_len, post=events.put, num_workers=2,
                           timeout_s=timeout_s, score_memory_mb=score_memory_mb)
    for key, _ in enumerate(replies):
        driver.start(key, env, env.example(key))
    results = {}
    while len(results) < len(replies):
        action = driver.handle(events.get(timeout=60))
        if isinstance(action, Generate):
            ids = TOK.encode(replies[action.key][action.turn], add_special_tokens=False) + [TOK.eos_token_id]
            finish = "stop" if len(ids) <= action.max_tokens else "length"  # as the engine would
            ids = ids[:action.max_tokens]
            driver.on_completion(action.key, ids, [-1.0] * len(ids), [0] * len(ids), finish)
        elif isinstance(action, EpisodeResult):
            results[action.key] = action
    return [results[k] for k in range(len(replies))]


def test_raising_hanging_and_nan_rewards_fail_only_their_rollouts():
    start = time.perf_counter()
    results = play_all(FaultyEnv(), [["ok"], ["raise"], ["hang"], ["nan"], ["bad"]], timeout_s=1.0)
    assert [r.failed for r in results] == [False, True, True, True, False]
    assert "reward server down" in results[1].error
    assert results[2].error.startswith("timeout")
    assert "non-finite" in results[3].error
    assert results[0].reward.total == 1.0 and results[4].reward.total == 0.0
    assert results[1].reward is None
    assert time.perf_counter() - start < 20  # the hung call did not hold the others up


def test_a_reward_function_over_its_memory_is_killed():
    results = play_all(FaultyEnv(), [["memory"], ["ok"], ["hang"]], timeout_s=2.0, score_memory_mb=256)
    assert results[0].failed and results[0].error.startswith("SandboxError: memory")
    assert not results[1].failed and results[1].reward.total == 1.0 and results[1].reward.metrics == {"len": 2.0}
    assert results[2].failed and "timeout" in results[2].error


def test_a_tool_that_hangs_or_exhausts_memory_fails_the_rollout():
    env = CalculatorEnv(seed=0, tool_timeout_s=1.0, tool_memory_mb=64)
    results = play_all(env, [["CALL 9**9**9", "1"], ["CALL 10**10**8", "1"], ["CALL 2*3", "6"]], timeout_s=30)
    assert results[0].failed and "SandboxError: timeout" in results[0].error
    assert results[1].failed and ("memory" in results[1].error or "timeout" in results[1].error)
    assert not results[2].failed


def test_episodes_end_when_the_context_is_full():
    class Chatty(TextEpisode):
        def respond(self, reply):
            return "more please\n"

        def rewards(self):
            return Reward({"turns": float(len(self.replies))})

    class ChattyEnv:
        name = "chatty"

        def example(self, index):
            return Example(index, "hi\n", "")

        def episode(self, example, tokenizer):
            return Chatty(example, tokenizer, max_turns=100)

    result = play_all(ChattyEnv(), [["x" * 10] * 100], max_model_len=64, max_tokens=16)[0]
    assert not result.failed and result.finish_reason == "length"
    assert len(result.prompt_ids) + len(result.token_ids) <= 64 and result.reward.total == result.turns
    assert result.mask[-1]  # the environment's last message did not fit and was dropped
    with pytest.raises(ValueError, match="exceeds inference.max_model_len"):
        play_all(ChattyEnv(), [["x"]], max_model_len=8, max_tokens=16)


def test_sandbox_limits_and_no_network():
    limits = SandboxLimits(timeout_s=2.0, memory_mb=128)
    assert run_python("print(6 * 7)", limits).stdout == "42\n"
    failed = run_python("1/0", limits)
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr
    assert run_python("import os; print(len(os.environ))", limits).stdout.strip() in ("0", "1")  # empty environment
    with pytest.raises(SandboxError) as e:
        run_python("x = bytearray(1 << 30)", limits)
    assert e.value.kind == "memory"
    with pytest.raises(SandboxError) as e:
        run_python("while True: pass", SandboxLimits(timeout_s=0.5))
    assert e.value.kind == "timeout"
    if network_isolation():
        out = run_python("import socket\ntry:\n socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                         "except OSError as e: print('offline', e.errno)", limits)
        assert out.stdout.startswith("offline")
    assert call_in_subprocess(sum, [1, 2, 3], limits=limits) == 6
    with pytest.raises(SandboxError) as e:
        call_in_subprocess(int, "x", limits=limits)
    assert e.value.kind == "error" and "invalid literal" in str(e.value)


def test_packing_trains_only_on_sampled_tokens():
    # prompt 3 tokens; completion: 2 sampled, 3 environment, 2 sampled
    prompt, completion = [5, 6, 7], [10, 11, 20, 21, 22, 12, 13]
    mask = [True, True, False, False, False, True, True]
    logprobs = [-0.1, -0.2, 9.0, 9.0, 9.0, -0.3, -0.4]  # values at environment tokens are ignored
    [[mb]] = pack([Sample(prompt, completion, logprobs, 0.5, mask)], seq_len=32, num_ranks=1)
    targets, loss = mb["targets"][0].tolist(), mb["loss_mask"][0].tolist()
    assert [t for t, m in zip(targets, loss) if m] == [10, 11, 12, 13]
    assert mb["inference_logprobs"][0][mb["loss_mask"][0]].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert mb["inference_logprobs"][0][~mb["loss_mask"][0]].abs().sum() == 0
    assert torch.equal(mb["advantages"][0] != 0, mb["loss_mask"][0])
    # without a mask every completion token is trained, as before
    [[plain]] = pack([Sample(prompt, completion, [-1.0] * 7, 0.5)], seq_len=32, num_ranks=1)
    assert int(plain["loss_mask"].sum()) == 7
    with pytest.raises(ValueError, match="mask"):
        pack([Sample(prompt, completion, logprobs, 0.5, mask[:-1])], seq_len=32, num_ranks=1)
