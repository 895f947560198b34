"""Prefill/decode disaggregation (runtime/engine/disagg.py) on real gloo processes.

Rank 0 is a prefill replica, rank 1 a decode replica (rank 2 plays trainer rank 0 when weights
change). Their completions and per-token versions must equal one engine's given the same seeds, and
their logprobs up to the fp32 rounding of differently batched forwards (1e-5): n > 1 forks and
identical prompts back to back, a prompt extending another, a request that ends at its first token,
a multi-turn continuation on the decode replica (which must prefill only the new tokens), a decode
replica so small that it preempts, one with too few rows for a handoff (those sequences' blocks are
not sent and it recomputes them), a weight update in flight, and handoffs older than the decode
replica's weights. Neither replica may end with a block still referenced; both count the same bytes
sent, and blocks the decode replica finds in its prefix cache (or has no row for) are not sent.
Plus the KV block transfer on its own: bit-for-bit equal blocks, and refused geometry mismatches
(before the decode replica's state changes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.runtime import protocol, transport, weight_sync
from meshrl.runtime.engine.api import Completion, Request, SamplingParams, continuation_ids
from meshrl.runtime.engine.disagg import DecodeRole, PrefillRole, cache_spec, recv_blocks, send_blocks
from meshrl.runtime.engine.kv_cache import KVCache
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.transport import Message
from tests.dist.multirank import run_ranks
from tests.random_models import scaled_random_model

VOCAB = 96
ARGS = Qwen3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                 tie_embeddings=True)
DECODE_STEPS_BEFORE_UPDATE = 3


def make_model(seed: int = 0):
    return scaled_random_model(Qwen3, ARGS, seed)


def make_engine(model, **kwargs) -> NativeEngine:
    kwargs.setdefault("max_num_seqs", 16)
    kwargs.setdefault("block_size", 4)
    return NativeEngine(model, max_model_len=64, device="cpu", dtype=torch.float32, **kwargs)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def wave(first_id: int, seed: int) -> list[Request]:
    """Mixed lengths (greedy), one that ends at its first token, a prompt extending another, a group
    of identical prompts back to back (seeded), and n = 3 seeded samples of one request."""
    base = prompts([13, 3, 5, 9, 21], seed)
    out = [Request(first_id + i, p, SamplingParams(temperature=0.0, max_tokens=6 + 2 * i)) for i, p in enumerate(base)]
    out.append(Request(first_id + 5, base[1], SamplingParams(temperature=1.0, max_tokens=1, seed=3)))
    out.append(Request(first_id + 6, base[0] + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8)))
    out += [Request(first_id + 7 + j, list(base[3]), SamplingParams(temperature=1.0, max_tokens=10, seed=40 + j))
            for j in range(3)]
    out.append(Request(first_id + 10, base[2], SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=5)))
    return out


def continuation(done: list[Completion]) -> Request:
    """The next turn of request 0's episode: its prompt, its completion and three new tokens."""
    first = next(c for c in done if c.request_id == 0)
    return Request(100, continuation_ids(first, [5, 6, 7]), SamplingParams(temperature=0.0, max_tokens=6))


SCENARIOS = {  # the decode replica's engine settings
    "plain": {},
    "preempt": {"num_blocks": 21},  # the decode replica's cache: it must preempt running sequences
    "rows": {"max_num_seqs": 3},  # fewer rows than one handoff's sequences: the rest are recomputed
    "update": {},
    # weights change on both replicas after the prefill step, before the decode replica receives:
    # every handoff is older than its weights (one engine: the update right after its prefill step)
    "stale": {},
}
UPDATE_AT = {"update": 1 + DECODE_STEPS_BEFORE_UPDATE, "stale": 1}  # one engine's step count at the swap


def rows(completions: list[Completion]) -> list[tuple]:
    return sorted((c.request_id, c.index, c.token_ids, c.logprobs, c.versions, c.finish_reason) for c in completions)


def swap_in(engine: NativeEngine, new) -> None:
    with torch.no_grad():
        for p, q in zip(engine.model.parameters(), new.parameters()):
            p.copy_(q)
    engine.set_version(1)


# ------------------------------------------------------------------------------- one engine


