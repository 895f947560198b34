"""The messages of an RL job: every kind, who sends it to whom, and its codec, in one place.

The wire format (a JSON header plus one flat TensorDict payload, never pickle) is
runtime/transport.py's; this module says what travels in it. Each kind has one function that
builds the message and, where the payload is more than a few numbers, one that reads it back.

    controller -> inference   GENERATE      requests of one sampling setting: ids, prompts, seeds
                              LOAD_WEIGHTS  join the next weight broadcast; meta: version
                              ABORT         end these requests now (meta request_ids); their
                                            samples come back as COMPLETIONS with finish "abort"
    controller -> trainers    TRAIN         packed micro-batches of a step for this data rank: all of
                                            them, or (trainer.overlap_rollout) a part; the last part
                                            carries the step's loss-token count and ends the step
                              CHECKPOINT    save (path) and/or export an HF folder (export)
    controller -> every rank  STOP          finish (trainers: final checkpoint and export first)
    inference  -> controller  COMPLETIONS   finished turns: tokens, logprobs, versions, finish
    trainer 0  -> controller  WEIGHTS       version v is ready: tell inference to join the broadcast
                              REPORT        the step's training statistics and weight-sync time
                              PART_TRAINED  a step's non-last TRAIN part is trained: send the next
    any rank   -> controller  DONE          the rank's last message
    controller -> itself      EPISODE       an environment call finished (never on the wire)

Colocated layout only (runtime/weight_sync.py: `ColocatedSender`, `ColocatedReceiver`):

    controller -> inference   SLEEP         free the KV cache while the trainer steps (sync mode)
    inference  -> controller  ASLEEP        done: the trainer may use that memory
    trainer k  -> engine k    STAGING       once: where the shared weight buffer is (then raw
                                            int64 "version v is written" / "v is copied" signals
                                            on the pair's own groups)

Prefill/decode disaggregation only (inference.prefill_ranks; runtime/engine/disagg.py):

    prefill    -> controller  PREFILLED     sequences whose prompt is computed, bound for a decode
                                            replica: everything but their KV blocks
    controller -> prefill     SEND_KV       send handoff h's blocks that the decode replica asks for
                                            (its mask comes first, on the kv group)
    controller -> decode      RECV_KV       the PREFILLED data; receive its blocks from meta src
                                            (meta drop: request ids aborted while in flight)
    (GENERATE to a prefill replica carries meta `decode`: the decode rank of its requests)

Why WEIGHTS comes before the broadcast: the inference ranks must be told to join it, and only
the controller talks to them (runtime/rollout/controller.py). Weights themselves never travel
as messages: runtime/weight_sync.py broadcasts them on the sync group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterable

import torch
from tensordict import TensorDict

from meshrl.runtime.transport import Message

HEARTBEAT_S = 30.0
"""How long a rank's loop waits on its inbox before it logs a heartbeat line and waits again."""


class Kind(StrEnum):
    """Message kinds (strings on the wire: the JSON header carries them as they are)."""

    GENERATE = "generate"
    LOAD_WEIGHTS = "load_weights"
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    STOP = "stop"
    COMPLETIONS = "completions"
    WEIGHTS = "weights"
    REPORT = "report"
    DONE = "done"
    EPISODE = "episode"
    SLEEP = "sleep"
    ASLEEP = "asleep"
    STAGING = "staging"
    PREFILLED = "prefilled"
    SEND_KV = "send_kv"
    RECV_KV = "recv_kv"
    ABORT = "abort"
    PART_TRAINED = "part_trained"


FINISH_CODES = {"stop": 0, "length": 1, "abort": 2}
"""Finish reasons as integers in a COMPLETIONS payload."""
_FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}


# ---------------------------------------------------------------- controller -> inference


