"""Prefill/decode disaggregation driven by the controller's router, on real gloo processes.

Rank 0 is the controller (runtime/rollout/disagg.py's `DisaggRouter` sends the requests, relays
the handoffs and routes the aborts), rank 1 a prefill replica, rank 2 a decode replica; the replicas
handle the controller's messages as runtime/engine/loop.py does. The controller is the clock: it
sends "tick" and each replica steps once after the messages before it, so every abort lands at a
known point and one engine stepped the same number of times, aborting the same requests after the
same steps, is the reference. Its completions (aborted samples included: their tokens so far) must
be the P/D run's.

Aborts: a request queued on the prefill replica (never admitted), one still waiting there behind a
full prefill budget, one half prefilled (a chunk computed), handoffs aborted while their blocks are
in flight (before the relay: the prefill replica reports them and their blocks are not sent; after
it: the decode replica takes them and aborts them before its next step), one sample of a group
whose other samples share its blocks, a handoff whose only request is aborted in flight (nothing
is sent), and a request decoding on the decode replica. Afterwards both
replicas hold every block they started with (free-block counts back to their start, nothing
referenced, nothing parked or live).

Only missing blocks travel: a second wave sends a multi-turn continuation of a finished request and
a new group repeating a group's prompt through the prefill replica; the decode replica's prefix
cache already holds their leading blocks, so only the rest is sent. Bytes are counted on both sides.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.runtime import protocol, transport
from meshrl.runtime.engine.api import Completion, Request, SamplingParams, continuation_ids
from meshrl.runtime.engine.disagg import DecodeRole, PrefillRole, block_bytes
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.protocol import Kind
from meshrl.runtime.rollout.disagg import DisaggRouter
from meshrl.runtime.transport import Message
from tests.dist.multirank import run_ranks
from tests.random_models import scaled_random_model

VOCAB = 96
ARGS = Qwen3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                 tie_embeddings=True)
BUDGET = 40  # prefill tokens per step: the first wave needs three prefill steps
PREFILL, DECODE = 1, 2


def make_engine(device: str) -> NativeEngine:
    return NativeEngine(scaled_random_model(Qwen3, ARGS, 0), max_model_len=64, device=device, dtype=torch.float32,
                        max_num_seqs=16, block_size=4, max_num_batched_tokens=BUDGET)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = {"temperature": 0.0, "max_tokens": 10}
SAMPLED = {"temperature": 1.0, "max_tokens": 8}
# id -> (prompt, sampling, seed); 3-5 and 7-8 are groups (identical prompts, one sampling setting).
# With BUDGET the prefill replica (and one engine) prefill 0, 2, 3-5 in step 1 (padded 3 x 13 tokens;
# 6 does not fit), 6 and 7-8 in step 2, 9 in step 3 (10 does not fit beside it), 40 of 10's 45 tokens
# in step 4, and the rest of 10 with 11 in step 5.
WAVE = {0: (prompt(13, 0), GREEDY, 0), 1: (prompt(9, 1), GREEDY, 0), 2: (prompt(7, 2), GREEDY, 0),
        **{i: (prompt(11, 3), SAMPLED, 30 + i) for i in (3, 4, 5)}, 6: (prompt(6, 6), GREEDY, 0),
        **{i: (prompt(5, 7), SAMPLED, 70 + i) for i in (7, 8)}, 9: (prompt(17, 9), GREEDY, 0),
        10: (prompt(45, 10), GREEDY, 0), 11: (prompt(8, 11), GREEDY, 0)}
# What the controller does around each tick: requests sent and aborts routed before it; after it,
# aborts routed before the tick's handoffs are relayed ("early": still on the prefill replica, their
# blocks in flight) and after ("late": on the decode replica, not yet decoded there).
SCRIPT = {
    1: {"send": list(WAVE), "abort": [1]},  # 1: queued on the prefill replica, never admitted
    # 2 and 4 (a group's sample: 3 and 5 share its blocks) are parked, 5 relayed, 11 still waits
    "1+": {"early": [2, 4, 11], "late": [5]},
    "2+": {"early": [8]},  # parked, 7 shares its blocks
    "3+": {"early": [9]},  # parked, alone in its handoff: nothing of it is sent
    "4+": {"early": [10]},  # half prefilled (one chunk computed)
    "5+": {"early": [6]},  # decoding on the decode replica for three steps
}


def rows(completions: list[Completion]) -> list[tuple]:
    return sorted((c.request_id, c.index, c.token_ids, c.logprobs, c.versions, c.finish_reason) for c in completions)


def second_wave(done: list[tuple]) -> dict[int, tuple]:
    """Sent once request 0 has finished (`done`: rows): its next turn (prompt, completion, 3 new
    tokens) and a new group of two repeating the prompt of 3-5, both through the prefill replica."""
    first = next(r for r in done if r[0] == 0)
    turn = continuation_ids(Completion(0, WAVE[0][0], first[2], first[3], first[4], first[5]), [5, 6, 7])
    return {20: (turn, GREEDY, 0),
            **{i: (WAVE[3][0], SAMPLED, 80 + i) for i in (21, 22)}}


# ------------------------------------------------------------------------------- one engine


def reference(device: str = "cpu") -> list[tuple]:
    engine, done, tick, sent = make_engine(device), [], 0, False
    while tick == 0 or engine.has_work() or not sent:
        tick += 1
        script = SCRIPT.get(tick, {})
        for rid in script.get("send", []):
            p, sampling, seed = WAVE[rid]
            engine.add(Request(rid, p, SamplingParams(**sampling, seed=seed)))
        if not sent and any(c.request_id == 0 for c in done):
            sent = True
            for rid, (p, sampling, seed) in second_wave(rows(done)).items():
                engine.add(Request(rid, p, SamplingParams(**sampling, seed=seed)))
        for rid in script.get("abort", []):
            done += [engine.abort(rid)]
        done += engine.step()
        after = SCRIPT.get(f"{tick}+", {})
        for rid in after.get("early", []) + after.get("late", []):
            c = engine.abort(rid)
            done += [c] if c is not None else []
    return rows(done)


# ------------------------------------------------------------------------------- the three ranks


def _controller(down: dict, up: dict, out) -> None:
    layout = SimpleNamespace(roles=SimpleNamespace(prefill_engines=(PREFILL,), decode_engines=(DECODE,)), down=down)
    where: dict = {}
    router = DisaggRouter(layout, where, backlog_tokens=10**6)
    inbox = transport.Inbox(last_kinds=("done",))
    for r in (PREFILL, DECODE):
        inbox.listen(r, up[r], f"rank{r}")
    done, handoffs, tick, sent, states = [], [], 0, False, {}

    def send(requests: dict) -> None:
        for rid, (p, sampling, seed) in requests.items():  # one episode each, all first turns
            where[rid] = ("ep", rid)
            router.home([where[rid]])
            router.send(DECODE, sampling, [rid], [p], [seed])

    while tick == 0 or router.decode_of or not sent:
        tick += 1
        script = SCRIPT.get(tick, {})
        send({rid: WAVE[rid] for rid in script.get("send", [])})
        if not sent and any(r[0] == 0 for r in done):
            sent = True
            send(second_wave(done))
        router.abort(script.get("abort", []))
        for r in (PREFILL, DECODE):
            transport.send(Message("tick"), r, down[r])
        waiting = {PREFILL, DECODE}
        while waiting:
            msg = inbox.get(timeout=120)
            assert msg is not None, "a replica did not answer"
            if msg.kind == "tock":
                waiting.discard(msg.src)
                states.update(msg.meta["aborted_in"])
            elif msg.kind == Kind.COMPLETIONS:
                turns = protocol.read_completions(msg)
                router.on_completions([t.request_id for t in turns])
                done += [(t.request_id, 0, t.token_ids, t.logprobs, t.versions, t.finish_reason) for t in turns]
            else:
                assert msg.kind == Kind.PREFILLED
                handoffs.append(msg)
        after = SCRIPT.get(f"{tick}+", {})
        router.abort(after.get("early", []))
        for msg in handoffs:
            router.on_prefilled(msg)
        handoffs.clear()
        router.abort(after.get("late", []))
        assert tick < 200, "the run does not end"
    assert not router.aborted and not any(router.prefill_load.values()), (router.aborted, router.prefill_load)
    for r in (PREFILL, DECODE):
        transport.send(Message("end"), r, down[r])
    stats = [inbox.get(timeout=120) for _ in range(2)]
    torch.save((sorted(done), states, {m.src: m.meta for m in stats}), out / "pd.pt")


def _where(role, engine: NativeEngine, rid: int) -> str:
    """Where an aborted request is on a replica (for the test's coverage check)."""
    scheduler = engine.scheduler
    if rid not in scheduler.live:
        parked = isinstance(role, PrefillRole) and any(s.request.request_id == rid for _, seqs, _, _ in
                                                       role.parked.values() for s in seqs)
        return "parked" if parked else "absent"
    seq = scheduler.live[rid][0]
    if seq.row < 0:
        return "waiting"
    return "decoding" if len(seq.tokens) - seq.num_computed == 1 else "prefilling"


def _replica(rank: int, kv, down, up, device: str) -> None:
    engine = make_engine(device)
    role = PrefillRole(engine, kv, chunk_mb=0.002) if rank == PREFILL else DecodeRole(engine, kv)
    start_free = engine.blocks.num_free
    inbox = transport.Inbox(last_kinds=("end",))
    inbox.listen(0, down, "controller")
    aborted_in: dict[int, str] = {}
    while (msg := inbox.get(timeout=120)).kind != "end":
        if msg.kind == "tick":
            outputs = []
            if engine.has_work():
                if rank == PREFILL:
                    finished, outputs = role.step()
                else:
                    finished = engine.step()
                engine.check()
                if finished:
                    outputs.insert(0, protocol.completions(finished))
            for m in outputs + [Message("tock", {"aborted_in": {f"{rank}:{k}": v for k, v in aborted_in.items()}})]:
                transport.send(m, 0, up)
            aborted_in.clear()
        elif msg.kind == Kind.GENERATE:  # as runtime/engine/loop.py applies it
            for r in protocol.read_generate(msg):
                request = Request(r.request_id, r.prompt_ids, SamplingParams(**r.sampling))
                role.add(request, msg.meta["decode"]) if rank == PREFILL else engine.add(request)
        elif msg.kind == Kind.SEND_KV:
            role.send(msg.meta["handoff"])
        elif msg.kind == Kind.RECV_KV:
            role.receive(msg)
        elif msg.kind == Kind.ABORT:
            done = []
            for rid in msg.meta["request_ids"]:
                aborted_in[rid] = _where(role, engine, rid)
                done += role.abort(rid)
            if done:
                transport.send(protocol.completions(done), 0, up)
        engine.check()
    assert not engine.scheduler.live and not engine.has_work()
    assert not any(engine.blocks.ref[1:]) and engine.blocks.num_free == start_free, "a replica leaks blocks"
    meta = ({"bytes": role.num_bytes_sent, "skipped": role.num_blocks_skipped, "handed_off": role.num_handed_off}
            if rank == PREFILL else
            {"bytes": role.num_bytes_received, "received": role.num_received, "cached": role.num_cached_blocks})
    assert rank == DECODE or not role.parked
    transport.send(Message("done", {**meta, "block_bytes": block_bytes(engine.kv)}), 0, up)


def _job(rank, world_size, out, device="cpu"):
    torch.set_num_threads(1)
    down = {r: dist.new_group([0, r], backend="gloo") for r in (PREFILL, DECODE)}  # control messages
    up = {r: dist.new_group([0, r], backend="gloo") for r in (PREFILL, DECODE)}
    kv = dist.new_group([PREFILL, DECODE], backend="nccl" if device == "cuda" else "gloo")
    if rank == 0:
        _controller(down, up, out)
    else:
        _replica(rank, kv, down[rank], up[rank], device)


@pytest.mark.slow
def test_aborts_across_the_split_and_partial_handoffs_equal_one_engine(tmp_path):
    run_ranks(_job, 3, tmp_path)
    check(tmp_path, reference())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_aborts_across_the_split_and_partial_handoffs_over_nccl(tmp_path):
    """The same on two GPUs (the replicas on GPUs 0 and 1, the kv group NCCL; the reference engine on
    GPU 0): the mask and the blocks go over NCCL. Not run on the CPU machine."""
    run_ranks(_job, 3, tmp_path, "cuda", backend="cpu:gloo,cuda:nccl", devices=[0, 0, 1])
    check(tmp_path, reference("cuda"))


def check(tmp_path, ref: list[tuple]) -> None:
    got, states, stats = torch.load(tmp_path / "pd.pt")
    assert [r[:2] for r in got] == [r[:2] for r in ref]
    for g, r in zip(got, ref):
        assert g[:3] + g[4:] == r[:3] + r[4:], f"request {g[0]} differs:\n{g}\n{r}"
        assert g[3] == pytest.approx(r[3], abs=1e-5, rel=0), f"request {g[0]} logprobs"
    finish = {r[0]: (r[5], len(r[2])) for r in ref}
    assert {rid for rid, (reason, _) in finish.items() if reason == "abort"} == {1, 2, 4, 5, 6, 8, 9, 10, 11}
    assert [finish[rid][1] for rid in (1, 10, 11)] == [0] * 3  # aborted before their first token
    assert [finish[rid][1] for rid in (2, 4, 8, 9)] == [1] * 4  # in flight: their first token only
    assert finish[6][1] == 3  # it decoded on the decode replica before the abort
    # every abort found its request where the scenario says (so none of them is vacuous); the decode
    # replica is told too while a request may still be on the prefill replica, and finds nothing there
    assert {k: v for k, v in states.items() if v != "absent"} == {
        "1:1": "waiting", "1:2": "parked", "1:4": "parked", "1:11": "waiting", "2:5": "decoding", "1:8": "parked",
        "1:9": "parked", "1:10": "prefilling", "2:6": "decoding"}, states
    prefill, decode = stats[PREFILL], stats[DECODE]
    per_block = prefill["block_bytes"]
    assert prefill["bytes"] == decode["bytes"] and prefill["bytes"] % per_block == 0, stats
    # Blocks sent, by hand (block size 4; a handoff's blocks hold its prompts' k/v). Wave 1: 0 (13
    # tokens: 4 blocks), 3-5 (11: 3 blocks, shared), 6 (6: 2), 7-8 (5: 2, shared) = 11; not 2's 2 nor
    # 9's 5 (17 tokens; aborted in flight), nor anything of 1, 10, 11 (aborted before their prefill ended).
    # Wave 2 (one handoff): 20 continues 0 (13 + 10 + 3 = 26 tokens: 7 blocks) and the decode replica
    # holds 0's first 5 (it computed 22 of 0's tokens); 21-22 repeat 3's prompt (3 blocks, shared),
    # of which it holds the 2 full ones: 2 + 1 sent.
    assert prefill["bytes"] == (11 + 3) * per_block, stats  # every block of every handoff would be 28
    assert prefill["skipped"] == 2 + 5 + 5 + 2, stats
    # leading blocks the decode replica took from its prefix cache: 5's 2 (3's, adopted just before
    # it in the same handoff), 20's 5, 2 for each of 21 and 22
    assert decode["cached"] == 2 + 5 + 2 + 2, stats