def reference(name: str) -> tuple[list[tuple], int]:
    """One engine on the same requests -> (completions, prompt tokens the continuation computed).

    "update": the weights change after its prefill step and 3 decode steps (the decode replica's 3
    steps), and a second wave arrives with them. "stale": they change right after its prefill step,
    before any decode step: the prompts' k/v (and the first tokens, sampled by that prefill) are v0,
    every later token is sampled with v1, and no v0 block is ever reused from the prefix cache."""
    engine = make_engine(make_model())
    for r in wave(0, seed=0):
        engine.add(r)
    done = engine.step()
    assert not engine.scheduler.waiting, "the first wave must be prefilled in one step (the update test aligns on it)"
    steps = 1
    while engine.has_work():
        if steps == UPDATE_AT.get(name):
            swap_in(engine, make_model(seed=1))
            for r in wave(50, seed=1) if name == "update" else []:
                engine.add(r)
        done += engine.step()
        engine.check()
        steps += 1
    before = engine.num_prefill_tokens
    engine.add(continuation(done))
    while engine.has_work():
        done += engine.step()
    return rows(done), engine.num_prefill_tokens - before


# ------------------------------------------------------------------------------- prefill + decode


def _groups():
    kv = dist.new_group([0, 1])  # the KV blocks
    ctl = dist.new_group([0, 1])  # stands in for the controller's relay of PREFILLED messages
    sync = dist.new_group([2, 0, 1])  # trainer 0 + both replicas: the weight broadcast
    return kv, ctl, sync


def _prefill(name, kv, ctl, sync, out) -> None:
    role = PrefillRole(make_engine(make_model()), kv, chunk_mb=0.01)  # several chunks per handoff
    waves = [wave(0, seed=0)] + ([wave(50, seed=1)] if name == "update" else [])
    done = []
    for i, requests in enumerate(waves):
        if i:  # both pools receive every version
            weight_sync.receive_weights(role.engine.model, sync, 2, torch.float32, 0.01, torch.device("cpu"))
            role.engine.set_version(1)
        for r in requests:
            role.add(r, dst=1)
        while role.engine.has_work():
            finished, handoffs = role.step()
            done += finished
            role.engine.check()
            if name == "stale" and handoffs and role.engine.version == 0:  # v1 on both before the receive
                weight_sync.receive_weights(role.engine.model, sync, 2, torch.float32, 0.01, torch.device("cpu"))
                role.engine.set_version(1)
            for msg in handoffs:
                transport.send(msg, 1, ctl)
                role.send(msg.meta["handoff"])
    assert not role.parked and role.num_handed_off > 0
    assert not any(role.engine.blocks.ref[1:]), f"{name}: the prefill replica leaks blocks"
    transport.send(Message("end"), 1, ctl)
    torch.save((rows(done), role.num_bytes_sent, role.num_blocks_skipped), out / f"{name}-prefill.pt")


def _decode(name, kv, ctl, sync, out) -> None:
    role = DecodeRole(make_engine(make_model(), **SCENARIOS[name]), kv)
    engine = role.engine
    inbox = transport.Inbox(last_kinds=("end",))
    inbox.listen(0, ctl, "prefill")
    if name == "stale":  # v1 before the first handoff arrives
        weight_sync.receive_weights(engine.model, sync, 2, torch.float32, 0.01, torch.device("cpu"))
        engine.set_version(1)
    done, steps, ended = [], 0, False
    while not ended or engine.has_work():
        messages = inbox.drain() if engine.has_work() else [inbox.get(timeout=120)]
        for msg in messages:
            assert msg is not None, "no handoff arrived"
            if msg.kind == "end":
                ended = True
            else:
                role.receive(protocol.recv_kv(msg))
        engine.check()
        if engine.has_work():
            done += engine.step()
            engine.check()
            steps += 1
            if name == "update" and steps == DECODE_STEPS_BEFORE_UPDATE:
                weight_sync.receive_weights(engine.model, sync, 2, torch.float32, 0.01, torch.device("cpu"))
                engine.set_version(1)
    before = engine.num_prefill_tokens
    engine.add(continuation(done))  # routed to the replica that holds the episode's cache
    while engine.has_work():
        done += engine.step()
    assert not any(engine.blocks.ref[1:]), f"{name}: the decode replica leaks blocks"
    stats = {"preemptions": engine.num_preemptions, "received": role.num_received, "cached": role.num_cached_blocks,
             "continuation_prefill": engine.num_prefill_tokens - before, "hits": engine.blocks.hits,
             "recomputed": role.num_recomputed, "bytes": role.num_bytes_received}
    torch.save((rows(done), stats), out / f"{name}-decode.pt")


