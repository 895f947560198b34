"""Native inference engine: models/ definitions, continuous batching over a paged KV cache.

One scheduler iteration (`NativeEngine.step`):

    1. decode set   every running sequence whose only uncomputed token is its last sampled one;
                    each gets room for that token's k/v (a new block, or a private copy of a
                    shared one); when the cache is out of blocks the newest running sequence is
                    preempted (blocks freed, back to the front of the queue, recomputed later)
    2. prefill set  sequences part-way through a long prompt, then waiting requests admitted
                    FIFO while rows, blocks and `max_num_batched_tokens` allow; a prompt's full
                    blocks found in the prefix cache are shared instead of recomputed
    3. prefill      one eager forward of the prefill set (right-padded (B, T)); rows that reach
                    the end of their tokens sample their next token
    4. decode       queue one forward of the decode set, one token per row; on CUDA a captured
                    graph per (bucketed batch, bucketed block count, sampling mode) replays the
                    whole forward and the sampler (models/common/fused.py kernels inside it)
    5. complete     read the tokens of the decode queued in the *previous* step and append them
    after every sample: stop id / stop string / max_tokens / max_model_len -> Completion, blocks
    and row freed at once

Decode runs every step and prefill gets a token budget per step, so neither starves the other.

One-step lookahead. A decode launch does not wait for its tokens: the next step queues the next
forward first, feeding each row the token its previous launch left on the device, and only then
reads the previous launch's tokens, so the device computes step N+1 while the host does step N's
bookkeeping. A sequence that step N's token ends by length is not fed again; one that a stop
token ends computes one wasted position whose result is dropped (every loss of a row bumps the
sequence's epoch; a launch's results count only for the epoch it was queued in). An abort or a
preemption drops the in-flight token (a preempted sequence samples it again, same seed). Tokens
record the weight version of their launch. Positions and slots are host-known a step ahead, so
block allocation and copy-on-write stay on the host as before.

Host work of a decode step is one Python pass over the decode set (append the sampled token,
check the stop rules, store the row's next token / position / slot / counter in host arrays),
one host-to-device copy (those arrays and any block-table edits) and one device-to-host copy
(tokens and logprobs together). Only sequences that just started decoding or whose next token
starts a block are looked at for blocks; the decoding and prefilling lists, and the decode
sampling batch, are rebuilt only when a row changes hands or a prefill ran.

Sequences. A sequence is (request, sample index): `tokens` (prompt + generated), `num_computed`
of them with k/v in the cache, a block table, and a *row*: its index in the persistent decode
buffers (token, position, slot, block table, context length), which on CUDA the graphs read.
The model has no cache of its own: it calls `attn.attend(layer_id, q, k, v)` in every layer and
runtime/engine/kv_cache.py's `PagedAttention` writes k/v into the blocks and attends over them.

Sharing. Samples of one prompt (SamplingParams.n, or separate requests with identical prompts
queued back to back, which is how the controller sends a group) are admitted together: the
first one prefills the prompt once; at its first sample the others fork its block table
(references, no copy) and sample from the same logits with their own seeds; the partly filled
last block is copied only when a sample first writes into it (copy-on-write). Full blocks are
also kept in a prefix cache keyed by their whole prefix, after their sequence ends, until
evicted (LRU).

Multi-turn (token-level continuation). To continue an episode, add a request whose prompt is
`continuation_ids(completion, new_ids)` = previous prompt + completion + the environment's new
tokens, as token ids, never re-tokenised text. Every full block computed in earlier turns is
found in the prefix cache, so only the new tokens (and the last partial block) are computed.

Weights. Weight sync copies new weights into `engine.model`'s parameters in place (the CUDA
graphs read those very storages) between `step()` calls, then calls `set_version(v)`. Requests
in flight keep their k/v (off-policy by design, bounded by the controller) and the tokens they
sample from then on record version v. The prefix cache is dropped on a version change: a new
request must not silently reuse keys computed by the old weights, and a sequence whose k/v
predate the current version never registers its blocks.

Sampling and logprobs: runtime/engine/sampling.py (fp32 log_softmax(logits / temperature) over the
full vocabulary; seeded counter-based draws independent of the batch).
Tensor parallelism inside a replica is not implemented (one rank per engine).
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from meshrl.runtime.engine.api import Completion, FinishReason, Request
from meshrl.runtime.engine.kv_cache import NULL_BLOCK, BlockManager, KVCache, PagedAttention, block_hashes, triton_available
from meshrl.runtime.engine.sampling import SamplingBatch, SamplingParams, StaticSamplingBatch, sample

@dataclass(eq=False, slots=True)
class _Sequence:
    request: Request
    index: int
    seed: int
    tokens: list[int]  # prompt + generated
    num_prompt: int
    limit: int  # it ends by length once it holds this many tokens (max_tokens, max_model_len)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose k/v are in the cache
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of its leading full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    ready: bool = False  # decoding, with its row's inputs and device block table up to date
    row: int = -1
    admitted: int = -1  # admission stamp: the newest running sequence is preempted first
    cache_version: int = 0  # weight version of its oldest cached k/v
    followers: list[_Sequence] = field(default_factory=list)  # samples waiting to fork its prefill
    inflight: int = 0  # decode launches whose token has not come back yet (0 or 1)
    epoch: int = 0  # bumped whenever it loses its row: results of earlier launches are stale

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    def completion(self, finish_reason: FinishReason) -> Completion:
        r = self.request
        return Completion(r.request_id, list(r.prompt_ids), self.generated, self.logprobs, self.versions,
                          finish_reason, self.index)


def _batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    sizes += list(range(160, max_num_seqs + 64, 32 if max_num_seqs <= 512 else 64))
    return sorted({min(s, max_num_seqs) for s in sizes})


class _Probe:
    """Records each layer's id and k/v heads in one throw-away forward (the cache is shaped by it)."""

    def __init__(self) -> None:
        self.layers: list[tuple[int, int, int]] = []

    def attend(self, layer_id, q, k, v):
        self.layers.append((layer_id, k.shape[1], k.shape[3]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class _DecodeRows:
    """The decode forward's inputs, one entry per row: host arrays the scheduler edits in place,
    and the persistent device buffers the forward (and its CUDA graphs) reads.

    Host arrays (int64): the token to feed, its position, its cache slot, its sampling counter
    (tokens generated so far) and `follow`: 1 when the token to feed is the one this row sampled
    in the previous launch, which is still on the device (`last`) when the next launch is queued.
    A row that does not decode this step holds the pad: token 0 at position 0, written to the
    null block. A decoding row changes by +1 per launch, so the step's work on the host is a
    handful of stores per row; block-table edits are queued as (row, index, block) and travel
    with the inputs in `push`, the one host-to-device copy of a decode step. Arrays rather than
    lists: they become a tensor by a memory copy, not an element-by-element conversion (~7x
    faster at 256 rows).
    """

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device) -> None:
        self.token = array("q", bytes(8 * num_rows))
        self.position = array("q", bytes(8 * num_rows))
        self.slot = array("q", bytes(8 * num_rows))
        self.count = array("q", bytes(8 * num_rows))
        self.follow = array("q", bytes(8 * num_rows))
        self.table_updates: list[int] = []  # row, index, block, row, index, block, ...
        self.inputs = torch.zeros((4, num_rows, 1), dtype=torch.long, device=device)  # token, position, slot, count
        self.context_lens = torch.ones(num_rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros((num_rows, max_blocks), dtype=torch.int32, device=device)
        self.last = torch.zeros(num_rows, dtype=torch.long, device=device)  # tokens of the last launch

    def clear(self, row: int) -> None:
        self.token[row] = self.position[row] = self.slot[row] = self.count[row] = self.follow[row] = 0

    def push(self, B: int) -> None:
        """Copy rows [0, B) and the queued block-table entries to the device buffers."""
        staged = (self.token[:B] + self.position[:B] + self.slot[:B] + self.count[:B] + self.follow[:B]
                  + array("q", self.table_updates))
        dev = torch.frombuffer(staged, dtype=torch.long).to(self.inputs.device, non_blocking=True)
        self.inputs[:, :B, 0].copy_(dev[:4 * B].view(4, B))
        self.inputs[0, :B, 0].copy_(torch.where(dev[4 * B:5 * B].bool(), self.last[:B], self.inputs[0, :B, 0]))
        torch.add(dev[B:2 * B], 1, out=self.context_lens[:B])
        if self.table_updates:
            updates = dev[5 * B:].view(-1, 3)
            self.tables.index_put_((updates[:, 0], updates[:, 1]), updates[:, 2].to(torch.int32))
            self.table_updates = []


@dataclass(eq=False)
class _Launch:
    """A queued decode forward: which sequence sampled in which row (and its epoch then), the
    weight version, and the (2, B) tokens / logprobs on their way to the host."""

    seqs: list[_Sequence]
    rows: list[int]
    epochs: list[int]
    version: int
    host: torch.Tensor
    event: torch.cuda.Event | None


class NativeEngine:
    """Continuous-batching engine over a models/ model with a paged KV cache.

    model: a models/ module with hidden(tokens (B, T), positions (B, T), attn) -> final-normed
        hidden states (B, T, dim) and output_weight (V, dim); moved to device/dtype, eval, frozen.
    max_num_seqs: rows, i.e. most sequences running at once.
    max_model_len: most tokens (prompt + completion) of one sequence.
    block_size: tokens per KV block. num_blocks: size of the cache in blocks (block 0 is the null
        block); default: room for max_num_seqs full-length sequences, on CUDA at most
        `kv_cache_memory_fraction` of the device memory left free once the model is loaded.
    max_num_batched_tokens: prefill tokens per step (padded B x T); default max(8192, max_model_len).
    prefix_sharing: prefix cache and prefill-once forks of identical prompts (off: every sequence
        computes its whole prompt).
    cuda_graphs: capture decode forwards (default: on for CUDA). attention: decode attention
        backend, "torch" (gather + SDPA) or "triton" (paged kernel, CUDA); "auto" picks triton when
        it can. detokenize: ids -> text, needed by requests with stop strings. seed: the engine's
        RNG for requests without a seed. tp_group: the ranks of a tensor-parallel replica (each
        passes its shard of the model and the same requests; the group's first rank's samples are
        broadcast to the others every step).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_fraction: float = 0.85,
        max_num_batched_tokens: int | None = None,
        prefix_sharing: bool = True,
        cuda_graphs: bool | None = None,
        attention: Literal["auto", "torch", "triton"] = "auto",
        detokenize: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {kv_cache_memory_fraction}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        _check_model_fits(model, self.device, dtype)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens or max(8192, max_model_len)
        if self.max_num_batched_tokens < 2:  # a prompt's last two tokens must fit one prefill
            raise ValueError(f"max_num_batched_tokens must be >= 2, got {max_num_batched_tokens}")
        self.prefix_sharing = prefix_sharing
        self.detokenize = detokenize
        # A tensor-parallel replica: `model` holds this rank's shard (parallel/tensor_parallel.py)
        # and every rank of the group runs this same scheduler on the same requests.
        self.tp_group = tp_group if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1 else None
        self.version = 0
        self.vocab_size = self.model.output_weight.shape[0]
        is_cuda = self.device.type == "cuda"
        self.cuda_graphs = is_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not is_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device")

        # Positions 0..max_model_len-2 hold k/v: the last token of a full-length sequence is never fed.
        self.max_blocks = math.ceil((max_model_len - 1) / block_size)
        with torch.inference_mode():
            probe = _Probe()
            one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            self.model.hidden(one, one, probe)
        layer_ids = [layer_id for layer_id, _, _ in probe.layers]
        _, num_kv_heads, head_dim = probe.layers[0]
        # A kernel tile spans a head: triton ranges need a power of two, tensor-core products >= 16.
        kernel_fits = _is_pow2(head_dim) and head_dim >= 16
        if attention == "auto":
            attention = "triton" if is_cuda and triton_available() and kernel_fits else "torch"
        if attention not in ("torch", "triton"):
            raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {attention!r}")
        if attention == "triton" and not (is_cuda and kernel_fits):
            raise ValueError(f"attention='triton' needs a CUDA device and a power-of-two head_dim >= 16 "
                             f"(got {head_dim}); use 'torch'")
        self.attention = attention
        per_block = KVCache.bytes_per_block(len(layer_ids), block_size, num_kv_heads, head_dim, dtype)
        if num_blocks is None:
            # More blocks than max_num_seqs full-length sequences only lengthen the prefix cache's
            # memory: never take more by default (an engine for a small eval stays small).
            num_blocks = max_num_seqs * self.max_blocks + 1
            if is_cuda:
                free, _ = torch.cuda.mem_get_info(self.device)
                num_blocks = min(num_blocks, int(kv_cache_memory_fraction * free) // per_block)
        if num_blocks - 1 < self.max_blocks:
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0)} blocks of {block_size} tokens "
                f"({per_block / 2**20:.2f} MiB each) but one sequence of max_model_len {max_model_len} needs "
                f"{self.max_blocks}: lower max_model_len, raise kv_cache_memory_fraction / num_blocks, "
                "or use a device with more memory")
        self.kv = KVCache(layer_ids, num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)

        self._rng = random.Random(seed)
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # row -> sequence
        self._live: dict[int, list[_Sequence]] = {}  # request_id -> its live samples
        self._free_rows = list(range(max_num_seqs))  # a heap: lowest rows first keeps decode batches dense
        self._stamp = 0
        self._pending_aborts: list[Completion] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        """Prompt tokens computed so far (what prefix sharing saves shows here)."""
        self.num_first_tokens = 0
        """Samples that have produced their first token (benchmarks time the first token with it)."""

        # Persistent decode inputs, one entry per row (see _decode).
        self._rows = _DecodeRows(max_num_seqs, self.max_blocks, self.device)
        self._buckets = _batch_buckets(max_num_seqs)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._static_sampling = StaticSamplingBatch(max_num_seqs, self.device) if self.cuda_graphs else None
        self._launched: _Launch | None = None  # the decode launch whose tokens the next step reads
        self._host_out = [torch.empty((2, max_num_seqs), dtype=torch.float64, pin_memory=True)
                          for _ in range(2)] if is_cuda else []  # two: a launch's copy never overwrites unread tokens
        self._host_flip = 0
        # Running sequences in admission order, split into decoding (one uncomputed token) and
        # prefilling; rebuilt only when a row is taken or freed or a prefill ran.
        self._decoding: list[_Sequence] = []
        self._prefilling: list[_Sequence] = []
        self._decode_rows = 0  # rows [0, _decode_rows) hold every decoding sequence
        self._layout_stale = False
        # Decoding sequences to look at in the next _reserve_decode: new ones, and ones whose next
        # token starts a block. Every other one writes into a block it already owns alone.
        self._block_checks: dict[_Sequence, None] = {}
        self._layout_version = 0  # bumped at every rebuild: the decode sampling batch follows it
        self._sampling_key: tuple[int, int] | None = None
        self._sampling_batch: SamplingBatch | None = None

    # ------------------------------------------------------------------ public API

    def set_version(self, version: int) -> None:
        """Tokens sampled from now on are recorded with this weight version; drops the prefix cache."""
        if version != self.version:
            self.blocks.clear_prefix_cache()
        self.version = version

    def add(self, request: Request) -> None:
        """Queue a request (its n samples); ValueError if it can never be served."""
        prompt, sampling = request.prompt_ids, request.sampling
        if not 1 <= len(prompt) <= self.max_model_len - 1:
            raise ValueError(f"request {request.request_id}: prompt has {len(prompt)} tokens, "
                             f"must be 1..{self.max_model_len - 1} (max_model_len - 1)")
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            raise ValueError(f"request {request.request_id}: prompt token ids must be in [0, {self.vocab_size})")
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id} is already live")
        if sampling.stop and self.detokenize is None:
            raise ValueError(f"request {request.request_id} has stop strings but the engine has no detokenize")
        samples = []
        for i in range(sampling.n):
            seed = sampling.seed + i if sampling.seed is not None else self._rng.getrandbits(62)
            limit = min(len(prompt) + sampling.max_tokens, self.max_model_len)
            samples.append(_Sequence(request, i, seed, list(prompt), len(prompt), limit))
        self._waiting.extend(samples)
        self._live[request.request_id] = samples

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._live or self._pending_aborts)

    def abort(self, request_id: int) -> Completion | None:
        """Drop every sample of a live request and free its blocks now; None if it is not live.

        Returns the completion (finish_reason "abort") of its lowest live sample; with n > 1 the
        other samples' abort completions come out of the next `step()`.
        """
        samples = self._live.pop(request_id, None)
        if samples is None:
            return None
        for seq in samples:
            self._drop(seq)
        done = [seq.completion("abort") for seq in samples]
        self._pending_aborts += done[1:]
        return done[0]

    def step(self) -> list[Completion]:
        """One scheduler iteration (see the module docstring); returns the samples that finished."""
        finished, self._pending_aborts = self._pending_aborts, []
        with torch.inference_mode():
            launched, self._launched = self._launched, None
            decode, num_rows = self._reserve_decode()
            prefill = self._schedule_prefill()
            if prefill:
                finished += self._prefill(prefill)
            if decode:
                # Queued before the previous launch's tokens are read: the device computes this
                # step while the host does the previous one's bookkeeping (one-step lookahead).
                self._launched = self._launch_decode(decode, num_rows)
            if launched is not None:
                finished += self._complete_decode(launched)
        return finished

    def check(self) -> None:
        """Assert the bookkeeping invariants between steps: blocks, and every row's host inputs and
        device block table against its sequence (for tests)."""
        self.blocks.check()
        bs, rows = self.block_size, self._rows
        assert not rows.table_updates, "block-table edits left unsent"
        tables = rows.tables.tolist()
        for r in range(self.max_num_seqs):
            seq = self._running.get(r)
            inputs = (rows.token[r], rows.position[r], rows.slot[r], rows.count[r])
            if seq is None or not seq.ready:
                assert inputs == (0, 0, 0, 0), f"row {r} is not decoding but holds inputs {inputs}"
                continue
            p = seq.num_computed + seq.inflight  # the position its next launch feeds
            assert len(seq.tokens) - seq.num_computed == 1 and seq.row == r and seq.inflight in (0, 1)
            fed = (0, p, 1) if seq.inflight else (seq.tokens[p], p, 0)  # in flight: token from the device
            assert (inputs[0], inputs[1], rows.follow[r]) == fed, f"row {r}: inputs {inputs} are not {fed}"
            assert inputs[3] == len(seq.tokens) + seq.inflight - seq.num_prompt
            assert tables[r][:len(seq.table)] == seq.table, f"row {r}: device block table is stale"
            if seq not in self._block_checks:  # else the next _reserve_decode gives it a block
                block = seq.table[p // bs]
                assert self.blocks.ref[block] == 1 and block not in self.blocks.info, "writes into a shared block"
                assert inputs[2] == block * bs + p % bs, f"row {r}: slot {inputs[2]} is not position {p}'s"

    # ------------------------------------------------------------------ bookkeeping

    def _take_row(self, seq: _Sequence) -> None:
        seq.row = heapq.heappop(self._free_rows)
        seq.admitted = self._stamp
        self._stamp += 1
        self._running[seq.row] = seq
        self._layout_stale = True

    def _free(self, seq: _Sequence) -> None:
        """Give back the sequence's blocks and row (it stays in _live)."""
        self.blocks.release(seq.table)
        seq.table = []
        seq.num_computed = seq.num_registered = 0
        seq.ready = False
        seq.inflight = 0
        seq.epoch += 1
        if seq.row >= 0:
            del self._running[seq.row]
            heapq.heappush(self._free_rows, seq.row)
            self._rows.clear(seq.row)
            self._layout_stale = True
            seq.row = -1

    def _requeue_followers(self, seq: _Sequence) -> None:
        for follower in reversed(seq.followers):
            self._waiting.appendleft(follower)
        seq.followers = []

    def _drop(self, seq: _Sequence) -> None:
        """Remove a sequence from wherever it is (waiting, running, or following a leader)."""
        if seq.row >= 0:
            self._free(seq)
            self._requeue_followers(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        else:
            for leader in self._running.values():
                if seq in leader.followers:
                    leader.followers.remove(seq)
                    break

    def _finish(self, seq: _Sequence, reason: FinishReason) -> Completion:
        self._free(seq)
        samples = self._live[seq.request.request_id]
        samples.remove(seq)
        if not samples:
            del self._live[seq.request.request_id]
        return seq.completion(reason)

    def _preempt(self, seq: _Sequence) -> None:
        """Free a running sequence's blocks; it goes back to the front of the queue, keeping its tokens."""
        self.num_preemptions += 1
        self._free(seq)
        self._requeue_followers(seq)
        self._waiting.appendleft(seq)

    def _register(self, seq: _Sequence) -> None:
        """Put the sequence's newly full blocks into the prefix cache (same-version k/v only)."""
        num_full = seq.num_computed // self.block_size
        if not self.prefix_sharing or seq.cache_version != self.version or num_full <= seq.num_registered:
            return
        seq.hashes = block_hashes(seq.tokens, self.block_size, num_full, seq.hashes)
        bs = self.block_size
        for i in range(seq.num_registered, num_full):
            parent = seq.hashes[i - 1] if i else 0
            self.blocks.register(seq.table[i], seq.hashes[i], parent, tuple(seq.tokens[i * bs:(i + 1) * bs]))
        seq.num_registered = num_full

    # ------------------------------------------------------------------ scheduling

    def _layout(self) -> None:
        """Refresh the decoding / prefilling lists (admission order) if rows or prefills changed them."""
        if not self._layout_stale:
            return
        self._decoding, self._prefilling = [], []
        self._decode_rows = 0
        for seq in sorted(self._running.values(), key=lambda s: s.admitted):
            if len(seq.tokens) - seq.num_computed == 1:
                self._decoding.append(seq)
                self._decode_rows = max(self._decode_rows, seq.row + 1)
                if not seq.ready:
                    self._block_checks[seq] = None
            else:
                self._prefilling.append(seq)
        self._layout_stale = False
        self._layout_version += 1

    def _reserve_decode(self) -> tuple[list[_Sequence], int]:
        """The decode set, oldest first, each with a writable block for its new token, and the
        number of rows it spans.

        Only sequences in `_block_checks` can need a block (a new one, or a private copy of a shared
        one): the others write into the block they wrote last step, which nothing else can have
        referenced or cached since (blocks are shared or registered only once full or at a fork).
        """
        self._layout()
        if self._block_checks:
            bs, rows, blocks = self.block_size, self._rows, self.blocks
            copies: tuple[list[int], list[int]] = ([], [])
            for seq in sorted(self._block_checks, key=lambda s: s.admitted):
                if seq.row < 0 or len(seq.tokens) - seq.num_computed != 1:
                    continue  # finished, preempted meanwhile, or still prefilling
                if len(seq.tokens) + seq.inflight >= seq.limit:
                    continue  # ends by length when its in-flight token lands: not fed again
                p = seq.num_computed + seq.inflight  # the position its next launch feeds
                index = p // bs
                while True:
                    needs = index == len(seq.table) or blocks.ref[seq.table[index]] > 1
                    if not needs or blocks.num_free > 0:
                        break
                    victim = max(self._running.values(), key=lambda s: s.admitted)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.row < 0:
                    continue
                r = seq.row
                if index == len(seq.table):
                    seq.table.append(blocks.allocate())
                    changed = True
                else:
                    source = blocks.writable(seq.table, index)
                    changed = source is not None
                    if changed:
                        copies[0].append(source)
                        copies[1].append(seq.table[index])
                if not seq.ready:
                    for i, block in enumerate(seq.table):
                        rows.table_updates += (r, i, block)
                    seq.ready = True
                elif changed:
                    rows.table_updates += (r, index, seq.table[index])
                # An in-flight token is fed from the device (follow); else the host knows it.
                rows.token[r], rows.follow[r] = (0, 1) if seq.inflight else (seq.tokens[p], 0)
                rows.position[r] = p
                rows.slot[r] = seq.table[index] * bs + p % bs
                rows.count[r] = len(seq.tokens) + seq.inflight - seq.num_prompt
            self._block_checks = {}
            self.kv.copy_blocks(*copies)
            self._layout()  # preemptions above changed the running set
        return self._decoding, self._decode_rows

    def _schedule_prefill(self) -> list[tuple[_Sequence, int]]:
        """Rows of this step's prefill: (sequence, tokens to compute now), blocks allocated."""
        rows: list[tuple[_Sequence, int]] = []
        budget = self.max_num_batched_tokens
        longest = 0

        def fits(n: int) -> bool:
            return not rows or (len(rows) + 1) * max(longest, n) <= self.max_num_batched_tokens

        def chunk(pending: int) -> int:
            # Never leave exactly one prompt token: a prompt must finish in a prefill, where a
            # leader forks its followers (a decode step would sample for the leader alone).
            n = min(pending, budget)
            return n - 1 if pending - n == 1 else n

        def grow(seq: _Sequence, n: int) -> bool:
            need = math.ceil((seq.num_computed + n) / self.block_size) - len(seq.table)
            if need > self.blocks.num_free:
                return False
            assert not seq.ready, "a decoding sequence has no prompt left to prefill"
            seq.table.extend(self.blocks.allocate() for _ in range(need))
            return True

        self._layout()
        for seq in self._prefilling:
            pending = len(seq.tokens) - seq.num_computed
            if budget == 0:
                continue
            n = chunk(pending)
            if not n or not fits(n) or not grow(seq, n):
                break
            rows.append((seq, n))
            budget -= n
            longest = max(longest, n)
        while self._waiting and self._free_rows and budget > 0:
            seq = self._waiting[0]
            matched = []
            if self.prefix_sharing:
                num_full = (len(seq.tokens) - 1) // self.block_size  # the last token is always computed
                seq.hashes = block_hashes(seq.tokens, self.block_size, num_full, seq.hashes)
                matched = self.blocks.match(seq.hashes[:num_full], seq.tokens)
            seq.table = matched
            seq.num_computed = len(matched) * self.block_size
            seq.num_registered = len(matched)
            n = chunk(len(seq.tokens) - seq.num_computed)
            if not n or not fits(n) or not grow(seq, n):
                self.blocks.hits -= len(matched)
                self.blocks.release(matched)
                seq.table, seq.num_computed = [], 0
                break
            self._waiting.popleft()
            self._take_row(seq)
            seq.cache_version = self.version
            while self.prefix_sharing and self._waiting and self._waiting[0].tokens == seq.tokens:
                seq.followers.append(self._waiting.popleft())
            rows.append((seq, n))
            budget -= n
            longest = max(longest, n)
        return rows

    # ------------------------------------------------------------------ forwards

    def _prefill(self, rows: list[tuple[_Sequence, int]]) -> list[Completion]:
        """One eager forward of the prefill rows; rows that complete sample their next token."""
        bs, device = self.block_size, self.device
        B, T = len(rows), max(n for _, n in rows)
        nb = max(len(seq.table) for seq, _ in rows)
        # Right-padded tokens, padded block tables, start positions and lengths in one host array
        # and one copy; positions and slots are derived on the device (no per-token Python).
        pad = [0] * max(T, nb)
        host = array("q")
        for seq, n in rows:
            host.extend(seq.tokens[seq.num_computed:seq.num_computed + n])
            host.extend(pad[:T - n])
        for seq, _ in rows:
            host.extend(seq.table)
            host.extend(pad[:nb - len(seq.table)])  # NULL_BLOCK
        host.extend([seq.num_computed for seq, _ in rows] + [n for _, n in rows])
        dev = torch.frombuffer(host, dtype=torch.long).to(device, non_blocking=True)
        tokens = dev[:B * T].view(B, T)
        tables = dev[B * T:B * (T + nb)].view(B, nb)
        starts, lengths = dev[B * (T + nb):].view(2, B)
        offsets = torch.arange(T, device=device)
        positions = starts[:, None] + offsets  # (B, T); pads continue their row's positions
        blocks = tables.gather(1, (positions // bs).clamp(max=nb - 1))
        slots = torch.where(offsets < lengths[:, None], blocks * bs + positions % bs, NULL_BLOCK)  # pads: null block
        fresh = all(seq.num_computed == 0 for seq, _ in rows)
        attn = PagedAttention(self.kv, slots, positions, tables.to(torch.int32), fresh=fresh)
        hidden = self.model.hidden(tokens, positions, attn)  # (B, T, dim)
        self.num_prefill_tokens += sum(n for _, n in rows)

        self._layout_stale = True  # rows move from prefilling to decoding
        done_rows, last = [], []
        for i, (seq, n) in enumerate(rows):
            seq.num_computed += n
            self._register(seq)
            if seq.num_computed == len(seq.tokens):
                done_rows.append(i)
                last.append(n - 1)
        if not done_rows:
            return []
        index = torch.tensor(done_rows, device=device)
        logits = F.linear(hidden[index, torch.tensor(last, device=device)], self.model.output_weight)  # (D, V)
        samplers, logit_rows = [], []
        for j, i in enumerate(done_rows):
            seq = rows[i][0]
            samplers.append(seq)
            logit_rows.append(j)
            for follower in self._fork(seq):
                samplers.append(follower)
                logit_rows.append(j)
        if len(logit_rows) != len(done_rows):
            logits = logits[torch.tensor(logit_rows, device=device)]
        batch = SamplingBatch.build([s.request.sampling for s in samplers], [s.seed for s in samplers], device)
        return self._append(samplers, logits, batch)

    def _fork(self, leader: _Sequence) -> list[_Sequence]:
        """Followers take the leader's computed prompt (shared blocks) and a row each; the rest requeue."""
        forked = []
        while leader.followers and self._free_rows:
            seq = leader.followers.pop(0)
            for block in leader.table:
                self.blocks.incref(block)
            seq.table = list(leader.table)
            seq.hashes = list(leader.hashes)
            seq.num_computed = leader.num_computed
            seq.num_registered = leader.num_registered
            seq.cache_version = leader.cache_version
            self._take_row(seq)
            forked.append(seq)
        self._requeue_followers(leader)
        return forked

    def _launch_decode(self, seqs: list[_Sequence], num_rows: int) -> _Launch:
        """Queue one token for every sequence of the decode set (rows < num_rows) and advance the
        rows' host inputs to the next position; the tokens are read by `_complete_decode`.

        A sequence whose in-flight token (from the previous launch) ends it by length is not fed
        again: its row is a pad in this launch. One stopped by a stop token is not known yet and
        computes one wasted position, which the completion drops (its epoch changed).
        """
        bs, rows = self.block_size, self._rows
        fed = []
        for seq in seqs:
            if len(seq.tokens) + seq.inflight < seq.limit:
                fed.append(seq)
            else:
                rows.clear(seq.row)
        B = next(b for b in self._buckets if b >= num_rows) if self.cuda_graphs else num_rows
        if self.attention == "triton":
            nb = self.max_blocks  # the kernel stops at each row's own length
        else:
            needed = max(rows.position[:B]) // bs + 1  # pad rows sit at position 0
            nb = min(1 << (needed - 1).bit_length(), self.max_blocks) if self.cuda_graphs else needed
        key = (B, self._layout_version)
        if key != self._sampling_key:  # the decode set changed; built before the forward is queued
            params: list[SamplingParams | None] = [None] * B  # pad rows
            seeds = [0] * B
            for seq in seqs:
                params[seq.row], seeds[seq.row] = seq.request.sampling, seq.seed
            self._sampling_batch = SamplingBatch.build(params, seeds, self.device)
            if self.cuda_graphs:
                self._static_sampling.load(self._sampling_batch)
            self._sampling_key = key
        if self.cuda_graphs:
            # The graph runs the forward and the sampler: one launch for the whole step.
            key = (B, nb, self._sampling_batch.mode())
            if key not in self._graphs:
                self._capture(*key)
            graph, (tokens, logprobs) = self._graphs[key]
            rows.push(B)
            graph.replay()
        else:
            rows.push(B)
            tokens, logprobs = sample(self._decode_forward(B, nb), self._sampling_batch, rows.inputs[3, :B, 0])
        out = self._samples(tokens, logprobs)  # (2, B); every rank of a TP replica feeds rank 0's tokens
        rows.last[:B].copy_(out[0])
        event = None
        if self.device.type == "cuda":
            host = self._host_out[self._host_flip][:, :B]
            self._host_flip ^= 1
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = out

        # Next launch's inputs: the position after this one, its token fed from the device; a new
        # block (and so a new slot) at a block boundary is _reserve_decode's work.
        token_in, position_in, slot_in, count_in, follow = rows.token, rows.position, rows.slot, rows.count, rows.follow
        check = self._block_checks
        for seq in fed:
            r = seq.row
            seq.inflight += 1
            p = position_in[r] + 1
            token_in[r], follow[r], position_in[r] = 0, 1, p
            slot_in[r] += 1
            count_in[r] += 1
            if not p % bs:
                check[seq] = None
        return _Launch(fed, [seq.row for seq in fed], [seq.epoch for seq in fed], self.version, host, event)

    def _complete_decode(self, launch: _Launch) -> list[Completion]:
        """Append a launch's tokens to its sequences that still hold their row; finish them."""
        if launch.event is not None:
            launch.event.synchronize()
        sampled, sampled_logprobs = launch.host[0].long().tolist(), launch.host[1].tolist()
        finished = []
        bs, version = self.block_size, launch.version
        for seq, r, epoch in zip(launch.seqs, launch.rows, launch.epochs):  # keep this loop lean
            if seq.epoch != epoch:
                continue  # finished, aborted or preempted since the launch: its token is dropped
            seq.inflight -= 1
            token = sampled[r]
            tokens = seq.tokens
            tokens.append(token)
            seq.logprobs.append(sampled_logprobs[r])
            seq.versions.append(version)
            p = seq.num_computed + 1
            seq.num_computed = p
            if not p % bs:  # a block just filled
                self._register(seq)
            n = len(tokens)
            if n - seq.num_prompt == 1:  # a prompt whose last token a decode step computed
                self.num_first_tokens += 1
            sampling = seq.request.sampling
            if token in sampling.stop_token_ids or (sampling.stop and self._stop_string(seq)):
                finished.append(self._finish(seq, "stop"))
            elif n >= seq.limit:
                finished.append(self._finish(seq, "length"))
        return finished

    def _decode_forward(self, B: int, nb: int) -> torch.Tensor:
        """The decode forward over rows [0, B) of the buffers -> logits (B, V): what a graph captures."""
        inputs = self._rows.inputs
        attn = PagedAttention(self.kv, inputs[2, :B], inputs[1, :B], self._rows.tables[:B, :nb],
                              self._rows.context_lens[:B], backend=self.attention)
        hidden = self.model.hidden(inputs[0, :B], inputs[1, :B], attn)  # (B, 1, dim)
        return F.linear(hidden[:, -1], self.model.output_weight)

    def _capture(self, B: int, nb: int, mode: tuple) -> None:
        """Capture the decode forward for B rows and nb blocks and the sampler of `mode` over its
        logits (reading the static sampling buffers); pads write only to the null block."""
        self._rows.inputs[:, :B].zero_()
        self._rows.context_lens[:B].fill_(1)
        batch = self._static_sampling.view(B, mode)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return sample(self._decode_forward(B, nb), batch, self._rows.inputs[3, :B, 0])

        if self.device.type != "cuda":  # tests exercise the static-buffer logic on CPU
            graph = _EmulatedGraph(step)
            self._graphs[(B, nb, mode)] = (graph, graph.out)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the triton kernels, create cuBLAS workspaces: outside the capture
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = step()
        self._graphs[(B, nb, mode)] = (graph, out)

    # ------------------------------------------------------------------ sampling and stopping

    def _append(self, seqs: list[_Sequence], logits: torch.Tensor, batch: SamplingBatch) -> list[Completion]:
        """Sample seqs[i] from logits row i (a prefill's samplers), append, finish."""
        counters = torch.tensor([len(s.tokens) - s.num_prompt for s in seqs], device=self.device)
        tokens, logprobs = sample(logits, batch, counters)
        finished = []
        for seq, token, logprob in zip(seqs, *self._to_host(tokens, logprobs)):
            seq.tokens.append(int(token))
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            self.num_first_tokens += len(seq.tokens) - seq.num_prompt == 1
            reason = self._finish_reason(seq)
            if reason is not None:
                finished.append(self._finish(seq, reason))
        return finished

    def _samples(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """tokens, logprobs (B,) -> one (2, B) float64 device buffer (fp32 logprobs and token ids are
        exact in it: one device-to-host copy). In a tensor-parallel replica the group's first
        rank's samples are broadcast, so every rank appends the same tokens and its scheduler stays
        in lockstep with the others."""
        out = torch.empty((2, tokens.shape[0]), dtype=torch.float64, device=self.device)
        out[0].copy_(tokens)
        out[1].copy_(logprobs)
        if self.tp_group is not None:
            torch.distributed.broadcast(out, group=self.tp_group, group_src=0)
        return out

    def _to_host(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
        """`_samples` copied to the host and waited for (the prefill's samples)."""
        out = self._samples(tokens, logprobs).cpu()
        return out[0].long().tolist(), out[1].tolist()

    def _finish_reason(self, seq: _Sequence) -> FinishReason | None:
        sampling = seq.request.sampling
        if seq.tokens[-1] in sampling.stop_token_ids:
            return "stop"
        if sampling.stop and self._stop_string(seq):
            return "stop"
        if len(seq.tokens) >= seq.limit:
            return "length"
        return None

    def _stop_string(self, seq: _Sequence) -> bool:
        """Whether the tail of the completion contains one of the request's stop strings."""
        stop = seq.request.sampling.stop
        window = max(len(s) for s in stop) + 4  # tokens are rarely shorter than one character
        tail = self.detokenize(seq.tokens[max(len(seq.tokens) - window, seq.num_prompt):])
        return any(s in tail for s in stop)


class _EmulatedGraph:
    """A CPU stand-in for a captured CUDA graph (tests): `replay` reruns the step and writes its
    results into the tensors the capture returned, which is what a graph replay does."""

    def __init__(self, step: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.step = step
        self.out = step()

    def replay(self) -> None:
        for out, new in zip(self.out, self.step()):
            out.copy_(new)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_model_fits(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError before moving a model that cannot fit the device's free memory."""
    if device.type != "cuda":
        return
    need = sum(p.numel() * dtype.itemsize for p in model.parameters() if p.device != device)
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise ValueError(f"the model needs {need / 2**30:.2f} GiB in {dtype} but {device} has only "
                         f"{free / 2**30:.2f} of {total / 2**30:.2f} GiB free")
