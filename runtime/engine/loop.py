"""The inference rank: one engine replica (or one rank of a tensor-parallel replica) fed by the controller.

Between two engine steps the rank handles every message waiting in its inbox, in order:
`generate` adds requests, `load_weights v` receives the trainer's broadcast into the engine's
parameters in place (requests in flight keep their KV cache and continue on the new weights;
each token records its version), `abort` ends requests (their samples are reported with finish
"abort"), `stop` aborts what is left and ends. Finished requests go
back to the controller in one message per engine step. When the engine is idle the rank
blocks on its inbox instead of spinning.

Colocated layout: `load_weights v` copies version v out of the buffer this rank's trainer shares
with it (runtime/weight_sync.py, `ColocatedReceiver`) instead of joining a broadcast. With
inference.sleep_while_training, `sleep` frees the KV cache and CUDA graphs while the trainer
steps (answered by `asleep`), and the next `load_weights` or `generate` takes them back.

Prefill/decode disaggregation (inference.prefill_ranks = K > 0; runtime/engine/disagg.py). A
prefill replica's `generate` carries the decode rank of its requests; after each step the sequences
whose prompt is computed leave its engine and are described to the controller (`prefilled`); the
controller answers `send_kv` (send those blocks on the kv group now) and gives the decode replica
`recv_kv` (take them). Both apply these between engine steps, in order with `load_weights`, so a
block transfer and a weight broadcast never wait on each other.

Tensor parallel replicas (inference.tensor_parallel = N > 1). The N ranks each hold a shard of
the model (parallel/tensor_parallel.py) and run the same scheduler, so they must apply the same
messages between the same engine steps (the lockstep contract): otherwise one rank would run a
forward, and its all-reduces, over a batch the others do not have. The controller sends every
message to every rank of the replica, in the same order on each channel; before each step the
replica's first rank (the leader) broadcasts on the gloo `tp_control` group how many messages it
takes from its inbox, and the others take exactly that many from theirs (waiting for them if
they are still in flight). The engine broadcasts the leader's sampled tokens every step, so the
schedulers never diverge. Only the leader reports completions; every rank joins each weight
broadcast and takes its own slice. While idle, the leader announces "0 messages" at every
heartbeat, so the others never sit in one collective for long.
"""

from __future__ import annotations

import time

import torch

from meshrl.runtime import memory, protocol, transport, weight_sync
from meshrl.runtime.config import RLConfig
from meshrl.runtime.engine.api import InferenceEngine, Request
from meshrl.runtime.engine.build import build_engine
from meshrl.runtime.engine.disagg import DecodeRole, PrefillRole
from meshrl.runtime.engine.sampling import SamplingParams
from meshrl.runtime.layout import Layout
from meshrl.runtime.policy import compute_dtype
from meshrl.runtime.protocol import HEARTBEAT_S, Kind
from meshrl.runtime.rundir import Heartbeat, log
from meshrl.runtime.transport import Message


def run_inference(cfg: RLConfig, layout: Layout, start_version: int = 0) -> None:
    """Serve the controller until `stop`. `start_version`: the version of the first weights the
    trainer sends (a resumed run's checkpoint step)."""
    InferenceRank(cfg, layout, start_version).run()