def _job(rank, world_size, out):
    torch.set_num_threads(1)  # three ranks on a small CPU
    kv, ctl, sync = _groups()
    for name in SCENARIOS:  # one job for all: spawning the ranks is most of the time
        if rank == 0:
            _prefill(name, kv, ctl, sync, out)
        elif rank == 1:
            _decode(name, kv, ctl, sync, out)
        elif name in UPDATE_AT:
            weight_sync.send_weights(make_model(seed=1), sync, 2, torch.float32, 0.01, torch.device("cpu"))


@pytest.mark.slow
def test_prefill_and_decode_replicas_equal_one_engine(tmp_path):
    run_ranks(_job, 3, tmp_path)
    for name in SCENARIOS:
        check_scenario(tmp_path, name)
    sent = {name: torch.load(tmp_path / f"{name}-prefill.pt")[1] for name in ("plain", "rows")}
    assert 0 < sent["rows"] < sent["plain"], sent  # the sequences without a row have their blocks not sent


def check_scenario(tmp_path, name: str) -> None:
    ref, ref_continuation = reference(name)
    early, sent, skipped = torch.load(tmp_path / f"{name}-prefill.pt")
    got, stats = torch.load(tmp_path / f"{name}-decode.pt")
    assert sent == stats["bytes"] > 0, (sent, stats)  # both sides count the blocks that travelled
    if name == "plain":  # the leading blocks found in the prefix cache at receipt are not sent
        assert skipped == 3 + 2 + 1, skipped  # request 6's (0's prompt), 7's (3's), 10's (2's); forks share them
    assert [r[0] for r in early] == [5] + ([55] if name == "update" else []), "only max_tokens=1 ends on prefill"
    got = sorted(got + early)
    assert [r[:2] for r in got] == [r[:2] for r in ref]
    for g, r in zip(got, ref):
        # Tokens, versions and finish reasons exactly; logprobs to fp32 rounding: a forward's rounding
        # depends on its batch (prefill padding, a preempted sequence recomputed by a prefill forward),
        # and the two setups batch differently (same seeds give the same draws whatever the batch).
        assert g[:3] + g[4:] == r[:3] + r[4:], f"{name}: request {g[0]} sample {g[1]} differs:\n{g}\n{r}"
        assert g[3] == pytest.approx(r[3], abs=1e-5, rel=0), f"{name}: request {g[0]} sample {g[1]} logprobs"
    assert any(len(set(r[2])) > 2 for r in ref), "vacuous: the model only repeats tokens"
    # 13 samples a wave, of which one ends at its first token on the prefill replica
    assert stats["received"] == 12 * (2 if name == "update" else 1)
    if name == "plain":  # the continuation found the received and decoded blocks in the prefix cache
        assert 0 < stats["continuation_prefill"] == ref_continuation < 13 + 6 + 3, stats
        # leading full blocks taken from the decode replica's prefix cache at receipt: request 6 extends
        # request 0's prompt (3), 7 repeats 3's (2), 10 repeats 2's (1), and the other samples of 7 (2 x 2)
        # and of 10 (2 x 1) find theirs there too, registered by their first sample just before
        assert stats["cached"] == 3 + 2 + 1 + 4 + 2, stats
    if name in UPDATE_AT:  # k/v of v0 are never cached under v1: one engine recomputes it all too
        assert stats["continuation_prefill"] == ref_continuation == 13 + 6 + 3, stats
    if name == "preempt":
        assert stats["preemptions"] > 0, "the small cache must preempt"
    if name in ("plain", "rows"):  # room for every handoff, or rows for only 3 of its 12 sequences
        assert (stats["recomputed"] > 0) == (name == "rows"), stats
    if name == "stale":  # every handoff predates the decode replica's weights: nothing of it is cached
        assert stats["cached"] == 0, stats
        assert all(r[4] == [0] + [1] * (len(r[4]) - 1) for r in got if r[0] != 100), "first tokens v0, the rest v1"
        assert any(len(r[4]) > 1 for r in got)
    if name == "update":
        versions = {v for r in got for v in r[4]}
        assert versions == {0, 1}, "the update must be in flight"
        assert any(r[4][0] == 0 and r[4][-1] == 1 for r in got), "some sequence must cross the update"


# ------------------------------------------------------------------------------- the block transfer


