"""Running episodes: turns on an inference engine, environment work on worker threads.

`EpisodeDriver` is the state machine of every rollout, single- or multi-turn, shared by the RL
controller (engines on inference ranks) and `meshrl eval` (an engine in the same process). It
does not talk to engines itself: its owner sends each `Generate` it returns to an engine and
hands the finished turn back with `on_completion`; the episode's next move comes back later
as an event that the owner passes to `handle`, which returns the next `Generate` or the
finished `EpisodeResult`.

    start --(worker: make_episode, prompt_ids)--> Generate turn 0 --> engine --> on_completion
      --(worker: episode.step; if done: score)--> Generate turn t+1 (prompt = all tokens so far)
                                               or EpisodeResult (tokens, mask, logprobs, reward)

Token in / token out: the prompt of turn t+1 is the first prompt, every sampled token and
every environment token so far, as ids; nothing is re-tokenised, and the engine's prefix cache
finds the earlier turns' blocks. The result's ``mask`` is True exactly on sampled tokens, and
``logprobs`` holds the engine's logprob there (0 at environment tokens).

Length. Turn 0 must fit: prompt + max_tokens <= max_model_len (a config error otherwise, as
for single-turn runs). A later turn gets max_tokens capped to the room left; with no room the
episode ends, finish_reason "length", and is scored as it stands (the environment tokens that
no longer fit are dropped: nothing follows them, so a rollout never exceeds max_model_len).

Faults. Environment calls (make the episode, step it, score it) run on `num_workers` threads.
A call that raises fails its rollout; a call that runs past ``timeout_s`` fails its rollout
too and its thread is abandoned (a replacement thread keeps the pool at size; a Python thread
cannot be killed, so a truly hung call keeps its thread until it returns). With
``score_memory_mb > 0`` scoring runs in a forked child process (envs/sandbox.py) with that
much address space beyond the parent's and the same time limit, so a reward function that
exhausts memory or hangs is killed. Failed rollouts come back with ``failed=True`` and the
error text; the owner counts them and leaves them out of training.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from meshrl.envs.base import Episode, Example, Reward, as_reward, decode_reply, make_episode, stop_token_ids
from meshrl.envs.sandbox import SandboxLimits, call_in_subprocess

__all__ = ["EnvEvent", "EpisodeDriver", "EpisodeResult", "Generate", "TurnRouter"]


@dataclass
class Generate:
    """Sample the next turn of episode ``key``: ``prompt_ids`` (all tokens so far), at most ``max_tokens``."""

    key: Any
    prompt_ids: list[int]
    max_tokens: int
    turn: int
    stop_token_ids: tuple[int, ...]


@dataclass
class EpisodeResult:
    """A finished rollout. ``token_ids`` follow the first prompt: sampled and environment tokens
    in order; ``mask`` True on sampled ones; ``logprobs`` per token (0 at environment tokens);
    ``versions`` per sampled token."""

    key: Any
    example: Example
    env: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    reward: Reward | None = None
    failed: bool = False
    error: str = ""

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)


@dataclass
class EnvEvent:
    """A worker's answer for episode ``key`` (what: "start", "step", "score"); ``error`` set on failure."""

    key: Any
    what: str
    value: Any = None
    error: str = ""


@dataclass
class _Live:
    result: EpisodeResult
    env: Any
    max_tokens: int
    episode: Episode | None = None


@dataclass
class _Job:
    key: Any
    what: str
    fn: Callable[[], Any]
    timeout_s: float
    started: float = 0.0
    expired: bool = False


