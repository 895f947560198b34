"""The native engine's scheduler: host bookkeeping of every sequence, and what each step computes.

It owns the queues (waiting, running by row, live by request), the rows (a heap of free ones:
lowest rows first keeps decode batches dense, and a sparse tail is moved down: `compact_rows`),
the block tables (runtime/engine/kv_cache.py's
`BlockManager` and prefix cache), the host side of the decode rows' inputs, the stop rules'
outcome (finish, abort, free) and the invariant checks. Forwards are runtime/engine/runner.py's.

Of one step (the five stages are listed in runtime/engine/native.py) the scheduler does stage 1,
the decode set with a writable block for every row (copy-on-write, preemption of the newest
sequence when blocks run out), stage 2, the prefill set admitted FIFO under the row, block and
`max_num_batched_tokens` budgets (prefix-cache hits shared, not recomputed), and the bookkeeping
after each forward: append the tokens, apply the stop rules, free what finished.

Host work of a decode step is one Python pass over the decode set (append the sampled token,
check the stop rules, store the row's next token / position / slot / counter in host arrays).
Only sequences that just started decoding or whose next token starts a block are looked at for
blocks (`_block_checks`); the decoding and prefilling lists, and the decode sampling batch, are
rebuilt only when a row changes hands or a prefill ran (`layout_version`).

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

Weight versions (native.py's "Weights"): tokens record the version they were sampled with; the
prefix cache is dropped on a version change, and a sequence whose k/v predate the current version
never registers its blocks.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

from meshrl.runtime.engine.api import Completion, FinishReason
from meshrl.runtime.engine.kv_cache import BlockManager, KVCache, block_hashes
from meshrl.runtime.engine.runner import DecodeRows
from meshrl.runtime.engine.sequence import Sequence


class Scheduler:
    """Sequences, rows and blocks of one engine replica (see the module docstring).

    blocks, kv: the block manager and the cache it hands out (the scheduler queues copy-on-write
    copies in it). rows: the runner's decode rows, whose host inputs the scheduler keeps.
    Every rank of a tensor-parallel replica runs one, on the same requests and tokens.
    """

    def __init__(self, blocks: BlockManager, kv: KVCache, rows: DecodeRows, *, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_sharing: bool,
                 detokenize: Callable[[list[int]], str] | None, compact_rows: bool = True) -> None:
        self.blocks, self.kv, self.rows = blocks, kv, rows
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_sharing, self.compact_rows = prefix_sharing, compact_rows
        self.detokenize = detokenize
        self.version = 0
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence
        self.live: dict[int, list[Sequence]] = {}  # request_id -> its live samples
        self.free_rows = list(range(max_num_seqs))  # a heap: lowest rows first keeps decode batches dense
        self._stamp = 0
        self.num_preemptions = 0
        self.num_first_tokens = 0
        # Running sequences in admission order, split into decoding (one uncomputed token) and
        # prefilling; rebuilt only when a row is taken or freed or a prefill ran.
        self._decoding: list[Sequence] = []
        self._prefilling: list[Sequence] = []
        self._decode_rows = 0  # rows [0, _decode_rows) hold every decoding sequence
        self._layout_stale = False
        # Decoding sequences to look at in the next reserve_decode: new ones, and ones whose next
        # token starts a block. Every other one writes into a block it already owns alone.
        self._block_checks: dict[Sequence, None] = {}
        self.layout_version = 0  # bumped at every rebuild: the decode sampling batch follows it

    # ------------------------------------------------------------------ requests

    def set_version(self, version: int) -> None:
        """Tokens appended from now on record this weight version; drops the prefix cache."""
        if version != self.version:
            self.blocks.clear_prefix_cache()
        self.version = version

    def add(self, request_id: int, samples: list[Sequence]) -> None:
        """Queue a request's samples (new sequences, in index order)."""
        self.waiting.extend(samples)
        self.live[request_id] = samples

    def abort(self, request_id: int) -> list[Completion] | None:
        """Drop every sample of a live request and free its blocks -> their abort completions."""
        samples = self.live.pop(request_id, None)
        if samples is None:
            return None
        for seq in samples:
            self._drop(seq)
        return [seq.completion("abort") for seq in samples]

    # ------------------------------------------------------------------ handoffs (runtime/engine/disagg.py)

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence with no decode in flight out of this scheduler (row freed, no longer
        live), keeping its blocks and tokens: a prefill replica hands it to a decode replica."""
        assert not seq.inflight, "a sequence with a decode launch in flight cannot leave"
        self._free_row(seq)
        self._unlive(seq)

    def adopt(self, seq: Sequence, run: bool) -> None:
        """Make a sequence computed elsewhere live here. run: its block table is attached and holds
        the k/v of every token but the last, so it takes a row (as a fork does) and registers its
        full blocks (same-version k/v only); else it waits to be recomputed, as a preempted one does."""
        self.live.setdefault(seq.request.request_id, []).append(seq)
        if run:
            self._take_row(seq)
            self._register(seq)
        else:
            self.waiting.append(seq)

    # ------------------------------------------------------------------ rows and blocks

    def _take_row(self, seq: Sequence) -> None:
        seq.row = heapq.heappop(self.free_rows)
        seq.admitted = self._stamp
        self._stamp += 1
        self.running[seq.row] = seq
        self._layout_stale = True

    def _free(self, seq: Sequence) -> None:
        """Give back the sequence's blocks and row (it stays in live)."""
        self.blocks.release(seq.table)
        seq.table = []
        seq.num_computed = seq.num_registered = seq.inflight = 0
        seq.ready = False
        seq.epoch += 1
        self._free_row(seq)

    def _free_row(self, seq: Sequence) -> None:
        if seq.row >= 0:
            del self.running[seq.row]
            heapq.heappush(self.free_rows, seq.row)
            self.rows.clear(seq.row)
            self._layout_stale = True
            seq.row = -1

    def _unlive(self, seq: Sequence) -> None:
        samples = self.live[seq.request.request_id]
        samples.remove(seq)
        if not samples:
            del self.live[seq.request.request_id]

    def _requeue_followers(self, seq: Sequence) -> None:
        for follower in reversed(seq.followers):
            self.waiting.appendleft(follower)
        seq.followers = []

    def _drop(self, seq: Sequence) -> None:
        """Remove a sequence from wherever it is (waiting, running, or following a leader)."""
        if seq.row >= 0:
            self._free(seq)
            self._requeue_followers(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for leader in self.running.values():
                if seq in leader.followers:
                    leader.followers.remove(seq)
                    break

    def _finish(self, seq: Sequence, reason: FinishReason) -> Completion:
        self._free(seq)
        self._unlive(seq)
        return seq.completion(reason)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it goes back to the front of the queue, keeping its tokens."""
        self.num_preemptions += 1
        self._free(seq)
        self._requeue_followers(seq)
        self.waiting.appendleft(seq)

    def _register(self, seq: Sequence) -> None:
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
        for seq in sorted(self.running.values(), key=lambda s: s.admitted):
            if len(seq.tokens) - seq.num_computed == 1:
                self._decoding.append(seq)
                self._decode_rows = max(self._decode_rows, seq.row + 1)
                if not seq.ready:
                    self._block_checks[seq] = None
            else:
                self._prefilling.append(seq)
        self._layout_stale = False
        self.layout_version += 1

    def reserve_decode(self) -> tuple[list[Sequence], int]:
        """The decode set, oldest first, each with a writable block for its new token, and the
        number of rows it spans (after `compact_rows`).

        Only sequences in `_block_checks` can need a block (a new one, or a private copy of a shared
        one): the others write into the block they wrote last step, which nothing else can have
        referenced or cached since (blocks are shared or registered only once full or at a fork).
        """
        compact_rows(self)
        self._layout()
        if self._block_checks:
            bs, rows, blocks = self.block_size, self.rows, self.blocks
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
                    victim = max(self.running.values(), key=lambda s: s.admitted)
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
                    rows.refills.append(r)
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

    def schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """Rows of this step's prefill: (sequence, tokens to compute now), blocks allocated."""
        rows: list[tuple[Sequence, int]] = []
        budget = self.max_num_batched_tokens
        longest = 0

        def fits(n: int) -> bool:
            return not rows or (len(rows) + 1) * max(longest, n) <= self.max_num_batched_tokens

        def chunk(pending: int) -> int:
            # Never leave exactly one prompt token: a prompt must finish in a prefill, where a
            # leader forks its followers (a decode step would sample for the leader alone).
            n = min(pending, budget)
            return n - 1 if pending - n == 1 else n

        def grow(seq: Sequence, n: int) -> bool:
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
        while self.waiting and self.free_rows and budget > 0:
            seq = self.waiting[0]
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
            self.waiting.popleft()
            self._take_row(seq)
            seq.cache_version = self.version
            while self.prefix_sharing and self.waiting and self.waiting[0].tokens == seq.tokens:
                seq.followers.append(self.waiting.popleft())
            rows.append((seq, n))
            budget -= n
            longest = max(longest, n)
        return rows

    # ------------------------------------------------------------------ after a prefill

    def prefilled(self, rows: list[tuple[Sequence, int]]) -> tuple[list[int], list[int], list[Sequence], list[int]]:
        """Record a prefill's computed tokens -> the rows (indices into `rows`) whose prompt is now
        computed and the offset of each one's last token in the forward; the sequences that sample
        from those rows' logits (each leader, then the followers it forks, a row each) and, for
        each of them, which done row it samples from."""
        self._layout_stale = True  # rows move from prefilling to decoding
        done_rows, last = [], []
        for i, (seq, n) in enumerate(rows):
            seq.num_computed += n
            self._register(seq)
            if seq.num_computed == len(seq.tokens):
                done_rows.append(i)
                last.append(n - 1)
        samplers, logit_rows = [], []
        for j, i in enumerate(done_rows):
            seq = rows[i][0]
            samplers.append(seq)
            logit_rows.append(j)
            for follower in self._fork(seq):
                samplers.append(follower)
                logit_rows.append(j)
        return done_rows, last, samplers, logit_rows

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """Followers take the leader's computed prompt (shared blocks) and a row each; the rest requeue."""
        forked = []
        while leader.followers and self.free_rows:
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

    def append(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> list[Completion]:
        """Append a prefill's samples (seqs[i] sampled tokens[i]) and finish the sequences they end."""
        finished = []
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.tokens.append(int(token))
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            self.num_first_tokens += len(seq.tokens) - seq.num_prompt == 1
            reason = seq.finish_reason(self.detokenize)
            if reason is not None:
                finished.append(self._finish(seq, reason))
        return finished

    # ------------------------------------------------------------------ around a decode launch

    def feedable(self, seqs: list[Sequence]) -> list[Sequence]:
        """The decode set's sequences that the next launch feeds. One whose in-flight token (from the
        previous launch) ends it by length is not fed again: its row is a pad in this launch."""
        rows, fed = self.rows, []
        for seq in seqs:
            if len(seq.tokens) + seq.inflight < seq.limit:
                fed.append(seq)
            else:
                rows.clear(seq.row)
        return fed

    def advance(self, fed: list[Sequence]) -> None:
        """After a launch: the fed rows' next inputs are the position after this one, its token fed
        from the device; a new block (and so a new slot) at a block boundary is reserve_decode's work."""
        bs, rows = self.block_size, self.rows
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

    def complete(self, seqs: list[Sequence], rows: list[int], epochs: list[int], version: int,
                 sampled: list[int], sampled_logprobs: list[float]) -> list[Completion]:
        """Append a launch's tokens (sampled[row]) to its sequences that still hold their row (same
        epoch as at the launch); finish the ones they end."""
        finished = []
        bs, detokenize = self.block_size, self.detokenize
        for seq, r, epoch in zip(seqs, rows, epochs):  # keep this loop lean
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
            if token in sampling.stop_token_ids or (sampling.stop and seq.stop_string(detokenize)):
                finished.append(self._finish(seq, "stop"))
            elif n >= seq.limit:
                finished.append(self._finish(seq, "length"))
        return finished


def compact_rows(s: Scheduler) -> None:
    """Move the running sequences on rows >= n (n running in all) into the free rows below n,
    when the rows in use span at least twice n (and more than 8), unless `s.compact_rows` (the
    Scheduler argument; the engine turns it off for models with per-row recurrent states) is off.
    A decode launch spans rows 0 to the highest live one, so without this a batch's tail of a few
    long sequences on high rows keeps running the widest decode graph. A moved sequence's row
    inputs and whole block table are sent again (`ready` off: reserve_decode's path for a sequence
    that starts decoding), and a token still in flight for it is carried on the device to its new
    row (`DecodeRows.moves`). Rare by design: the 2x margin means a move halves the span at least."""
    if not s.compact_rows or not s.running:
        return
    n = len(s.running)
    span = max(s.running) + 1
    if span <= 8 or span < 2 * n:
        return
    movers = sorted(r for r in s.running if r >= n)
    targets = sorted(r for r in s.free_rows if r < n)  # exactly as many as movers
    for old, new in zip(movers, targets):
        seq = s.running.pop(old)
        s.rows.clear(old)
        if seq.inflight:
            s.rows.moves += (old, new)
        seq.row, seq.ready = new, False
        s.running[new] = seq
    s.free_rows = [r for r in s.free_rows if r >= n] + movers
    heapq.heapify(s.free_rows)
    s._layout_stale = True


def check(s: Scheduler) -> None:
    """Assert a scheduler's bookkeeping invariants between steps: blocks, and every row's host inputs
    and device block table against its sequence (for tests; `NativeEngine.check`)."""
    s.blocks.check()
    bs, rows = s.block_size, s.rows
    assert not rows.table_updates, "block-table edits left unsent"
    tables = rows.tables.tolist()
    for r in range(s.max_num_seqs):
        seq = s.running.get(r)
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
        if seq not in s._block_checks:  # else the next reserve_decode gives it a block
            block = seq.table[p // bs]
            assert s.blocks.ref[block] == 1 and block not in s.blocks.info, "writes into a shared block"
            assert inputs[2] == block * bs + p % bs, f"row {r}: slot {inputs[2]} is not position {p}'s"