CACHES = {
    "gqa": dict(head_dim=8),
    "fp8": dict(head_dim=8, fp8=True),  # e4m3 values and fp32 scales
    "mla": dict(head_dim=12, v_head_dim=0),  # keys only (a latent cache), a tensor of its own
}


def make_cache(kind: str, seed: int, device: str = "cpu") -> KVCache:
    kv = KVCache([0, 1], 8, 4, 2, dtype=torch.float32, device=torch.device(device), **CACHES[kind])
    g = torch.Generator().manual_seed(seed)
    for t, _ in kv.storages():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _transfer_job(rank, world_size, out, device="cpu"):
    group = dist.new_group([0, 1], backend="nccl" if device == "cuda" else "gloo")
    for kind in CACHES:
        kv = make_cache(kind, seed=rank, device=device if device == "cpu" else f"cuda:{rank}")
        if rank == 0:
            send_blocks(kv, [5, 2, 7, 3], group, 1, chunk=3)  # two chunks
        else:
            recv_blocks(kv, cache_spec(make_cache(kind, 0)), [1, -1, 6, 4], group, 0, chunk=3)  # block 2 dropped
            torch.save([t.cpu().clone() for t, _ in kv.storages()], out / f"{kind}.pt")


def test_kv_blocks_arrive_bit_for_bit(tmp_path):
    run_ranks(_transfer_job, 2, tmp_path)
    check_transfer(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_kv_blocks_arrive_bit_for_bit_over_nccl(tmp_path):
    """The same code on two GPUs: the kv group is NCCL there (not run on the CPU machine)."""
    run_ranks(_transfer_job, 2, tmp_path, "cuda", backend="cpu:gloo,cuda:nccl")
    check_transfer(tmp_path)


def check_transfer(tmp_path) -> None:
    for kind in CACHES:
        sent, before = make_cache(kind, 0), make_cache(kind, 1)
        got = torch.load(tmp_path / f"{kind}.pt")
        for (src, d), (old, _), new in zip(sent.storages(), before.storages(), got):
            expect = old.clone()
            for a, b in ((5, 1), (7, 6), (3, 4)):
                expect.select(d, b).copy_(src.select(d, a))
            assert torch.equal(new.view(torch.uint8), expect.view(torch.uint8)), kind  # bytes: NaNs compare too


def test_mismatched_caches_are_refused_before_receiving():
    kv = make_cache("gqa", 0)
    for other in (KVCache([0, 1], 8, 4, 2, 16, torch.float32, torch.device("cpu")),  # another head dim
                  KVCache([0, 1], 8, 4, 2, 8, torch.bfloat16, torch.device("cpu")),  # another dtype
                  make_cache("fp8", 0)):
        with pytest.raises(ValueError, match="KV handoff: the prefill replica's cache blocks are"):
            recv_blocks(kv, cache_spec(other), [1], None, 0, chunk=4)


def test_a_refused_handoff_leaves_the_decode_replica_untouched():
    """Another cache geometry (ValueError) or tokens newer than the decode replica's weights
    (RuntimeError) are refused before a row, a block or a prefix-cache entry is taken."""
    prefill = PrefillRole(make_engine(make_model()), None)
    for r in wave(0, seed=0):
        prefill.add(r, dst=1)
    _, (msg,) = prefill.step()
    decode = DecodeRole(make_engine(make_model()), None)
    engine = decode.engine
    scheduler = engine.scheduler

    def state():
        return (list(engine.blocks.ref), list(engine.blocks.free), dict(engine.blocks.cached), sorted(scheduler.free_rows),
                dict(scheduler.running), dict(scheduler.live), list(scheduler.waiting), decode.num_received)

    before = state()
    other = cache_spec(KVCache([0, 1], 8, 4, 2, 8, torch.float32, torch.device("cpu")))
    with pytest.raises(ValueError, match="KV handoff: the prefill replica's cache blocks are"):
        decode.receive(protocol.recv_kv(Message(msg.kind, {**msg.meta, "spec": other}, msg.data, src=0)))
    assert state() == before
    newer = msg.data.clone()
    newer["versions"][-1] = 1  # the last sequence's first token: the others would be taken first
    with pytest.raises(RuntimeError, match=r"sampled with weights v1 reached a decode replica at v0"):
        decode.receive(protocol.recv_kv(Message(msg.kind, msg.meta, newer, src=0)))
    assert state() == before
