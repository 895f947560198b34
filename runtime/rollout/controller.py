"""The controller: the one CPU rank that runs the RL loop's bookkeeping.

    dataset cursor --> prompts --(generate)--> inference ranks --(completions)--+
                                                                                |
    metrics.jsonl <-- report <-- trainer ranks <--(packed micro-batches)-- score, advantages,
                                    |                                   filter, pack per dp rank
                                    +--(weights ready v)--> controller --(load_weights v)--> inference

Asynchrony and staleness. Step s trains on the prompts dispatched "for step s". The
controller dispatches step s only once the inference ranks have been told to load weights of
version >= s - max_off_policy_steps, and messages to an inference rank are handled in order,
so every token of a step-s rollout comes from a policy at most max_off_policy_steps old
(weights may still change mid-rollout, which only makes it fresher). With 0 the loop is
synchronous on-policy; with k > 0, inference generates up to k steps ahead while the trainer
trains. Each rollout carries the version of every token; policy_lag = s - oldest version.

Overlapped training (trainer.overlap_rollout, runtime/rollout/feed.py). While step s's rollouts are
still generating, its finished groups already go to the trainer as TRAIN parts (forward + backward,
gradients accumulating); the last part, once every rollout is scored, carries the step's loss
normaliser and the trainer takes the one optimizer step. The weights stay those of the policy
the rollouts came from, so the step is the one without overlap.

Episodes (runtime/rollout/episodes.py). Every rollout is an episode: environment work (the prompt, each
multi-turn step with its tools, scoring) runs on worker threads whose answers arrive on the same
queue as "episode" messages; each turn is a request to the group's inference rank whose prompt is
all earlier tokens (token in / token out). A failing, hanging or memory-exceeding environment
fails only its rollout (rollouts/failed). With eval.every, evaluations run between training
rollouts on the inference ranks (runtime/rollout/evals.py: OnlineEval).

Tensor-parallel replicas (inference.tensor_parallel > 1). A replica of N inference ranks is one
engine: groups are load-balanced over replicas (`roles.engines`, each replica's first rank, is
the rank a group is routed to), every message for a replica goes to each of its ranks in the
same order (runtime/engine/loop.py keeps them in lockstep), and completions come from the first
rank only. `load_weights` and `stop` go to every inference rank, and each one answers `done`.

All receives run on Inbox threads; the loop below waits on one queue, so it sleeps while
nothing happens, and a dead or silent peer surfaces as an error within dist.timeout_s.

Checkpoints (runtime/checkpoint.py). After the report of step s, every checkpoint.every steps,
the controller writes its state for continuing at step N = s + 1 into checkpoints/step_N.tmp/
and sends `checkpoint N` to the trainers, ahead of step N's batch; the trainer leader completes
the folder. The state is the cursor at which step N's prompts were taken, so rollouts already
in flight for steps >= N are not saved: a resumed run dispatches them again, with the same
prompts and seeds.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from meshrl.envs import make_env
from meshrl.envs.base import Environment, Example
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime import protocol, transport
from meshrl.runtime.train.losses import DROP_REASONS, filter_reason, group_advantages, length_penalized
from meshrl.runtime.config import AdvantageConfig, RLConfig
from meshrl.runtime.rollout.episodes import EnvEvent, EpisodeDriver, EpisodeResult, TurnRouter, completion_text
from meshrl.runtime.rollout.disagg import DisaggRouter
from meshrl.runtime.rollout.evals import OnlineEval
from meshrl.runtime.layout import Layout
from meshrl.runtime.train import shared_prompt
from meshrl.runtime.train.packing import Sample
from meshrl.runtime.rollout.feed import StepParts, TrainFeed
from meshrl.runtime.rundir import MetricsWriter, ProgressLine, TrainingWatch, log, note_activity
from meshrl.runtime.protocol import HEARTBEAT_S, Kind
from meshrl.runtime.transport import Message


@dataclass
class Rollout:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    failed: bool = False
    mask: list[bool] | None = None  # multi-turn: True on sampled tokens, False on environment tokens
    prompt_ids: list[int] | None = None  # the episode's first prompt (else the group's)
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    env: str = ""
    error: str = ""


@dataclass
class Group:
    example: Example
    prompt_ids: list[int]
    rollouts: list[Rollout | None]


@dataclass
class StepState:
    groups: list[Group]
    dispatched_at: float
    pending: int
    completion_tokens: int = 0
    failed: int = 0
    sampled_tokens: int = 0      # tokens the policy sampled for this step's rollouts
    done_at: float | None = None  # when its last rollout finished
    parts: StepParts = field(default_factory=StepParts)  # what the trainer already has (trainer.overlap_rollout)

    def finished_groups(self) -> list[int]:
        """Groups whose every rollout is in and that no part has trained yet."""
        return [g for g, group in enumerate(self.groups)
                if g not in self.parts.sent and all(r is not None for r in group.rollouts)]


@dataclass
class Clock:
    """Counters of the step clock."""

    dispatched: int = 0          # steps whose prompts went out
    trained: int = 0             # steps whose report came back
    training: bool = False       # a step's last batch is with the trainer
    weights_version: int = 0     # newest version the inference ranks were told to load
    last_report_at: float = field(default_factory=time.perf_counter)


def _sampled_tokens(r: Rollout) -> int:
    """Tokens the policy sampled in a rollout (a multi-turn rollout's environment tokens excluded)."""
    return sum(r.mask) if r.mask is not None else len(r.token_ids)


def _generating(where: dict, step: int) -> bool:
    """Some turn of training step `step` is queued for or on an engine, so its rollouts are not all
    generated. Once they are, only scoring remains (milliseconds): a part sent then would hold the
    step's last part back until it is trained, and the step would wait for it (trl_compare: ~0.25 s a
    step, docs/benchmarks.md 2026-12-02), so overlap trains parts only while generation goes on."""
    return any(key[0] == "train" and key[1] == step for key in where.values())


def group_samples(group: Group, ok: list[Rollout], cfg: AdvantageConfig,
                  max_tokens: int) -> tuple[list[Sample], str | None, int]:
    """One group's training samples from its rollouts that did not fail (``ok``), why the group was
    dropped (None: kept; losses.filter_reason), and how many samples overlong filtering masked."""
    raw = torch.tensor([r.reward for r in ok], dtype=torch.float32)  # (G,)
    shaped = raw
    if cfg.length_penalty > 0 and ok:
        shaped = length_penalized(raw, torch.tensor([_sampled_tokens(r) for r in ok]), cfg.length_penalty, max_tokens)
    reason = filter_reason(raw, shaped=shaped, pass_threshold=cfg.pass_threshold, min_pass_rate=cfg.min_pass_rate,
                           max_pass_rate=cfg.max_pass_rate)
    if reason is not None:
        return [], reason, 0
    advantages = group_advantages(shaped[None], cfg.type)[0]  # (G,)
    samples, masked = [], 0
    for r, a in zip(ok, advantages.tolist()):
        if cfg.mask_truncated and r.finish_reason == "length":  # its reward stays in the baseline
            masked += 1
            continue
        samples.append(Sample(r.prompt_ids or group.prompt_ids, r.token_ids, r.logprobs, a, r.mask))
    return samples, None, masked


def env_stats(state: StepState, default_name: str) -> dict[str, float]:
    """env/<name>/reward, env/<name>/<component or metric> (means), env/<name>/failed, per environment."""
    by_env: dict[str, list[Rollout]] = {}
    for group in state.groups:
        for r in group.rollouts:
            if r is not None:
                by_env.setdefault(r.env or default_name, []).append(r)
    out: dict[str, float] = {}
    for name, rollouts in sorted(by_env.items()):
        ok = [r for r in rollouts if not r.failed]
        out[f"env/{name}/reward"] = statistics.fmean(r.reward for r in ok) if ok else 0.0
        out[f"env/{name}/failed"] = len(rollouts) - len(ok)
        values: dict[str, list[float]] = {}
        for r in ok:
            for key, value in {**r.components, **r.metrics}.items():
                values.setdefault(key, []).append(value)
        for key, vals in sorted(values.items()):
            out.setdefault(f"env/{name}/{key}", statistics.fmean(vals))
    return out


class Controller:
    """Owns the dataset cursor, the environment, the buffer of rollouts and the step clock."""

    def __init__(self, cfg: RLConfig, layout: Layout, env: Environment, tokenizer, run_dir: Path,
                 metrics: MetricsWriter | None = None):
        self.cfg = cfg
        self.layout = layout
        self.env = env
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.run_dir = run_dir
        self.metrics = metrics if metrics is not None else MetricsWriter(run_dir)
        self.clock = Clock()
        self.share_prompts = shared_prompt.enabled(cfg.model, cfg.trainer)
        self.feed = TrainFeed(cfg, layout, tokenizer.pad_token_id or 0, self.share_prompts)
        self.cursor = 0
        self._cursor_at: dict[int, int] = {}  # step -> cursor before its prompts (for checkpoints)
        self._previous_done_at = 0.0  # when the last step built had all its rollouts (tokens/rollout_per_s)
        self.steps: dict[int, StepState] = {}
        self.where: dict[int, tuple[int, int, int]] = {}  # request id -> (step, group, sample)
        self.next_request_id = 0
        self.inbox = transport.Inbox()
        self.progress = ProgressLine(cfg.max_steps, cfg.log.console, "rl")
        self.final: dict[str, float] = {}
        self.failed_saves = 0  # checkpoints whose controller state could not be written (checkpoint.on_error)
        self.watch = TrainingWatch(cfg.checkpoint.every or 10)  # stops a run that is not training
        self._pending_stats: dict[str, float] = {}  # rollout statistics of the step being trained
        self._sleep_pending: set[int] | None = None  # inference ranks asked to sleep that have not answered
        # Episodes (runtime/rollout/episodes.py): environment work on worker threads whose answers arrive
        # on the inbox as "episode" messages; every turn goes to its group's inference rank.
        ep = cfg.episodes
        self.driver = EpisodeDriver(tokenizer, max_tokens=cfg.inference.sampling.max_tokens,
                                    max_model_len=cfg.inference.max_model_len, num_workers=ep.workers,
                                    timeout_s=ep.timeout_s, score_memory_mb=ep.score_memory_mb,
                                    post=lambda event: self.inbox.queue.put(protocol.episode(event)))
        self.turns = TurnRouter(self.driver, self._send_requests, self._new_request_id, cfg.inference.sampling.top_p)
        self.where = self.turns.where  # request id -> episode key
        # inference.prefill_ranks > 0: prefill and decode pools (runtime/rollout/disagg.py)
        self.pd = (DisaggRouter(layout, self.where, cfg.inference.prefill_backlog)
                   if layout is not None and layout.roles.prefill_replicas else None)
        eval_env = make_env(cfg.eval.env.name, **cfg.eval.env.kwargs()) if cfg.eval.env is not None else env
        self.evals = (OnlineEval(cfg.eval, eval_env, cfg.max_steps, cfg.seed, tokenizer, run_dir)
                      if cfg.eval.every else None)

    # ------------------------------------------------------------------ loop

    def run(self) -> dict[str, float]:
        roles = self.layout.roles
        self.inbox.listen(roles.trainers[0], self.layout.up[roles.trainers[0]], "trainer")
        for r in roles.inference:
            self.inbox.listen(r, self.layout.up[r], f"inference-{r}")
        waited = 0.0
        while self.clock.trained < self.cfg.max_steps or (self.evals is not None and self.evals.busy):
            self._dispatch()
            self._maybe_train()
            self.turns.flush()
            note_activity(f"waiting for messages (trained {self.clock.trained}, dispatched {self.clock.dispatched})")
            msg = self.inbox.get(timeout=HEARTBEAT_S)
            if msg is None:
                waited += HEARTBEAT_S
                log.warning("heartbeat: waiting %.0fs; trained %d, dispatched %d, training=%s, part out=%s, "
                            "in flight %d", waited, self.clock.trained, self.clock.dispatched, self.clock.training,
                            self.feed.part_out, len(self.where))
                continue
            waited = 0.0
            self._handle(msg)
            for more in self.inbox.drain():  # together: the turns they start go out in one message per rank
                self._handle(more)
        self._shutdown()
        if self.pd is not None:
            log.info("P/D: %d first turns went through prefill replicas, %d were prefilled by their decode replica "
                     "(prefill backlog >= %d tokens)", self.pd.num_first_turns["prefill"],
                     self.pd.num_first_turns["decode"], self.pd.backlog_tokens)
        self.progress.close()
        self.metrics.close()
        return self.final

    def _handle(self, msg: Message) -> None:
        if msg.kind == Kind.COMPLETIONS:
            self._on_completions(msg)
        elif msg.kind == Kind.WEIGHTS:
            self.clock.weights_version = msg.meta["version"]
            for r in self.layout.roles.inference:  # every rank of a replica joins the weight broadcast
                transport.send(protocol.load_weights(msg.meta["version"]), r, self.layout.down[r])
            if self.evals is not None and self.evals.due(msg.meta["version"]):  # after the load: evaluates v
                self.evals.start(msg.meta["version"], self.turns, list(self.layout.roles.decode_engines))
        elif msg.kind == Kind.EPISODE:
            self._on_episode(msg.meta["event"])
        elif msg.kind == Kind.PREFILLED:
            self.pd.on_prefilled(msg)
        elif msg.kind == Kind.ASLEEP:
            self._sleep_pending.discard(msg.src)
        elif msg.kind == Kind.REPORT:
            self._on_report(msg.meta)
        elif msg.kind == Kind.PART_TRAINED:
            self.feed.on_part_trained(msg.meta["step"], self.clock.trained)
        else:
            raise RuntimeError(f"controller got an unexpected message {msg.kind!r} from rank {msg.src}")

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        """Send the prompts of every step the staleness bound allows."""
        k = self.cfg.max_off_policy_steps
        while (self.clock.dispatched < self.cfg.max_steps
               and self.clock.dispatched - self.clock.weights_version <= k):
            self._dispatch_step(self.clock.dispatched)
            self.clock.dispatched += 1

    def _dispatch_step(self, step: int) -> None:
        """Start the episodes of step ``step``; their first turns go out once their prompts are ready."""
        cfg = self.cfg
        engines = self.layout.roles.engines  # one per replica
        groups = []
        self._cursor_at[step] = self.cursor
        for g in range(cfg.prompts_per_step):
            example = self.env.example(self.cursor)
            self.cursor += 1
            groups.append(Group(example, [], [None] * cfg.samples_per_prompt))
            keys = [("train", step, g, j) for j in range(cfg.samples_per_prompt)]  # a group stays on one replica
            rank = engines[(step * cfg.prompts_per_step + g) % len(engines)] if self.pd is None else self.pd.home(keys)
            for j in range(cfg.samples_per_prompt):
                self.turns.start(("train", step, g, j), self.env, example, rank, cfg.inference.sampling.temperature,
                                 partial(self._turn_seed, step, g, j))
        self.steps[step] = StepState(groups, time.perf_counter(), pending=cfg.prompts_per_step * cfg.samples_per_prompt)
        log.info("dispatched step %d (%d prompts x %d samples) with weights v%d",
                 step, cfg.prompts_per_step, cfg.samples_per_prompt, self.clock.weights_version)

    def _turn_seed(self, step: int, g: int, j: int, turn: int) -> int:
        """Sampling seed of one turn (the first turn's is that of a single-turn rollout)."""
        tag = f"{self.cfg.seed}:{step}:{g}:{j}" + (f":{turn}" if turn else "")
        return random.Random(tag).getrandbits(62)

    def _new_request_id(self) -> int:
        rid = self.next_request_id
        self.next_request_id += 1
        return rid

    def _send_requests(self, rank: int, sampling: dict, ids: list[int], prompts: list[list[int]],
                       seeds: list[int]) -> None:
        """Requests for the replica whose first rank is `rank`: the same message to each of its ranks."""
        if self.pd is not None:  # first turns through a prefill replica, later ones to `rank`
            return self.pd.send(rank, sampling, ids, prompts, seeds)
        msg = protocol.generate(ids, prompts, seeds, sampling)
        for r in self.layout.roles.replica_of(rank):
            transport.send(msg, r, self.layout.down[r])

    # ------------------------------------------------------------------ scoring

    def _on_completions(self, msg: Message) -> None:
        turns = protocol.read_completions(msg)
        if self.pd is not None:
            self.pd.on_completions([t.request_id for t in turns])
        for turn in turns:
            self.turns.on_completion(turn.request_id, turn.token_ids, turn.logprobs, turn.versions,
                                     turn.finish_reason)

    def _on_episode(self, event: EnvEvent) -> None:
        """An environment call finished: the episode's next turn is queued, or the episode is over."""
        result = self.turns.handle(event)
        if result is None:
            return
        if self.pd is not None:
            self.pd.episode_done(result.key)
        if result.key[0] == "eval":
            for row in self.evals.add(result):
                self.metrics.write(row)
            return
        _, step, g, j = result.key
        state = self.steps[step]
        group = state.groups[g]
        rollout = self._rollout(result)
        if not group.prompt_ids:
            group.prompt_ids = result.prompt_ids
        group.rollouts[j] = rollout
        state.pending -= 1
        state.completion_tokens += len(rollout.token_ids)
        state.sampled_tokens += _sampled_tokens(rollout)
        if state.pending == 0:
            state.done_at = time.perf_counter()
        state.failed += rollout.failed
        if rollout.failed:
            log.error("rollout of %s example %d failed and is excluded: %s", result.env, result.example.index,
                      result.error)

    def _rollout(self, result: EpisodeResult) -> Rollout:
        multi_turn = not all(result.mask)
        text = completion_text(self.tokenizer, result)
        reward = result.reward
        return Rollout(result.token_ids, result.logprobs, result.versions, result.finish_reason, text=text,
                       reward=reward.total if reward is not None else 0.0, failed=result.failed,
                       mask=result.mask if multi_turn else None, prompt_ids=result.prompt_ids,
                       components=dict(reward.components) if reward is not None else {},
                       metrics=dict(reward.metrics) if reward is not None else {}, env=result.env,
                       error=result.error)

    # ------------------------------------------------------------------ training

    def _maybe_train(self) -> None:
        step = self.clock.trained
        if self.clock.training or self.feed.part_out or step not in self.steps:
            return
        state = self.steps[step]
        if state.pending:  # trainer.overlap_rollout: train the groups that have finished (runtime/rollout/feed.py)
            ready = state.finished_groups() if self.feed.overlap and _generating(self.where, step) else []
            if ready:
                kept = [s for g in ready for s in self._group_kept(state.groups[g])]
                self.feed.send_part(step, state.parts, ready, kept)
            return
        if not self._engines_asleep():
            return
        per_group, stats = self._build_samples(step)
        samples = [s for group in per_group for s in group]
        rest = [s for g, group in enumerate(per_group) if g not in state.parts.sent for s in group]
        stats.update(self.feed.send_last(step, state.parts, samples, rest))
        self.clock.training = True
        self._pending_stats = stats
        self._sleep_pending = None

    def _engines_asleep(self) -> bool:
        """inference.sleep_while_training: ask every inference rank to free its KV cache before the
        trainer steps (once per step) and say True when all have answered ASLEEP. Without it, or
        while an online evaluation keeps the engines busy, True at once."""
        if not self.cfg.inference.sleep_while_training or (self.evals is not None and self.evals.busy):
            return True
        if self._sleep_pending is None:
            self._sleep_pending = set(self.layout.roles.inference)
            for r in self._sleep_pending:
                transport.send(protocol.sleep(), r, self.layout.down[r])
        return not self._sleep_pending

    def _group_kept(self, group: Group) -> list[Sample]:
        """A finished group's training samples (what `_build_samples` keeps of it)."""
        ok = [r for r in group.rollouts if r is not None and not r.failed]
        return group_samples(group, ok, self.cfg.advantage, self.cfg.inference.sampling.max_tokens)[0]

    def _build_samples(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Advantages per group, the group and sample filters (`advantage`), and rollout statistics:
        the training samples of each group, in group order."""
        state = self.steps[step]
        per_group: list[list[Sample]] = []
        rewards, lags, lengths = [], [], []
        dropped = dict.fromkeys(DROP_REASONS, 0)
        masked_truncated = 0
        for group in state.groups:
            ok = [r for r in group.rollouts if r is not None and not r.failed]
            rewards += [r.reward for r in ok]
            lags += [step - min(r.versions) for r in ok if r.versions]
            lengths += [_sampled_tokens(r) for r in ok]
            kept, reason, masked = group_samples(group, ok, self.cfg.advantage, self.cfg.inference.sampling.max_tokens)
            per_group.append(kept)
            masked_truncated += masked
            if reason is not None:
                dropped[reason] += 1
        truncated = sum(r.finish_reason == "length" for g in state.groups for r in g.rollouts if r is not None)
        total = len(state.groups) * self.cfg.samples_per_prompt
        stats = {
            "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward/std": statistics.pstdev(rewards) if rewards else 0.0,
            "policy_lag/mean": statistics.fmean(lags) if lags else 0.0,
            "policy_lag/max": max(lags) if lags else 0,
            "batch/groups_filtered": sum(dropped.values()),
            **{f"batch/groups_dropped_{reason}": count for reason, count in dropped.items()},
            "batch/samples_trained": sum(len(kept) for kept in per_group),
            "batch/samples_masked_truncated": masked_truncated,
            "rollouts/failed": state.failed,
            "rollouts/truncated_fraction": truncated / total,
            "rollouts/completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
            "time/rollout_s": (state.done_at or time.perf_counter()) - state.dispatched_at,  # to its last rollout
            "tokens/rollout_per_s": self._rollout_rate(state),
            **env_stats(state, getattr(self.env, "name", "env")),
        }
        self._write_samples(step, state)
        return per_group, stats

    def _rollout_rate(self, state: StepState) -> float:
        """Sampled tokens per second of this step's rollouts, over the time the engines worked on them:
        from its dispatch, or from when the previous step's rollouts were done if that was later (the
        engines were busy with those), to its last rollout. Every step has its own, the last one too."""
        done = state.done_at if state.done_at is not None else time.perf_counter()
        began = max(state.dispatched_at, self._previous_done_at)
        if began >= done:  # finished before the previous step's rollouts: it had the engines alongside them
            began = state.dispatched_at
        self._previous_done_at = done
        return state.sampled_tokens / max(done - began, 1e-9)

    def _write_samples(self, step: int, state: StepState) -> None:
        rows = []
        for group in state.groups:
            for r in group.rollouts:
                if r is None or len(rows) >= self.cfg.log.samples_per_step:
                    continue
                rows.append({"step": step, "prompt": group.example.prompt, "answer": group.example.answer,
                             "completion": r.text, "reward": r.reward, "finish_reason": r.finish_reason,
                             "versions": sorted(set(r.versions)), "failed": r.failed, "env": r.env,
                             "components": r.components, "metrics": r.metrics,
                             "error": r.error.splitlines()[0] if r.error else ""})
        self.metrics.samples(step, rows)

    def _on_report(self, meta: dict) -> None:
        step = meta["step"]
        assert step == self.clock.trained, f"trainer reported step {step}, expected {self.clock.trained}"
        now = time.perf_counter()
        elapsed = now - self.clock.last_report_at
        trainer = meta["stats"]
        metrics = {"step": step, **self._pending_stats,
                   **{k: trainer[k] for k in ("loss", "pg_loss", "kl_loss", "mismatch_kl", "entropy",
                                              "masked_fraction", "grad_norm", "lr")},
                   "tokens/train_per_s": trainer["train_tokens"] / max(trainer["train_time_s"], 1e-9),
                   "time/step_s": elapsed,
                   "time/train_s": trainer["train_time_s"],
                   "time/train_tail_s": trainer["train_tail_s"],
                   "time/weight_sync_s": meta["weight_sync_s"],
                   "weights/version": meta["version"],
                   "train/nonfinite_steps": trainer.get("nonfinite_steps", 0),
                   "checkpoint/failed_saves": self.failed_saves + trainer.get("failed_saves", 0),
                   # loss/ (clipped and corrected shares), MoE balance, GPU memory
                   **{k: v for k, v in trainer.items() if k.startswith(("loss/", "moe/", "memory/"))}}
        for row in (self.evals.hold(metrics) if self.evals is not None else [metrics]):
            self.metrics.write(row)  # a row waits while the evaluation of its weights runs (runtime/rollout/evals.py)
        self.watch.step(step, trainer["grad_norm"], self.cfg.prompts_per_step * self.cfg.samples_per_prompt,
                        self._pending_stats["rollouts/failed"])
        del self.steps[step]
        self.clock.trained += 1
        self.clock.training = False
        self.clock.last_report_at = now
        self.final = metrics
        self.progress.update(step, (
            f"reward {metrics['reward/mean']:.3f}  lag {metrics['policy_lag/max']}  "
            f"rollout {metrics['tokens/rollout_per_s']:.0f} tok/s  train {metrics['tokens/train_per_s']:.0f} tok/s"))
        log.info("step %d: %s", step, {k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()})
        self._cursor_at.pop(step, None)
        self._maybe_checkpoint()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What a run needs to continue at step N = clock.trained (called right after a report)."""
        n = self.clock.trained
        version, internal, gauss = random.getstate()
        return {"step": n, "cursor": self._cursor_at.get(n, self.cursor), "next_request_id": self.next_request_id,
                "python_random": [version, list(internal), gauss], "torch_rng": torch.get_rng_state().tolist(),
                "env": self.env.state_dict() if hasattr(self.env, "state_dict") else None,
                # rows waiting for an online evaluation: a resumed run writes them without it
                "held_rows": list(self.evals.held) if self.evals is not None else []}

    def load_state_dict(self, state: dict) -> None:
        """Continue at step state["step"]: its prompts come next; the engines hold weights of that version."""
        n = state["step"]
        self.clock.trained = self.clock.dispatched = self.clock.weights_version = n
        self.cursor = state["cursor"]
        self.next_request_id = state["next_request_id"]
        version, internal, gauss = state["python_random"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if state.get("env") is not None:
            self.env.load_state_dict(state["env"])
        for row in state.get("held_rows", []):
            if row["step"] not in self.metrics.steps:
                log.warning("step %d: its online evaluation was interrupted; writing its row without it", row["step"])
                self.metrics.write(row)

    def _maybe_checkpoint(self) -> None:
        """Every checkpoint.every steps and at the end: write this state, tell the trainers to save theirs."""
        c, n = self.cfg.checkpoint, self.clock.trained
        save = c.every > 0 and (n % c.every == 0 or n == self.cfg.max_steps)
        export = c.export_every > 0 and n % c.export_every == 0 and n < self.cfg.max_steps
        if not (save or export):
            return
        root = ckpt.checkpoints_dir(self.run_dir)
        path = None
        if save:  # a full disk: None (warned, counted), or CheckpointError under checkpoint.on_error = "fail"
            tmp = ckpt.begin_save(root, n, {ckpt.CONTROLLER_FILE: self.state_dict()}, c.on_error)
            path = str(tmp) if tmp is not None else None
            self.failed_saves += tmp is None
        if path is not None or export:
            msg = protocol.checkpoint(n, path, str(root / f"hf_step_{n}") if export else None)
            for r in self.layout.roles.trainers:
                transport.send(msg, r, self.layout.down[r])

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        """Stop every rank and wait for their last messages (the trainer's after its checkpoint)."""
        roles = self.layout.roles
        for r in (*roles.inference, *roles.trainers):
            transport.send(protocol.stop(), r, self.layout.down[r])
        waiting = {roles.trainers[0], *roles.inference}
        while waiting:
            msg = self.inbox.get(timeout=self.cfg.dist.timeout_s)
            if msg is None:
                raise TimeoutError(f"ranks {sorted(waiting)} did not finish within {self.cfg.dist.timeout_s}s")
            if msg.kind == Kind.DONE:
                waiting.discard(msg.src)
            elif msg.kind in (Kind.COMPLETIONS, Kind.WEIGHTS, Kind.EPISODE, Kind.PREFILLED):
                # late messages of the last step; nothing left to train on (a handoff relayed now
                # would make send_kv / recv_kv wait on ranks that were told to stop)
                continue
            else:
                self._handle(msg)