class InferenceRank:
    """One inference rank's engine and channels in an RL job."""

    def __init__(self, cfg: RLConfig, layout: Layout, start_version: int) -> None:
        self.cfg, self.layout = cfg, layout
        device = layout.device
        self.dtype = compute_dtype(cfg.model, device)
        colocated = layout.roles.colocated
        memory.cap_process(cfg, "inference", device)
        kv_bytes = engine_bytes = None
        if colocated and device.type == "cuda":
            budget = memory.plan(cfg, memory.device_bytes(cfg))
            kv_bytes, engine_bytes = budget.kv_cache, budget.engine
        self.engine = build_engine(cfg.inference, cfg.model, device, self.dtype, cfg.seed, layout.tp_group, kv_bytes,
                                   engine_bytes)
        # vLLM keeps its weights in its worker process: the trainer's buffer goes through load_weights
        load = self.engine.load_weights if cfg.inference.backend == "vllm" else None
        self.colocated = (weight_sync.ColocatedReceiver(self.engine.model, self.dtype, device, layout.peer,
                                                        layout.to_peer, layout.from_peer, load=load)
                          if colocated else None)
        self.controller = layout.roles.controller
        self.inbox = transport.Inbox(last_kinds=(Kind.STOP,))
        # before the first sync: never block the controller
        self.inbox.listen(self.controller, layout.down[layout.rank], "controller")
        self.up = layout.up[layout.rank]
        # Completions (and every other message to the controller) leave from a thread: the engine
        # steps on while the controller takes them (runtime/transport.py, Outbox).
        self.outbox = transport.Outbox(self.controller, self.up, "controller")
        self.beat = Heartbeat(cfg.log.heartbeat_s, f"receiving the initial weights (v{start_version})")
        self.start_version = start_version
        self.generated = 0
        roles, rank = layout.roles, layout.rank
        self.prefill = PrefillRole(self.engine, layout.kv_group) if rank in roles.prefill_engines else None
        self.decode = (DecodeRole(self.engine, layout.kv_group)
                       if roles.prefill_replicas and rank in roles.decode_engines else None)

    def run(self) -> None:
        engine, layout = self.engine, self.layout
        self._receive(None)
        if self.start_version:
            engine.set_version(self.start_version)
        log.info("received initial weights (v%d)", self.start_version)
        reports = layout.is_replica_leader  # a tensor-parallel replica speaks through its first rank
        while True:
            for msg in _next_messages(engine, self.inbox, layout, self.beat, self.cfg.dist.timeout_s, self.generated):
                if msg.kind == Kind.STOP:
                    return self._stop()
                self._apply(msg)
            if engine.has_work():
                self.beat.set(f"engine step with weights v{engine.version}")
                done = engine.step() if self.prefill is None else self._prefill_step()
                if done and reports:
                    self.generated += sum(len(c.token_ids) for c in done)
                    self.outbox.send(protocol.completions(done))

    def _prefill_step(self):
        """A prefill replica's step: the sequences it prefilled go to the controller as handoffs."""
        done, handoffs = self.prefill.step()
        for msg in handoffs:
            self.outbox.send(msg)
        return done

    def _apply(self, msg: Message) -> None:
        engine = self.engine
        if msg.kind == Kind.GENERATE:
            _wake(engine)
            for r in protocol.read_generate(msg):
                request = Request(r.request_id, r.prompt_ids, SamplingParams(**r.sampling))
                if self.prefill is None:
                    engine.add(request)
                else:
                    self.prefill.add(request, msg.meta["decode"])
        elif msg.kind == Kind.SEND_KV:
            self.prefill.send(msg.meta["handoff"])
        elif msg.kind == Kind.RECV_KV:
            self.decode.receive(msg)
        elif msg.kind == Kind.ABORT:
            done = [c for rid in msg.meta["request_ids"] for c in self._abort(rid)]
            if done and self.layout.is_replica_leader:
                transport.send(protocol.completions(done), self.controller, self.up)
        elif msg.kind == Kind.LOAD_WEIGHTS:
            version = msg.meta["version"]
            self.beat.set(f"receiving weights v{version}")
            start = time.perf_counter()
            _wake(engine)
            self._receive(version)
            engine.set_version(version)
            log.info("loaded weights v%d in %.4fs", engine.version, time.perf_counter() - start)
        elif msg.kind == Kind.SLEEP:
            freed = engine.sleep()
            log.info("asleep while the trainer steps: %.2f GiB freed", freed / 2**30)
            self.outbox.send(protocol.asleep(freed))
        else:
            raise RuntimeError(f"inference rank got an unexpected message {msg.kind!r}")

    def _abort(self, request_id: int) -> list:
        """End a request on this replica -> the abort completions to report now (an engine's other
        samples of it come out of its next step; nothing if it is not here)."""
        role = self.prefill or self.decode
        if role is not None:
            return role.abort(request_id)
        done = self.engine.abort(request_id)
        return [] if done is None else [done]

    def _receive(self, version: int | None) -> None:
        """The trainer's weights into the engine, in place: the first ones (None) or `version`."""
        cfg, layout = self.cfg, self.layout
        if self.colocated is not None:
            self.colocated.receive_first() if version is None else self.colocated.receive(version)
        elif cfg.inference.backend == "vllm":
            # vLLM's parameters are renamed to HF names and loaded through its worker
            # (runtime/engine/vllm_engine.py), so it receives the buckets itself
            self.engine.receive_weights(layout.sync_group, layout.roles.trainers[0], self.dtype,
                                        cfg.weight_sync.bucket_mb, layout.device)
        else:
            weight_sync.receive_weights(self.engine.model, layout.sync_group, layout.roles.trainers[0], self.dtype,
                                        cfg.weight_sync.bucket_mb, layout.device)

    def _stop(self) -> None:
        self.beat.close()
        # Every dispatched step is trained before the controller says stop, so nothing should be live.
        if self.engine.has_work() or (self.prefill is not None and self.prefill.parked):
            log.warning("stopping with requests still live (or prefilled and not handed off); they are dropped")
        if self.prefill is not None:
            log.info("prefill replica: handed %d sequences off to decode replicas", self.prefill.num_handed_off)
        if self.decode is not None:
            log.info("decode replica: received %d prefilled sequences (%d recomputed here for want of room)",
                     self.decode.num_received, self.decode.num_recomputed)
        if self.colocated is not None:
            self.colocated.close()
        if self.layout.device.type == "cuda":
            log.info("peak GPU memory of this engine process: %.2f GiB",
                     torch.cuda.max_memory_allocated(self.layout.device) / 2**30)
        self.outbox.send(protocol.done())
        self.outbox.close()


