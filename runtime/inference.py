"""The inference rank: one engine replica fed by the controller.

Between two engine steps the rank handles every message waiting in its inbox, in order:
`generate` adds requests, `load_weights v` receives the trainer's broadcast into the engine's
parameters in place (requests in flight keep their KV cache and continue on the new weights;
each token records its version), `stop` aborts what is left and ends. Finished requests go
back to the controller in one message per engine step. When the engine is idle the rank
blocks on its inbox instead of spinning.
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict

from meshrl.runtime import transport, weight_sync
from meshrl.runtime.config import RLConfig
from meshrl.runtime.controller import FINISH_CODES, HEARTBEAT_S
from meshrl.runtime.engine import Completion, NativeEngine, Request, SamplingParams
from meshrl.runtime.layout import Layout
from meshrl.runtime.policy import build_policy, compute_dtype
from meshrl.runtime.rundir import Heartbeat, log
from meshrl.runtime.transport import Message
from meshrl.runtime.vllm_engine import build_vllm_engine


def encode_completions(done: list[Completion]) -> TensorDict:
    return TensorDict({
        "request_id": torch.tensor([c.request_id for c in done], dtype=torch.int64),
        "num_tokens": torch.tensor([len(c.token_ids) for c in done], dtype=torch.int64),
        "finish": torch.tensor([FINISH_CODES[c.finish_reason] for c in done], dtype=torch.int64),
        "tokens": torch.tensor([t for c in done for t in c.token_ids], dtype=torch.int64),
        "logprobs": torch.tensor([x for c in done for x in c.logprobs], dtype=torch.float32),
        "versions": torch.tensor([v for c in done for v in c.versions], dtype=torch.int64),
    }, batch_size=[])


def decode_requests(msg: Message) -> list[Request]:
    td, meta = msg.data, msg.meta
    flat = td["prompt_ids"].tolist()
    requests, offset = [], 0
    for rid, n, seed in zip(td["request_id"].tolist(), td["prompt_lens"].tolist(), td["seed"].tolist()):
        sampling = SamplingParams(temperature=meta["temperature"], top_p=meta["top_p"], max_tokens=meta["max_tokens"],
                                  stop_token_ids=tuple(meta["stop_token_ids"]), seed=seed)
        requests.append(Request(rid, flat[offset:offset + n], sampling))
        offset += n
    return requests


def run_inference(cfg: RLConfig, layout: Layout, start_version: int = 0) -> None:
    """Serve the controller until `stop`. `start_version`: the version of the first weights the
    trainer sends (a resumed run's checkpoint step)."""
    device = layout.device
    dtype = compute_dtype(cfg.model, device)
    if cfg.inference.backend == "vllm":
        engine = build_vllm_engine(cfg.inference, cfg.model, device, dtype, seed=cfg.seed)
    else:
        model, _ = build_policy(cfg.model, device, dtype)
        inf = cfg.inference
        engine = NativeEngine(model, max_num_seqs=inf.max_num_seqs, max_model_len=inf.max_model_len, device=device,
                              dtype=dtype, block_size=inf.block_size, num_blocks=inf.num_blocks,
                              kv_cache_memory_fraction=inf.kv_cache_memory_fraction,
                              max_num_batched_tokens=inf.max_num_batched_tokens, prefix_sharing=inf.prefix_sharing,
                              cuda_graphs=inf.cuda_graphs and device.type == "cuda", attention=inf.attention,
                              seed=cfg.seed)
    controller = layout.roles.controller
    inbox = transport.Inbox(last_kinds=("stop",))
    inbox.listen(controller, layout.down[layout.rank], "controller")  # before the first sync: never block the controller
    src = layout.roles.trainers[0]
    beat = Heartbeat(cfg.log.heartbeat_s, f"receiving the initial weights (v{start_version})")
    _receive_weights(engine, cfg, layout.sync_group, src, dtype, device)
    if start_version:
        engine.set_version(start_version)
    log.info("received initial weights (v%d)", start_version)
    up = layout.up[layout.rank]
    generated = 0
    while True:
        if engine.has_work():
            messages = inbox.drain()
        else:
            beat.set(f"idle with weights v{engine.version}, waiting for the controller")
            msg = inbox.get(timeout=HEARTBEAT_S)
            if msg is None:
                log.info("heartbeat: idle, version %d, %d tokens generated so far", engine.version, generated)
                continue
            messages = [msg]
        for msg in messages:
            if msg.kind == "generate":
                for request in decode_requests(msg):
                    engine.add(request)
            elif msg.kind == "load_weights":
                beat.set(f"receiving weights v{msg.meta['version']}")
                start = time.perf_counter()
                _receive_weights(engine, cfg, layout.sync_group, src, dtype, device)
                engine.set_version(msg.meta["version"])
                log.info("loaded weights v%d in %.3fs", engine.version, time.perf_counter() - start)
            elif msg.kind == "stop":
                beat.close()
                _stop(engine, controller, up)
                return
            else:
                raise RuntimeError(f"inference rank got an unexpected message {msg.kind!r}")
        if engine.has_work():
            beat.set(f"engine step with weights v{engine.version}")
            done = engine.step()
            if done:
                generated += sum(len(c.token_ids) for c in done)
                transport.send(Message("completions", {}, encode_completions(done)), controller, up)


def _receive_weights(engine, cfg: RLConfig, group, src: int, dtype: torch.dtype, device: torch.device) -> None:
    # The native engine's parameters are ours, filled in place; vLLM's are renamed to HF names and
    # loaded through its worker (runtime/vllm_engine.py), so it receives the buckets itself.
    if cfg.inference.backend == "vllm":
        engine.receive_weights(group, src, dtype, cfg.weight_sync.bucket_mb, device)
    else:
        weight_sync.receive_weights(engine.model, group, src, dtype, cfg.weight_sync.bucket_mb, device)


def _stop(engine: NativeEngine, controller: int, up) -> None:
    # Every dispatched step is trained before the controller says stop, so nothing should be live.
    if engine.has_work():
        log.warning("stopping with requests still live; they are dropped")
    transport.send(Message("done"), controller, up)