class _Workers:
    """A small thread pool whose calls have deadlines; answers are posted as EnvEvents."""

    def __init__(self, num_workers: int, post: Callable[[EnvEvent], None], name: str):
        self.post, self.num_workers, self.name = post, num_workers, name
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.lock = threading.Lock()
        self.running: dict[int, _Job] = {}
        self.threads = 0
        self.ids = itertools.count()
        for _ in range(num_workers):
            self._spawn()
        threading.Thread(target=self._watchdog, daemon=True, name=f"{name}-watchdog").start()

    def submit(self, key: Any, what: str, fn: Callable[[], Any], timeout_s: float) -> None:
        self.jobs.put(_Job(key, what, fn, timeout_s))

    def _spawn(self) -> None:
        with self.lock:
            self.threads += 1
        threading.Thread(target=self._loop, daemon=True, name=f"{self.name}-{self.threads}").start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            job_id = next(self.ids)
            with self.lock:
                job.started = time.monotonic()
                self.running[job_id] = job
            try:
                event = EnvEvent(job.key, job.what, value=job.fn())
            except Exception as e:  # noqa: BLE001 - an environment's fault fails its rollout, reported below
                event = EnvEvent(job.key, job.what, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            with self.lock:
                del self.running[job_id]
                expired = job.expired
                retire = expired and self.threads > self.num_workers
                if retire:
                    self.threads -= 1
            if not expired:
                self.post(event)
            if retire:
                return

    def _watchdog(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            late = []
            with self.lock:
                for job in self.running.values():
                    if not job.expired and now - job.started > job.timeout_s:
                        job.expired = True
                        late.append(job)
            for job in late:
                self.post(EnvEvent(job.key, job.what, error=f"timeout: the environment's {job.what} call ran "
                                                           f"longer than {job.timeout_s:g}s"))
                self._spawn()  # the stuck thread keeps running; keep the pool's capacity


class EpisodeDriver:
    """Drives episodes turn by turn; see the module docstring.

    tokenizer: the policy's tokenizer (eos ends a turn; episodes encode their own text with it).
    max_tokens: tokens per turn; max_model_len: the engine's limit on prompt + completion.
    post: how worker events reach the owner's loop (they come back through `handle`).
    """

    def __init__(self, tokenizer: Any, *, max_tokens: int, max_model_len: int, post: Callable[[EnvEvent], None],
                 num_workers: int = 4, timeout_s: float = 60.0, score_memory_mb: int = 0, name: str = "env"):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.tokenizer = tokenizer
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.timeout_s, self.score_memory_mb = timeout_s, score_memory_mb
        self.stop_token_ids = stop_token_ids(tokenizer)  # eos, and a chat template's end of turn
        self.live: dict[Any, _Live] = {}
        self.workers = _Workers(num_workers, post, name)

    # ------------------------------------------------------------------ owner API

    def start(self, key: Any, env: Any, example: Example, max_tokens: int | None = None) -> None:
        """Begin an episode of ``example``; its first `Generate` comes back through `handle`."""
        if key in self.live:
            raise ValueError(f"episode {key!r} is already live")
        env_key = example.env or getattr(env, "name", "env")
        live = self.live[key] = _Live(EpisodeResult(key, example, env_key, prompt_ids=[]), env,
                                      max_tokens or self.max_tokens)

        def begin() -> tuple[Episode, list[int]]:
            episode = live.episode = make_episode(env, example, self.tokenizer)  # closable if prompt_ids() hangs
            return episode, _token_list(episode.prompt_ids(), "prompt_ids()")

        self.workers.submit(key, "start", begin, self.timeout_s)

    def on_completion(self, key: Any, token_ids: list[int], logprobs: list[float], versions: list[int],
                      finish_reason: str) -> None:
        """A turn of ``key`` finished on the engine; the episode reacts on a worker."""
        live = self.live[key]
        r = live.result
        r.token_ids += token_ids
        r.mask += [True] * len(token_ids)
        r.logprobs += list(logprobs)
        r.versions += list(versions)
        r.turns += 1
        r.finish_reason = finish_reason
        episode = live.episode

        def step():
            turn = episode.step(list(token_ids), finish_reason)
            env_ids = _token_list(turn.env_ids, "Turn.env_ids")
            return turn.done, env_ids, self._score(episode) if turn.done else None

        self.workers.submit(key, "step", step, self.timeout_s)

    def handle(self, event: EnvEvent) -> Generate | EpisodeResult | None:
        """Apply a worker's event; returns what the owner must do next (None: nothing yet)."""
        live = self.live.get(event.key)
        if live is None:
            return None  # an episode already finished (e.g. a late answer after its timeout)
        r = live.result
        if event.error:
            return self._finish(event.key, failed=event.error)
        if event.what == "start":
            live.episode, r.prompt_ids = event.value
            if len(r.prompt_ids) + live.max_tokens > self.max_model_len:
                raise ValueError(
                    f"example {r.example.index} of {r.env} has a {len(r.prompt_ids)}-token prompt: with max_tokens "
                    f"{live.max_tokens} it exceeds inference.max_model_len ({self.max_model_len})")
            return Generate(event.key, list(r.prompt_ids), live.max_tokens, 0, self.stop_token_ids)
        if event.what == "score":
            r.reward = event.value
            return self._finish(event.key)
        done, env_ids, reward = event.value
        if done:
            r.reward = reward
            return self._finish(event.key)
        r.token_ids += env_ids
        r.mask += [False] * len(env_ids)
        r.logprobs += [0.0] * len(env_ids)
        prompt = r.prompt_ids + r.token_ids
        room = self.max_model_len - len(prompt)
        if room < 1:  # no room for another turn: the episode ends here and is scored as it is
            if env_ids:  # nothing was sampled after them: drop them, so the rollout fits max_model_len
                del r.token_ids[-len(env_ids):], r.mask[-len(env_ids):], r.logprobs[-len(env_ids):]
            r.finish_reason = "length"
            episode = live.episode
            self.workers.submit(event.key, "score", lambda: self._score(episode), self.timeout_s)
            return None
        return Generate(event.key, prompt, min(live.max_tokens, room), r.turns, self.stop_token_ids)

    # ------------------------------------------------------------------ internals

    def _score(self, episode: Episode) -> Reward:
        if self.score_memory_mb > 0:
            limits = SandboxLimits(timeout_s=self.timeout_s, memory_mb=self.score_memory_mb)
            return _checked_reward(call_in_subprocess(_score_in_child, episode, limits=limits))
        return _checked_reward(as_reward(episode.score()))

    def _finish(self, key: Any, failed: str = "") -> EpisodeResult:
        live = self.live.pop(key)
        r = live.result
        if failed:
            r.failed, r.error, r.reward = True, failed, None
            if not r.turns:
                r.finish_reason = "error"
            if hasattr(live.episode, "close"):  # e.g. a harness episode stops its agent
                live.episode.close()
        return r


def completion_text(tokenizer: Any, result: EpisodeResult) -> str:
    """An episode's completion as a person reads it (samples/, eval's samples.jsonl): a single turn without
    the stop token it ended on; a multi-turn episode's whole token stream decoded."""
    multi_turn = not all(result.mask)
    return tokenizer.decode(result.token_ids) if multi_turn else decode_reply(tokenizer, result.token_ids)


def _score_in_child(episode: Episode) -> Reward:
    return as_reward(episode.score())


def _checked_reward(reward: Reward) -> Reward:
    """Rewards and metrics as finite floats (a NaN reward would poison the group's advantages)."""
    components = {str(k): float(v) for k, v in reward.components.items()}
    metrics = {str(k): float(v) for k, v in reward.metrics.items()}
    bad = [k for k, v in {**components, **metrics}.items() if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise ValueError(f"non-finite reward or metric values: {bad}")
    return Reward(components, {str(k): float(v) for k, v in reward.weights.items()}, metrics)


def _token_list(ids: Any, what: str) -> list[int]:
    out = [int(t) for t in ids]
    if what == "prompt_ids()" and not out:
        raise ValueError("the episode's prompt_ids() is empty")
    return out


class TurnRouter:
    """The RL controller's side of episodes: each turn to its episode's inference rank, batched.

    ``start`` registers an episode with its rank (a group stays on one replica, so its prefix
    cache serves every turn), sampling temperature and per-turn seed function; the driver's
    `Generate`s are queued per (rank, temperature, max_tokens, stop ids) and ``flush`` sends each
    queue as one request message through ``send(rank, sampling, request_ids, prompts, seeds)``,
    where ``sampling`` holds the queue's SamplingParams fields (runtime/engine/sampling.py) but
    the seed; request ids come from ``new_request_id()``.
    """

    def __init__(self, driver: EpisodeDriver, send: Callable[[int, dict, list[int], list[list[int]], list[int]], None],
                 new_request_id: Callable[[], int], top_p: float = 1.0):
        self.driver, self.send, self.new_request_id, self.top_p = driver, send, new_request_id, top_p
        self.where: dict[int, Any] = {}  # request id -> episode key
        self.routes: dict[Any, tuple[int, float, Callable[[int], int]]] = {}
        self.outbox: dict[tuple, tuple[list[int], list[list[int]], list[int]]] = {}

    def start(self, key: Any, env: Any, example: Example, rank: int, temperature: float,
              seed: Callable[[int], int], max_tokens: int | None = None) -> None:
        self.routes[key] = (rank, temperature, seed)
        self.driver.start(key, env, example, max_tokens)

    def on_completion(self, request_id: int, token_ids: list[int], logprobs: list[float], versions: list[int],
                      finish_reason: str) -> Any:
        """Hand a finished turn to its episode; returns the episode's key."""
        key = self.where.pop(request_id)
        self.driver.on_completion(key, token_ids, logprobs, versions, finish_reason)
        return key

    def handle(self, event: EnvEvent) -> EpisodeResult | None:
        """Apply a worker event: queue the next turn, or return the finished episode."""
        action = self.driver.handle(event)
        if isinstance(action, Generate):
            rank, temperature, seed = self.routes[action.key]
            rid = self.new_request_id()
            self.where[rid] = action.key
            ids, prompts, seeds = self.outbox.setdefault(
                (rank, temperature, action.max_tokens, action.stop_token_ids), ([], [], []))
            ids.append(rid)
            prompts.append(action.prompt_ids)
            seeds.append(seed(action.turn))
            return None
        if isinstance(action, EpisodeResult):
            self.routes.pop(action.key, None)
        return action

    def flush(self) -> None:
        """Send every queued turn, one message per (rank, sampling) queue."""
        for (rank, temperature, max_tokens, stop_ids), (ids, prompts, seeds) in self.outbox.items():
            sampling = {"temperature": temperature, "top_p": self.top_p if temperature > 0 else 1.0,
                        "max_tokens": max_tokens, "stop_token_ids": list(stop_ids)}
            self.send(rank, sampling, ids, prompts, seeds)
        self.outbox.clear()