def generate(request_ids: list[int], prompts: list[list[int]], seeds: list[int], sampling: dict[str, Any],
             decode: int | None = None) -> Message:
    """Requests that share one sampling setting. `sampling`: SamplingParams fields as plain values
    (runtime/engine/sampling.py), everything but the per-request seed; ragged prompts travel as one
    flat tensor plus lengths. `decode`: to a prefill replica, the decode rank its requests continue on."""
    meta: dict[str, Any] = {"sampling": sampling} if decode is None else {"sampling": sampling, "decode": decode}
    return Message(Kind.GENERATE, meta, TensorDict({
        "request_id": torch.tensor(request_ids, dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "prompt_ids": torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        "seed": torch.tensor(seeds, dtype=torch.int64),
    }, batch_size=[]))


@dataclass
class RequestRecord:
    """One request of a GENERATE message: what the engine's `Request` is built from."""

    request_id: int
    prompt_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams keyword arguments, seed included


def read_generate(msg: Message) -> list[RequestRecord]:
    assert msg.kind == Kind.GENERATE, msg.kind
    td, sampling = msg.data, msg.meta["sampling"]
    flat = td["prompt_ids"].tolist()
    out, offset = [], 0
    for rid, n, seed in zip(td["request_id"].tolist(), td["prompt_lens"].tolist(), td["seed"].tolist()):
        out.append(RequestRecord(rid, flat[offset:offset + n], {**sampling, "seed": seed}))
        offset += n
    return out


def send_kv(handoff: int) -> Message:
    """Controller -> prefill replica: send handoff `handoff`'s KV blocks to its decode replica now."""
    return Message(Kind.SEND_KV, {"handoff": handoff})


def recv_kv(prefilled: Message, drop: Iterable[int] = ()) -> Message:
    """Controller -> decode replica: a PREFILLED message relayed as it is, with its sender in meta `src`
    and in meta `drop` the ids of its requests that were aborted meanwhile (not taken, blocks not sent)."""
    return Message(Kind.RECV_KV, {**prefilled.meta, "src": prefilled.src, "drop": sorted(drop)}, prefilled.data)


def abort(request_ids: Iterable[int]) -> Message:
    """Controller -> inference rank: end these requests (those it holds; any others are ignored)."""
    return Message(Kind.ABORT, {"request_ids": list(request_ids)})


def load_weights(version: int) -> Message:
    return Message(Kind.LOAD_WEIGHTS, {"version": version})


# ---------------------------------------------------------------- controller -> trainers


def train(step: int, num_loss_tokens: int | None, micro_batches: list[TensorDict], scale: int | None = None,
          last: bool = True) -> Message:
    """Micro-batches of a step for one data rank. `scale` is what their losses divide by (default:
    `num_loss_tokens`); `last` ends the step with its optimizer step, and only the last part carries
    `num_loss_tokens`, the loss-token count of the whole step (every rank and part), to which the
    trainer rescales the gradients (runtime/train/trainer.py: `accumulate_rl`). A step sent in one
    message is one last part with scale = num_loss_tokens (runtime/train/losses.py)."""
    assert last == (num_loss_tokens is not None), "only the last part of a step carries num_loss_tokens"
    if scale is None:
        assert num_loss_tokens is not None
        scale = max(num_loss_tokens, 1)
    data = TensorDict({str(i): mb for i, mb in enumerate(micro_batches)}, batch_size=[])
    return Message(Kind.TRAIN, {"step": step, "num_loss_tokens": num_loss_tokens, "scale": scale, "last": last,
                                "num_micro_batches": len(micro_batches)}, data)


@dataclass
class TrainPart:
    """A TRAIN message read back."""

    step: int
    num_loss_tokens: int | None  # the step's, on its last part only
    scale: int                   # the losses' normaliser for these micro-batches
    last: bool
    micro_batches: list[TensorDict]


def read_train(msg: Message) -> TrainPart:
    assert msg.kind == Kind.TRAIN, msg.kind
    meta = msg.meta
    return TrainPart(meta["step"], meta["num_loss_tokens"], meta["scale"], meta["last"],
                     [msg.data[str(i)] for i in range(meta["num_micro_batches"])])


def part_trained(step: int) -> Message:
    """Trainer 0 -> controller: the non-last TRAIN part of `step` is trained; the next may come (a TRAIN
    sent to a trainer still computing would block the controller's loop: `transport.send` waits)."""
    return Message(Kind.PART_TRAINED, {"step": step})


def checkpoint(step: int, path: str | None = None, export: str | None = None) -> Message:
    """Save the trainer state into `path` (a step_N.tmp folder the controller began) and/or write
    an HF folder to `export`."""
    meta: dict[str, Any] = {"step": step}
    if path is not None:
        meta["path"] = path
    if export is not None:
        meta["export"] = export
    return Message(Kind.CHECKPOINT, meta)


def stop() -> Message:
    return Message(Kind.STOP)


def sleep() -> Message:
    return Message(Kind.SLEEP)


def asleep(freed_bytes: int) -> Message:
    return Message(Kind.ASLEEP, {"freed_bytes": freed_bytes})


def staging(descriptor: dict[str, Any], version: int) -> Message:
    """Trainer k -> its colocated engine: the shared buffer (`weight_sync.SharedBuffer` descriptor,
    JSON-safe) and the version already written into it."""
    return Message(Kind.STAGING, {"buffer": descriptor, "version": version})


# ---------------------------------------------------------------- ranks -> controller


def completions(done: Iterable[Any]) -> Message:
    """Finished turns (objects with request_id, token_ids, logprobs, versions, finish_reason: the
    engine's `Completion`), as flat tensors plus per-turn lengths."""
    done = list(done)
    return Message(Kind.COMPLETIONS, {}, TensorDict({
        "request_id": torch.tensor([c.request_id for c in done], dtype=torch.int64),
        "num_tokens": torch.tensor([len(c.token_ids) for c in done], dtype=torch.int64),
        "finish": torch.tensor([FINISH_CODES[c.finish_reason] for c in done], dtype=torch.int64),
        "tokens": torch.tensor([t for c in done for t in c.token_ids], dtype=torch.int64),
        "logprobs": torch.tensor([x for c in done for x in c.logprobs], dtype=torch.float32),
        "versions": torch.tensor([v for c in done for v in c.versions], dtype=torch.int64),
    }, batch_size=[]))


@dataclass
class TurnRecord:
    """One finished turn of a COMPLETIONS message."""

    request_id: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


def read_completions(msg: Message) -> list[TurnRecord]:
    assert msg.kind == Kind.COMPLETIONS, msg.kind
    td = msg.data
    tokens, logprobs, versions = td["tokens"].tolist(), td["logprobs"].tolist(), td["versions"].tolist()
    out, offset = [], 0
    for rid, n, fin in zip(td["request_id"].tolist(), td["num_tokens"].tolist(), td["finish"].tolist()):
        sl = slice(offset, offset + n)
        out.append(TurnRecord(rid, tokens[sl], logprobs[sl], versions[sl], _FINISH_NAMES[fin]))
        offset += n
    return out


def prefilled(meta: dict[str, Any], data: TensorDict) -> Message:
    """Prefill replica -> controller: a handoff (runtime/engine/disagg.py builds and reads it;
    meta `handoff` its id, `dst` the decode rank)."""
    return Message(Kind.PREFILLED, meta, data)


def weights(version: int) -> Message:
    return Message(Kind.WEIGHTS, {"version": version})


def report(step: int, version: int, stats: dict[str, float], weight_sync_s: float) -> Message:
    return Message(Kind.REPORT, {"step": step, "version": version, "stats": stats, "weight_sync_s": weight_sync_s})


def done() -> Message:
    return Message(Kind.DONE)


def episode(event: Any) -> Message:
    """An environment worker's answer, put on the controller's own inbox queue (not sent)."""
    return Message(Kind.EPISODE, {"event": event})