def _wake(engine: InferenceEngine) -> None:
    """Take the KV cache back if the engine slept while the trainer stepped (sleep_while_training)."""
    if getattr(engine, "asleep", False):
        engine.wake()


def _next_messages(engine, inbox: transport.Inbox, layout: Layout, beat: Heartbeat, timeout_s: float,
                   generated: int) -> list[Message]:
    """The controller's messages to apply before the next engine step: whatever has arrived while
    the engine works, else the next one (none after HEARTBEAT_S: a heartbeat). A tensor-parallel
    follower applies exactly what its replica's first rank applies (see the module docstring)."""
    if not layout.is_replica_leader:
        if not engine.has_work():
            beat.set(f"idle with weights v{engine.version}, waiting for the replica's first rank")
        return _lockstep([], inbox, layout.tp_control, False, timeout_s)
    if engine.has_work():
        messages = inbox.drain()
    else:
        beat.set(f"idle with weights v{engine.version}, waiting for the controller")
        msg = inbox.get(timeout=HEARTBEAT_S)
        if msg is None:
            log.info("heartbeat: idle, version %d, %d tokens generated so far", engine.version, generated)
        messages = [] if msg is None else [msg]
    if layout.tp_control is not None:
        _lockstep(messages, inbox, layout.tp_control, True, timeout_s)
    return messages


def _lockstep(messages: list[Message], inbox: transport.Inbox, group, leader: bool, timeout_s: float) -> list[Message]:
    """The messages every rank of a tensor-parallel replica applies before this step: the leader's
    `messages`, taken by the others from their own inboxes (the controller sends each message to
    every rank of the replica, in the same order)."""
    count = torch.tensor([len(messages) if leader else 0], dtype=torch.int64)
    torch.distributed.broadcast(count, group=group, group_src=0)
    if leader:
        return messages
    taken = []
    for _ in range(int(count)):
        msg = inbox.get(timeout=timeout_s)
        if msg is None:
            raise TimeoutError(f"the replica's first rank applied a controller message this rank did not get "
                               f"within {timeout_s}s")
        taken.append(msg)
    return taken
