"""Prefill/decode disaggregation of the native engine (inference.prefill_ranks; docs/inference.md).

A prefill replica runs the ordinary `NativeEngine`, but a sequence leaves it as soon as its prompt
is computed and its first token sampled: `PrefillRole.step` takes such sequences out of the
scheduler with their block tables (`Scheduler.detach`; *parked*: no row, not live, blocks still
held) and describes them, per decode replica, in one PREFILLED message. A decode replica's
`DecodeRole.receive` takes that description and puts the sequences into its scheduler
(`Scheduler.adopt`) exactly as a single engine holds them right after a prefill (and its forks):
running, not yet decoding, the prompt's blocks shared copy-on-write between the samples of one
prompt, full blocks registered in the prefix cache when their k/v are of the replica's current
weight version. Leading full blocks that its prefix cache already holds (a multi-turn
continuation, a group repeating a prompt, a shared system prompt) are taken from it, as a single
engine's admission takes them. Only the blocks it lacks travel: it sends the prefill replica a
mask over the handoff's distinct blocks (1: send it), then receives those. It then decodes the
sequences like any other: same rows, preemption (a preempted sequence is recomputed on the
decode replica itself), stop rules, per-token versions.

    prefill replica                          controller                       decode replica
    GENERATE (meta decode = D) --> add
    step: prefill, sample token 0, park
    PREFILLED h (to the controller) ------->  relays, in one handler:
                                              SEND_KV h, dst D  -> prefill
                                              RECV_KV (the PREFILLED data, src, drop) ---> receive
    send: recv mask <=================== kv group (NCCL / gloo) ========================== mask
          send_blocks (the masked ones) ===============================================> recv_blocks

Aborts (`abort` on both roles; runtime/rollout/disagg.py routes them). On the prefill replica a
request queued or prefilling is dropped from the engine (blocks freed); a parked one is reported
aborted, and its blocks are held until its handoff is sent (the decode replica, told by RECV_KV's
`drop`, does not ask for blocks that only it used). On the decode replica it is an engine abort.
Each sample is reported once, with the tokens it had, as one engine's `abort` reports it.

What a PREFILLED message holds (`_describe`): per sequence its request id, sample index, seed,
prompt length, length limit, the weight version of its oldest k/v, its tokens (prompt + first
token), the logprobs and versions of its generated tokens, and its block table as indices into
the handoff's list of distinct blocks (the samples of one prompt share them); in meta the
handoff id, the decode rank, each sequence's SamplingParams, the number of distinct blocks, the
chunk size of the transfer and the cache's geometry (`cache_spec`), which the receiver checks
against its own before it takes a row or a block or receives anything.

Ordering. Both sides apply controller messages in order between engine steps, and the controller
sends SEND_KV / RECV_KV in one handler, as it sends LOAD_WEIGHTS to every inference rank in one
handler: so on both ranks a transfer and a weight broadcast come in the same order and neither
can wait on the other (no deadlock). A handoff's k/v therefore never come from a newer version
than the decode replica's (it loaded that version before it saw the RECV_KV); they may come from
an older one, which is what a single engine does when weights change between a sequence's prefill
and its decode: the k/v are kept, the tokens sampled from then on record the new version, and
those blocks are never registered in the prefix cache.

Room. A sequence is taken only when the decode replica has a free row and blocks for it; otherwise
its blocks are not sent (unless a sequence taken shares them), and it waits as a preempted
sequence does (tokens kept, recomputed on the decode replica when admitted). Sampling is
counter-based on (seed, token index) (runtime/engine/sampling.py), and the seed travels with the
sequence, so which replica samples a token does not change the draw.

Not supported (refused by the config): tensor-parallel replicas, the vLLM backend, the colocated
layout; models with linear-attention layers (their per-row recurrent state would have to travel
too; refused by the launcher's pre-flight check from the model's layer types, and again when a
role is built over such an engine). The rest of the engine (FP8 weights or cache, MLA latent
caches, sliding windows) needs nothing here: the blocks travel as the cache stores them.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist
from tensordict import TensorDict

from meshrl.runtime import protocol
from meshrl.runtime.engine.api import Completion, Request, SamplingParams
from meshrl.runtime.engine.kv_cache import KVCache, block_hashes
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.engine.sequence import Sequence
from meshrl.runtime.transport import Message

CHUNK_MB = 64.0
"""Blocks travel in chunks of about this many MiB (the staging buffers on each side hold one chunk)."""


# ---------------------------------------------------------------------------- the data plane


def cache_spec(kv: KVCache) -> list[list]:
    """The geometry of one block of every storage tensor: [shape without the block dim, dtype]."""
    return [[[*t.shape[:d], *t.shape[d + 1:]], str(t.dtype)] for t, d in kv.storages()]


def chunk_blocks(kv: KVCache, chunk_mb: float = CHUNK_MB) -> int:
    """Blocks per transfer chunk."""
    return max(1, int(chunk_mb * 2**20) // block_bytes(kv))


def block_bytes(kv: KVCache) -> int:
    """Bytes of one block on the wire (every layer, every storage tensor)."""
    return sum(t.element_size() * t.numel() // t.shape[d] for t, d in kv.storages())


def send_blocks(kv: KVCache, blocks: list[int], group: dist.ProcessGroup, dst: int, chunk: int) -> int:
    """Send the k/v of `blocks` (every layer, every storage tensor) to global rank `dst` on `group`,
    `chunk` blocks per point-to-point send; returns the bytes sent, when the sends are done."""
    if not blocks:
        return 0
    device = kv.storages()[0][0].device
    index = torch.tensor(blocks, dtype=torch.long, device=device)
    for start in range(0, len(blocks), chunk):
        part = index[start:start + chunk]
        for t, d in kv.storages():
            dist.send(t.index_select(d, part).contiguous(), dst=dst, group=group)
    return len(blocks) * block_bytes(kv)


def recv_blocks(kv: KVCache, spec: list[list], into: list[int], group: dist.ProcessGroup, src: int,
                chunk: int) -> int:
    """Receive `len(into)` blocks sent by `send_blocks` from global rank `src`; block i goes to cache
    block into[i], or is dropped when into[i] < 0. Returns the bytes received. ValueError (before
    anything is received) if the sender's cache geometry `spec` is not this cache's."""
    check_spec(kv, spec)
    if not into:
        return 0
    device = kv.storages()[0][0].device
    for start in range(0, len(into), chunk):
        part = into[start:start + chunk]
        keep = [i for i, b in enumerate(part) if b >= 0]
        src_index = torch.tensor(keep, dtype=torch.long, device=device)
        dst_index = torch.tensor([part[i] for i in keep], dtype=torch.long, device=device)
        for t, d in kv.storages():
            shape = list(t.shape)
            shape[d] = len(part)
            buf = torch.empty(shape, dtype=t.dtype, device=t.device)
            dist.recv(buf, src=src, group=group)
            if keep:
                t.index_copy_(d, dst_index, buf.index_select(d, src_index))
    return len(into) * block_bytes(kv)


def check_spec(kv: KVCache, spec: list[list]) -> None:
    """ValueError if the sender's cache geometry `spec` (`cache_spec`) is not this cache's."""
    mine = cache_spec(kv)
    if spec != mine:
        raise ValueError(f"KV handoff: the prefill replica's cache blocks are {spec} ([shape, dtype] per storage "
                         f"tensor) but this decode replica's are {mine}: both pools must run the same model and "
                         "inference settings")


def _check_engine(engine: NativeEngine) -> None:
    if engine.states is not None:
        raise ValueError("inference.prefill_ranks > 0 is not supported for models with linear-attention layers "
                         "(Qwen3-Next, Qwen3.5): their per-row recurrent state does not travel with the KV blocks")
    if engine.tp_group is not None:
        raise ValueError("inference.prefill_ranks > 0 is not supported with inference.tensor_parallel > 1")


# ---------------------------------------------------------------------------- prefill side


class PrefillRole:
    """A prefill replica: the engine's sequences leave it once their prompt is computed.

    group: the kv group (every inference rank; NCCL on GPU, gloo on CPU). `add(request, dst)` queues
    a request whose samples decode on global rank `dst`; `step()` runs one engine step and returns
    (the samples that finished in it, one PREFILLED message per decode replica); `send(h)` sends
    the blocks of handoff h that its decode replica asks for and frees them all here (they stay in
    the prefix cache); `abort(rid)` ends a request wherever it is on this replica.
    """

    def __init__(self, engine: NativeEngine, group: dist.ProcessGroup | None, chunk_mb: float = CHUNK_MB) -> None:
        _check_engine(engine)
        self.engine, self.group = engine, group
        self.chunk = chunk_blocks(engine.kv, chunk_mb)
        self.dst_of: dict[int, int] = {}  # live request id -> the decode rank of its samples
        # handoff -> (dst, its sequences, its distinct blocks, its sequences aborted since: blocks held until sent)
        self.parked: dict[int, tuple[int, list[Sequence], list[int], list[Sequence]]] = {}
        self._next_handoff = 0
        self.num_handed_off = 0
        """Sequences handed to decode replicas so far (aborted ones included)."""
        self.num_bytes_sent = 0
        """KV bytes sent to decode replicas so far (only the blocks they asked for)."""
        self.num_blocks_skipped = 0
        """Blocks of handoffs that their decode replica did not ask for (it holds them already in its
        prefix cache, or has no room for their sequence, or the sequence was aborted)."""

    def add(self, request: Request, dst: int) -> None:
        self.engine.add(request)
        self.dst_of[request.request_id] = dst

    def step(self) -> tuple[list[Completion], list[Message]]:
        done = self.engine.step()
        scheduler = self.engine.scheduler
        ready = [s for s in scheduler.running.values() if len(s.tokens) - s.num_computed == 1]
        by_dst: dict[int, list[Sequence]] = {}
        for seq in sorted(ready, key=lambda s: s.admitted):
            by_dst.setdefault(self.dst_of[seq.request.request_id], []).append(seq)
            scheduler.detach(seq)
        for rid in [rid for rid in self.dst_of if rid not in scheduler.live]:
            del self.dst_of[rid]
        return done, [self._describe(dst, seqs) for dst, seqs in by_dst.items()]

    def _describe(self, dst: int, seqs: list[Sequence]) -> Message:
        """The PREFILLED message of parked sequences bound for `dst` (module docstring)."""
        blocks: list[int] = []
        where: dict[int, int] = {}
        for seq in seqs:
            for b in seq.table:
                where.setdefault(b, len(blocks))
                if where[b] == len(blocks):
                    blocks.append(b)
        h = self._next_handoff
        self._next_handoff += 1
        self.parked[h] = (dst, list(seqs), blocks, [])
        self.num_handed_off += len(seqs)
        generated = [seq.tokens[seq.num_prompt:] for seq in seqs]
        data = TensorDict({
            "request_id": torch.tensor([s.request.request_id for s in seqs], dtype=torch.int64),
            "index": torch.tensor([s.index for s in seqs], dtype=torch.int64),
            "seed": torch.tensor([s.seed for s in seqs], dtype=torch.int64),
            "num_prompt": torch.tensor([s.num_prompt for s in seqs], dtype=torch.int64),
            "limit": torch.tensor([s.limit for s in seqs], dtype=torch.int64),
            "cache_version": torch.tensor([s.cache_version for s in seqs], dtype=torch.int64),
            "num_tokens": torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64),
            "tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64),
            "num_generated": torch.tensor([len(g) for g in generated], dtype=torch.int64),
            "logprobs": torch.tensor([x for s in seqs for x in s.logprobs], dtype=torch.float64),
            "versions": torch.tensor([v for s in seqs for v in s.versions], dtype=torch.int64),
            "table_lens": torch.tensor([len(s.table) for s in seqs], dtype=torch.int64),
            "tables": torch.tensor([where[b] for s in seqs for b in s.table], dtype=torch.int64),
        }, batch_size=[])
        meta = {"handoff": h, "dst": dst, "num_blocks": len(blocks), "chunk": self.chunk,
                "spec": cache_spec(self.engine.kv), "sampling": [asdict(s.request.sampling) for s in seqs]}
        return protocol.prefilled(meta, data)

    def send(self, handoff: int) -> None:
        """Send a handoff's blocks to its decode replica (which is in `DecodeRole.receive`): first its
        mask of the blocks it needs, then those blocks; then free them all here."""
        dst, seqs, blocks, aborted = self.parked.pop(handoff)
        need = torch.empty(len(blocks), dtype=torch.int64, device=self.engine.kv.storages()[0][0].device)
        if blocks:
            dist.recv(need, src=dst, group=self.group)
        wanted = [b for b, n in zip(blocks, need.tolist()) if n]
        assert set(wanted) <= {b for seq in seqs for b in seq.table}, "the decode replica asks for aborted blocks"
        self.num_bytes_sent += send_blocks(self.engine.kv, wanted, self.group, dst, self.chunk)
        self.num_blocks_skipped += len(blocks) - len(wanted)
        for seq in seqs + aborted:
            self.engine.blocks.release(seq.table)
            seq.table = []

    def abort(self, request_id: int) -> list[Completion]:
        """End every sample of a request that is on this replica -> their abort completions: queued
        or prefilling (dropped from the engine, blocks freed) or parked in a handoff not sent yet
        (the controller tells its decode replica to drop them, `recv_kv` meta `drop`; their blocks
        are freed with the handoff's at `send`). Nothing if the request is not here."""
        done = self.engine.scheduler.abort(request_id) or []
        self.dst_of.pop(request_id, None)
        for _, seqs, _, aborted in self.parked.values():
            gone = [seq for seq in seqs if seq.request.request_id == request_id]
            done += [seq.completion("abort") for seq in gone]
            aborted += gone
            seqs[:] = [seq for seq in seqs if seq.request.request_id != request_id]
        return sorted(done, key=lambda c: c.index)


# ---------------------------------------------------------------------------- decode side


class DecodeRole:
    """A decode replica: `receive(msg)` takes one RECV_KV message (a prefill replica's PREFILLED
    data, `msg.meta["src"]` its rank, `msg.meta["drop"]` the request ids aborted while it was in
    flight) and that handoff's blocks into the engine, over `group`; `abort(rid)` ends a request."""

    def __init__(self, engine: NativeEngine, group: dist.ProcessGroup | None) -> None:
        _check_engine(engine)
        self.engine, self.group = engine, group
        self.num_received = 0
        """Sequences received so far (not counting the dropped ones)."""
        self.num_recomputed = 0
        """Received sequences that found no row or blocks and wait to be recomputed here."""
        self.num_cached_blocks = 0
        """Leading full blocks of received sequences taken from this replica's prefix cache (not sent)."""
        self.num_bytes_received = 0
        """KV bytes received so far."""

    def receive(self, msg: Message) -> None:
        """Take a handoff (class docstring): adopt its sequences, tell the sender which of its blocks
        to send (those of adopted sequences that this replica's prefix cache does not hold), receive
        them. Before this replica's state changes or any block moves: ValueError if the sender's
        cache geometry differs from this replica's, RuntimeError if a token of the handoff is newer
        than this replica's weights."""
        engine, meta = self.engine, msg.meta
        check_spec(engine.kv, meta["spec"])
        scheduler = engine.scheduler
        seqs, tables = _sequences(msg.data, meta["sampling"])
        drop = set(meta.get("drop", ()))
        kept = [(seq, table) for seq, table in zip(seqs, tables) if seq.request.request_id not in drop]
        for seq, _ in kept:
            if max(seq.versions, default=0) > scheduler.version:
                raise RuntimeError(f"KV handoff of request {seq.request.request_id} sampled with weights "
                                   f"v{max(seq.versions)} reached a decode replica at v{scheduler.version}")
        use = [-1] * meta["num_blocks"]  # distinct block j -> the block of this cache that holds it
        into = [-1] * meta["num_blocks"]  # distinct block j -> where its received data goes (-1: not sent)
        taken = 0
        for seq, table in kept:
            run = self._attach(seq, table, use, into)
            scheduler.adopt(seq, run)  # not run: recomputed here when admitted, like a preempted sequence
            taken += run
        if into:
            device = engine.kv.storages()[0][0].device
            dist.send(torch.tensor([b >= 0 for b in into], dtype=torch.int64, device=device), dst=meta["src"],
                      group=self.group)
        wanted = [b for b in into if b >= 0]
        self.num_bytes_received += recv_blocks(engine.kv, meta["spec"], wanted, self.group, meta["src"], meta["chunk"])
        self.num_received += len(kept)
        self.num_recomputed += len(kept) - taken

    def _attach(self, seq: Sequence, table: list[int], use: list[int], into: list[int]) -> bool:
        """Give one received sequence its blocks if a row and blocks are free (their data arrives
        before the next step): its leading full blocks found in the prefix cache are shared, as a
        single engine's admission shares them, the others are the blocks received for it (allocated
        here, or shared with an earlier sequence of the handoff). False: no room."""
        scheduler, blocks = self.engine.scheduler, self.engine.blocks
        if not scheduler.free_rows:
            return False
        num_computed = len(seq.tokens) - 1
        matched: list[int] = []
        if scheduler.prefix_sharing and seq.cache_version == scheduler.version:
            seq.hashes = block_hashes(seq.tokens, blocks.block_size, num_computed // blocks.block_size)
            matched = blocks.match(seq.hashes, seq.tokens)
        rest = table[len(matched):]
        if blocks.num_free < sum(use[j] < 0 for j in rest):
            blocks.hits -= len(matched)
            blocks.release(matched)
            return False
        for j in rest:
            if use[j] < 0:
                use[j] = into[j] = blocks.allocate()
            else:
                blocks.incref(use[j])
        seq.table = matched + [use[j] for j in rest]
        seq.num_computed, seq.num_registered = num_computed, len(matched)
        self.num_cached_blocks += len(matched)
        return True

    def abort(self, request_id: int) -> list[Completion]:
        """End every sample of a request on this replica -> their abort completions (none if it is not here)."""
        return self.engine.scheduler.abort(request_id) or []


def _sequences(td: TensorDict, sampling: list[dict]) -> tuple[list[Sequence], list[list[int]]]:
    """The sequences of a PREFILLED message (blocks not yet attached) and their tables as indices
    into the handoff's distinct blocks."""
    tokens, logprobs, versions = td["tokens"].tolist(), td["logprobs"].tolist(), td["versions"].tolist()
    tables = td["tables"].tolist()
    seqs, out_tables = [], []
    t = g = b = 0
    columns = ("request_id", "index", "seed", "num_prompt", "limit", "cache_version", "num_tokens", "num_generated",
               "table_lens")
    for i, (rid, index, seed, num_prompt, limit, cache_version, n, ng, nb) in enumerate(
            zip(*(td[c].tolist() for c in columns))):
        own = tokens[t:t + n]
        request = Request(rid, own[:num_prompt], SamplingParams(**sampling[i]))
        seq = Sequence(request, index, seed, own, num_prompt, limit, logprobs[g:g + ng], versions[g:g + ng])
        seq.cache_version = cache_version
        seqs.append(seq)
        out_tables.append(tables[b:b + nb])
        t, g, b = t + n, g + ng, b + nb
    return seqs, out_tables
