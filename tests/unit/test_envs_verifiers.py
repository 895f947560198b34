"""The verifiers (0.4, verifiers.v1) adapter on tasksets defined here, fully offline: the direct
single-turn path, and the harness path (a verifiers agent harness whose model calls are our
turns), multi-turn with a shell tool."""

import asyncio
import json
import queue
import time

import pytest

vf = pytest.importorskip("verifiers.v1")

from meshrl.envs import make_env  # noqa: E402
from meshrl.envs.verifiers_adapter import ChatRenderer, parse_tool_calls  # noqa: E402
from meshrl.runtime.rollout.episodes import EpisodeDriver, EpisodeResult, Generate  # noqa: E402
from meshrl.runtime.tokenizer import build_char_tokenizer  # noqa: E402

TOK = build_char_tokenizer()
HERE = __name__


class SortData(vf.TaskData):
    answer: str


class SortTask(vf.Task[SortData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def starts_right(self, task, trace) -> float:
        return float(trace.last_reply[:1] == task.answer[:1])

    @vf.metric
    async def reply_len(self, trace) -> float:
        return float(len(trace.last_reply))


class SortTaskset(vf.Taskset[SortTask]):
    def load(self):
        for words in (["c", "a", "b"], ["z", "y"], ["m", "n", "k", "l"]):
            yield SortTask(SortData(prompt=" ".join(words), answer=" ".join(sorted(words))))


class BadTask(SortTask):
    @vf.reward
    async def broken(self, task, trace) -> float:
        raise RuntimeError("judge unreachable")


class BadTaskset(vf.Taskset[BadTask]):
    def load(self):
        yield BadTask(SortData(prompt="b a", answer="a b"))


class FileData(vf.TaskData):
    answer: str


class FileTask(vf.Task[FileData]):
    """Needs the harness path: setup writes a file into the runtime; the reward reads the agent's output file."""

    async def setup(self, trace, runtime) -> None:
        await runtime.write("secret.txt", self.data.answer.encode())

    @vf.reward
    async def copied(self, task, trace, runtime) -> float:
        try:
            return float((await runtime.read("answer.txt")).decode().strip() == task.answer)
        except Exception:  # noqa: BLE001 - no file: no reward
            return 0.0

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class FileTaskset(vf.Taskset[FileTask]):
    def load(self):
        for word in ("apple", "pear"):
            yield FileTask(FileData(prompt="copy secret.txt to answer.txt", answer=word))


class StuckTask(FileTask):
    async def setup(self, trace, runtime) -> None:
        if self.data.answer == "stuck":
            await asyncio.sleep(3600)


class StuckTaskset(vf.Taskset[StuckTask]):
    def load(self):
        for word in ("stuck", "fine"):
            yield StuckTask(FileData(prompt="copy secret.txt to answer.txt", answer=word))


def play(env, replies_for, indices, timeout_s=120):
    """Run episodes of `indices` with a scripted engine: replies_for(index, turn, prompt_ids) -> text."""
    events = queue.Queue()
    driver = EpisodeDriver(TOK, max_tokens=200, max_model_len=4096, post=events.put, num_workers=len(indices),
                           timeout_s=timeout_s)
    for i in indices:
        driver.start(i, env, env.example(i))
    prompts, results = {}, {}
    while len(results) < len(indices):
        action = driver.handle(events.get(timeout=timeout_s))
        if isinstance(action, Generate):
            prompts.setdefault(action.key, []).append(action.prompt_ids)
            text = replies_for(action.key, action.turn, action.prompt_ids)
            ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
            driver.on_completion(action.key, ids, [-0.5] * len(ids), [0] * len(ids), "stop")
        elif isinstance(action, EpisodeResult):
            results[action.key] = action
    return results, prompts


def test_direct_single_turn_uses_the_tasks_prompts_and_reward_functions():
    env = make_env("verifiers", taskset=f"{HERE}:SortTaskset")
    assert env.name == "SortTaskset" and not env.uses_harness(env.task(0))
    ex = env.example(4)  # wraps around the three tasks
    assert ex.prompt == "z y" and ex.answer == "y z" and ex.info["task_idx"] == 1
    answers = {0: "a b c", 1: "y q", 2: "wrong"}
    results, prompts = play(env, lambda i, turn, ids: answers[i], [0, 1, 2])
    assert TOK.decode(prompts[0][0]) == "c a b\n"  # plain rendering of a tokenizer without a chat template
    r0, r1, r2 = (results[i].reward for i in range(3))
    assert r0.components == {"exact": 1.0, "starts_right": 1.0} and r0.total == 1.5
    assert r0.weights == {"exact": 1.0, "starts_right": 0.5} and r0.metrics == {"reply_len": 5.0}
    assert r1.total == 0.5 and r2.total == 0.0
    assert not any(r.failed for r in results.values())


def load_sort_taskset() -> SortTaskset:
    """A loader function: its taskset's metrics carry the taskset's name, not this function's."""
    return SortTaskset(vf.TasksetConfig())


def test_taskset_by_class_function_and_errors():
    env = make_env("verifiers", taskset=f"{HERE}:SortTaskset", seed=3, label="sorting")
    assert env.name == "sorting" and sorted(env.example(i).prompt for i in range(3)) == ["c a b", "m n k l", "z y"]
    assert make_env("verifiers", taskset=f"{HERE}:load_sort_taskset").name == "SortTaskset"
    with pytest.raises(ValueError, match="cannot import"):
        make_env("verifiers", taskset=f"{HERE}:Nope")
    with pytest.raises(ValueError, match="not a Taskset"):
        make_env("verifiers", taskset=f"{HERE}:HERE")
    with pytest.raises(ValueError, match="not a verifiers Taskset"):
        make_env("verifiers", taskset="builtins:print")


def test_a_raising_reward_fails_the_rollout():
    env = make_env("verifiers", taskset=f"{HERE}:BadTaskset")
    results, _ = play(env, lambda i, turn, ids: "a b", [0, 1])
    assert all(r.failed for r in results.values()) and "judge unreachable" in results[0].error


def test_harness_path_multi_turn_with_a_shell_tool():
    env = make_env("verifiers", taskset=f"{HERE}:FileTaskset", harness="bash")
    assert env.uses_harness(env.task(0))  # auto: the task sets up its runtime
    call = '<tool_call>{"name": "bash", "arguments": {"command": "cp secret.txt answer.txt; echo copied"}}</tool_call>'

    def replies(i, turn, ids):
        return call if turn == 0 and i == 0 else "done"

    results, prompts = play(env, replies, [0, 1])
    good, idle = results[0], results[1]
    assert not good.failed and not idle.failed, (good.error, idle.error)
    assert good.turns == 2 and good.reward.total == 1.0 and good.reward.metrics["turns"] == 2.0
    assert idle.turns == 1 and idle.reward.total == 0.0
    # token in / token out: the second prompt is the first prompt, the sampled call, then the tool's result
    first, second = prompts[0]
    sampled = [t for t, m in zip(good.token_ids, good.mask) if m]
    call_ids = TOK.encode(call, add_special_tokens=False) + [TOK.eos_token_id]
    assert sampled == call_ids + TOK.encode("done", add_special_tokens=False) + [TOK.eos_token_id]
    assert second[:len(first) + len(call_ids)] == first + call_ids
    assert TOK.decode(second[len(first) + len(call_ids):]) == "copied\n\n"  # the tool message, plain-rendered
    assert TOK.decode(first).endswith("copy secret.txt to answer.txt\n")  # after the harness's system prompt
    assert good.prompt_ids == first and good.token_ids[:len(second) - len(first)] == second[len(first):]
    assert good.mask == [True] * len(call_ids) + [False] * (len(second) - len(first) - len(call_ids)) + \
        [True] * (len(good.mask) - (len(second) - len(first)))


def test_a_hanging_harness_rollout_times_out_and_is_stopped():
    env = make_env("verifiers", taskset=f"{HERE}:StuckTaskset", harness="null")
    results, _ = play(env, lambda i, turn, ids: "hello", [0, 1], timeout_s=4)
    assert results[0].failed and results[0].error.startswith("timeout")
    assert not results[1].failed and results[1].reward.total == 0.0
    deadline = time.monotonic() + 30
    while env._host.sessions and time.monotonic() < deadline:  # cancellation cleans up asynchronously
        time.sleep(0.1)
    assert not env._host.sessions  # the stuck rollout was cancelled and cleaned up


def test_tool_call_parsing_and_plain_rendering():
    content, calls = parse_tool_calls('let me look <tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                                      '</tool_call>')
    assert content == "let me look" and calls[0].name == "bash" and json.loads(calls[0].arguments) == {"command": "ls"}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    r = ChatRenderer(TOK)
    assert not r.templated
    text = r.render([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo"}, {"role": "tool", "tool_call_id": "1", "content": "x"}])
    assert text == "sys\nhi\nyo<eos>x\n"


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
            "{{ c.function.name }}</tool_call>{% endfor %}{{ end }}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("end", ["", "<eos>"])
def test_bridging_appends_only_new_tokens(end):
    from meshrl.envs.verifiers_adapter import HarnessEpisode

    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE.replace("{{ end }}", end)
    episode = HarnessEpisode(host=None, task=None, tokenizer=tok, timeout_s=1)
    assert episode.renderer.templated
    first = [{"role": "user", "content": "hi"}]
    ids = episode.bridge(first, None)
    assert tok.decode(ids) == "<|user|>hi" + end + "\n<|assistant|>"
    # the model's reply, sampled with its own spacing: never re-encoded
    episode.completion = tok.encode("ok  then", add_special_tokens=False) + [tok.eos_token_id]
    second = first + [{"role": "assistant", "content": "ok  then"}, {"role": "tool", "tool_call_id": "1", "content": "42"}]
    ids2 = episode.bridge(second, None)
    assert ids2[:len(ids) + len(episode.completion)] == ids + episode.completion
    assert tok.decode(ids2[len(ids) + len(episode.completion):]) == ("\n" if end else "") + "<|tool|>42" + end + \
        "\n<|assistant|>"
    # a harness that rewrites history cannot be continued
    episode.completion = [tok.eos_token_id]
    with pytest.raises(ValueError, match="changed earlier messages"):
        episode.bridge([{"role": "user", "content": "summary"}, *second[1:], {"role": "user", "content": "go"}], None)


def test_taskset_by_installed_package_id(tmp_path, monkeypatch):
    package = tmp_path / "meshrl_demo_taskset"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import verifiers.v1 as vf\n"
        "__all__ = ['DemoTaskset']\n"
        "class DemoConfig(vf.TasksetConfig):\n"
        "    count: int = 2\n"
        "class DemoTaskset(vf.Taskset[vf.Task, DemoConfig]):\n"
        "    def load(self):\n"
        "        for i in range(self.config.count):\n"
        "            yield vf.Task(vf.TaskData(prompt=f'task {i}'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("verifiers", taskset="meshrl-demo-taskset", taskset_args={"count": 3})
    assert env.name == "meshrl-demo-taskset" and [env.example(i).prompt for i in range(4)] == [
        "task 0", "task 1", "task 2", "task 0"]
