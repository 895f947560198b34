"""The native engine's model runner: every forward of the model and every copy between host and
device. It decides nothing; runtime/engine/scheduler.py chooses what each forward computes.

- prefill    one forward of the prefill set (right-padded (B, T); SDPA without its cuDNN
             backend, see `_PREFILL_SDPA`): tokens, block tables,
             start positions and lengths go to the device in one host array and one copy, and
             positions and slots are derived there (no per-token Python); the logits of the rows
             whose prompt is done. On CUDA a small prefill (at most `_PREFILL_GRAPH_ROWS[-1]`
             rows of `_PREFILL_GRAPH_TOKENS[-1]` tokens) replays a graph captured per padded
             (rows, tokens) bucket, and, over a cached prefix (a multi-turn continuation), per
             power-of-two block count too: eagerly, such a forward is bound by the host
             launching its ~15 kernels per layer (continuous refill prefills one or two new
             requests at a time). Larger prefills run eagerly.
- decode     one forward of the decode set, one token per row, over persistent device buffers
             (`DecodeRows`: token, position, slot, sampling counter, block table, context length
             per row). On CUDA a captured graph per (bucketed batch, bucketed block count,
             sampling mode) replays the whole forward and the sampler (models/common/fused.py
             kernels inside it) and reads the static sampling buffers; on CPU tests
             `_EmulatedGraph` stands in for it. Without graphs the forward runs eagerly.
- samples    tokens and logprobs of either forward in one (2, B) float64 buffer, broadcast from
             the first rank of a tensor-parallel replica so every rank appends the same tokens;
             a decode's copy to the host goes to one of two pinned buffers and is waited for by a
             CUDA event only when the next step reads it (one-step lookahead,
             runtime/engine/native.py).

The model has no cache of its own: it calls `attn.attend(layer_id, q, k, v)` in every layer and
runtime/engine/kv_cache.py's `PagedAttention` writes k/v into the blocks and attends over them.
Weight sync copies new weights into the model's parameters in place, so the graphs keep reading
the right storages.
"""

from __future__ import annotations

import logging
import os
from array import array
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshrl.runtime.engine.dense_decode import DenseDecode, DenseRows, dense_rows_fit
from meshrl.runtime.engine.kv_cache import NULL_BLOCK, KVCache, PagedAttention
from meshrl.runtime.engine.recurrent_state import HybridPagedAttention, RecurrentStates
from meshrl.runtime.engine.sampling import SamplingBatch, SamplingParams, StaticSamplingBatch, sample
from meshrl.runtime.engine.sequence import Sequence

logger = logging.getLogger(__name__)


# Prefill attention may not take cuDNN's SDPA, which torch 2.11 ranks first on Hopper: on an H200
# a prefill step paid 40-150 ms with it, whatever its token count, against ~28 ms without, when
# nearly every step's (B, T) was new (continuous refill: 0.6B refill workload 3.9k -> 9.7k tok/s,
# docs/benchmarks.md 2026-12-02), consistent with a plan built per new shape.
_PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# The padded (rows, tokens) a prefill graph is captured for: rows and tokens round up to the next
# entry (tokens by ~1.5x steps, so padding at most half the row), and a bucket holds at most
# _PREFILL_GRAPH_MAX_TOKENS tokens. Over a cached prefix the block count rounds up to a power of
# two as well, and attention's (query, key) pairs, rows x tokens x blocks x block size, stay within
# _PREFILL_GRAPH_MAX_PAIRS (the torch path holds their scores: the graph pool keeps that memory).
# MESHRL_PREFILL_GRAPHS=0 turns them off (to compare).
_PREFILL_GRAPH_ROWS = (1, 2, 4, 8)
_PREFILL_GRAPH_TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_PREFILL_GRAPH_MAX_TOKENS = 2048
_PREFILL_GRAPH_MAX_PAIRS = 1 << 19


def _batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    sizes += list(range(160, max_num_seqs + 64, 32 if max_num_seqs <= 512 else 64))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeRows:
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
        self.moves: list[int] = []  # from, to, ...: rows whose in-flight token (`last`) moves with its sequence
        self.refills: list[int] = []  # rows whose whole table was queued: their dense k/v are refilled
        self.inputs = torch.zeros((4, num_rows, 1), dtype=torch.long, device=device)  # token, position, slot, count
        self.context_lens = torch.ones(num_rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros((num_rows, max_blocks), dtype=torch.int32, device=device)
        self.last = torch.zeros(num_rows, dtype=torch.long, device=device)  # tokens of the last launch

    def clear(self, row: int) -> None:
        self.token[row] = self.position[row] = self.slot[row] = self.count[row] = self.follow[row] = 0

    def push(self, B: int) -> None:
        """Copy rows [0, B) and the queued block-table entries to the device buffers, after the
        in-flight tokens of rows the scheduler moved (`moves`) are carried to their new rows."""
        staged = (self.token[:B] + self.position[:B] + self.slot[:B] + self.count[:B] + self.follow[:B]
                  + array("q", self.moves) + array("q", self.table_updates))
        # From pageable memory: a small copy is staged by the driver and does not wait for the graph
        # in flight (38 us on an H200). A ring of pinned staging buffers measured slower (docs/benchmarks.md,
        # 2026-12-02 evening: plain_8 1.89-2.03 vs 1.69-1.70 ms a step).
        dev = torch.frombuffer(staged, dtype=torch.long).to(self.inputs.device, non_blocking=True)
        self.inputs[:, :B, 0].copy_(dev[:4 * B].view(4, B))
        end = 5 * B
        if self.moves:  # before the rows read `last`: a moved row's in-flight token
            end += len(self.moves)
            moves = dev[5 * B:end].view(-1, 2)
            self.last[moves[:, 1]] = self.last[moves[:, 0]]
            self.moves = []
        self.inputs[0, :B, 0].copy_(torch.where(dev[4 * B:5 * B].bool(), self.last[:B], self.inputs[0, :B, 0]))
        torch.add(dev[B:2 * B], 1, out=self.context_lens[:B])
        if self.table_updates:
            updates = dev[end:].view(-1, 3)
            self.tables.index_put_((updates[:, 0], updates[:, 1]), updates[:, 2].to(torch.int32))
            self.table_updates = []


class ModelRunner:
    """Runs the model for the native engine: prefill forwards, decode launches (CUDA graphs or
    eager), sampling, and the samples' way to the host (see the module docstring).

    model: the engine's models/ module, already on `device` in its dtype, eval and frozen.
    kv: the paged cache. max_blocks: block-table width of one row. attention: the decode attention
    backend ("torch" or "triton"). cuda_graphs: capture decode forwards (CUDA; tests turn it on
    for CPU, where graphs are emulated). tp_group: the tensor-parallel group whose first rank's
    samples every rank takes, or None.
    """

    def __init__(self, model: nn.Module, kv: KVCache, *, max_num_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device, attention: Literal["torch", "triton"], cuda_graphs: bool,
                 tp_group: torch.distributed.ProcessGroup | None, states: RecurrentStates | None = None) -> None:
        self.model = model
        self.states = states  # linear-attention layers' per-row states (None: the model has none)
        self.kv = kv
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.attention = attention
        self.cuda_graphs = cuda_graphs
        self.tp_group = tp_group
        # Persistent decode inputs, one entry per row (the scheduler writes their host side).
        self.rows = DecodeRows(max_num_seqs, max_blocks, device)
        # CPU decode attention over a dense copy of the rows' k/v (runtime/engine/dense_decode.py).
        self.dense = DenseRows(kv, max_num_seqs, max_blocks) if dense_rows_fit(kv, device, attention, states is not None) \
            else None
        self._buckets = _batch_buckets(max_num_seqs)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        # prefill graphs by (padded rows, padded tokens, table blocks, fresh): (graph, its input
        # buffer, its hidden output)
        self.prefill_graphs: dict[tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # Whenever decode graphs are on (`cuda_graphs`), on CUDA, unless MESHRL_PREFILL_GRAPHS=0 or a
        # capture was refused; CPU tests set it to run the emulation.
        self.graph_prefill = device.type == "cuda" and os.environ.get("MESHRL_PREFILL_GRAPHS") != "0"
        self._graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.static_sampling = StaticSamplingBatch(max_num_seqs, device) if cuda_graphs else None
        self._host_out = [torch.empty((2, max_num_seqs), dtype=torch.float64, pin_memory=True)
                          for _ in range(2)] if device.type == "cuda" else []  # two: a launch's copy never overwrites unread tokens
        self._host_flip = 0
        self._row_ids = torch.arange(max_num_seqs, device=device)  # decode row b is state slot b
        self._sampling_key: tuple[int, int] | None = None
        self._sampling_batch: SamplingBatch | None = None

    # ------------------------------------------------------------------ prefill

    def prefill_forward(self, rows: list[tuple[Sequence, int]]) -> torch.Tensor:
        """One forward of the prefill rows (sequence, tokens to compute now) -> hidden (B, T, dim):
        a captured graph's output for a small prefill on CUDA (module docstring), else eager.
        A graph's output is overwritten by its next replay: read it before the next prefill."""
        B, T = len(rows), max(n for _, n in rows)
        fresh = all(seq.num_computed == 0 for seq, _ in rows)
        nb = max(len(seq.table) for seq, _ in rows)
        graphs = self.graph_prefill and self.cuda_graphs and self.states is None
        key = self._prefill_graph_key(B, T, nb, fresh) if graphs else None
        if key is not None and key not in self.prefill_graphs:
            try:
                self._capture_prefill(*key)
            except RuntimeError as e:  # a capture the device refused: prefills run eagerly from now on
                logger.warning("prefill graph %s not captured (%s: %s); this engine's prefills run eagerly", key,
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.graph_prefill = False
                key = None
        if key is None:
            dev = torch.frombuffer(self._prefill_inputs(rows, B, T, nb), dtype=torch.long).to(self.device,
                                                                                                non_blocking=True)
            return self._prefill_hidden(dev, B, T, nb, fresh, rows)
        graph, inputs, hidden = self.prefill_graphs[key]
        inputs.copy_(torch.frombuffer(self._prefill_inputs(rows, *key[:3]), dtype=torch.long), non_blocking=True)
        graph.replay()
        return hidden[:B, :T]

    def _prefill_graph_key(self, B: int, T: int, nb: int, fresh: bool) -> tuple[int, int, int, bool] | None:
        """The graph of B rows of up to T tokens whose longest block table has nb blocks, as
        (padded rows, padded tokens, table blocks, fresh), or None (eager). A fresh prefill's table
        is cut to the blocks its padded tokens reach; over a cached prefix, nb rounds up to a power
        of two (at most a row's table width)."""
        Bp = next((b for b in _PREFILL_GRAPH_ROWS if b >= B), None)
        Tp = next((t for t in _PREFILL_GRAPH_TOKENS if t >= T), None)
        if Bp is None or Tp is None or Bp * Tp > _PREFILL_GRAPH_MAX_TOKENS:
            return None
        if fresh:
            return Bp, Tp, -(-Tp // self.block_size), True
        nbp = min(1 << (nb - 1).bit_length(), self.max_blocks)
        if Bp * Tp * nbp * self.block_size > _PREFILL_GRAPH_MAX_PAIRS:
            return None
        return Bp, Tp, nbp, False

    @staticmethod
    def _prefill_inputs(rows: list[tuple[Sequence, int]], B: int, T: int, nb: int) -> array:
        """The host array of a prefill padded to B rows of T tokens and nb table blocks: tokens
        (B, T), block tables (B, nb), start positions (B,), lengths (B,). Pad rows and pad tokens are
        token 0 and the null block, pad rows start at 0 with length 0; a table longer than nb blocks
        keeps its first nb (a graph's rows reach no further)."""
        pad = [0] * max(T, nb)
        host = array("q")
        for seq, n in rows:
            host.extend(seq.tokens[seq.num_computed:seq.num_computed + n])
            host.extend(pad[:T - n])
        host.extend(pad[:T] * (B - len(rows)))
        for seq, _ in rows:
            table = seq.table[:nb]
            host.extend(table)
            host.extend(pad[:nb - len(table)])  # NULL_BLOCK
        host.extend(pad[:nb] * (B - len(rows)))
        host.extend([seq.num_computed for seq, _ in rows] + pad[:B - len(rows)] + [n for _, n in rows]
                    + pad[:B - len(rows)])
        return host

    def _prefill_hidden(self, dev: torch.Tensor, B: int, T: int, nb: int, fresh: bool,
                        rows: list[tuple[Sequence, int]] | None) -> torch.Tensor:
        """The prefill forward from its device inputs (`_prefill_inputs`' layout) -> hidden (B, T, dim).
        rows: the prefill rows (a model with recurrent states needs them; graphs pass None)."""
        bs, device = self.block_size, self.device
        tokens = dev[:B * T].view(B, T)
        tables = dev[B * T:B * (T + nb)].view(B, nb)
        starts, lengths = dev[B * (T + nb):].view(2, B)
        offsets = torch.arange(T, device=device)
        positions = starts[:, None] + offsets  # (B, T); pads continue their row's positions
        blocks = tables.gather(1, (positions // bs).clamp(max=nb - 1))
        slots = torch.where(offsets < lengths[:, None], blocks * bs + positions % bs, NULL_BLOCK)  # pads: null block
        if self.states is None:
            attn = PagedAttention(self.kv, slots, positions, tables.to(torch.int32), fresh=fresh)
        else:
            state_rows = torch.tensor([seq.row for seq, _ in rows], device=device)  # each row's state slot
            attn = HybridPagedAttention(self.kv, slots, positions, tables.to(torch.int32), fresh=fresh,
                                        states=self.states, rows=state_rows,
                                        fresh_rows=[seq.num_computed == 0 for seq, _ in rows],
                                        lengths=[n for _, n in rows])
        with sdpa_kernel(_PREFILL_SDPA):
            return self.model.hidden(tokens, positions, attn)  # (B, T, dim)

    def _capture_prefill(self, B: int, T: int, nb: int, fresh: bool) -> None:
        """Capture the prefill forward of B rows of T tokens and nb table blocks (fresh: no cached
        tokens) over a persistent input buffer. The buffer starts as pad rows (every slot and
        table entry the null block), so the warm-up runs and the capture write only the null block."""
        inputs = torch.zeros(B * (T + nb) + 2 * B, dtype=torch.long, device=self.device)

        graph, (hidden,) = self._graph_of(lambda: (self._prefill_hidden(inputs, B, T, nb, fresh, None),))
        self.prefill_graphs[(B, T, nb, fresh)] = (graph, inputs, hidden)

    def prefill_sample(self, hidden: torch.Tensor, done_rows: list[int], last: list[int], logit_rows: list[int],
                       samplers: list[Sequence]) -> tuple[list[int], list[float]]:
        """Sample samplers[i] from the logits at hidden[done_rows[logit_rows[i]], last[logit_rows[i]]]
        (a prompt's followers share its row) -> tokens and logprobs on the host."""
        device = self.device
        D, S = len(done_rows), len(samplers)
        # One upload: rows, last positions, logit rows and sampling counters.
        dev = torch.tensor(done_rows + last + logit_rows + [len(s.tokens) - s.num_prompt for s in samplers]).to(
            device, non_blocking=True)
        logits = F.linear(hidden[dev[:D], dev[D:2 * D]], self.model.output_weight)  # (D, V)
        if len(logit_rows) != D:
            logits = logits[dev[2 * D:2 * D + S]]
        batch = SamplingBatch.build([s.request.sampling for s in samplers], [s.seed for s in samplers], device)
        counters = dev[-S:]
        tokens, logprobs = sample(logits, batch, counters)
        out = self._samples(tokens, logprobs).cpu()
        return out[0].long().tolist(), out[1].tolist()

    # ------------------------------------------------------------------ decode

    def launch_decode(self, seqs: list[Sequence], num_rows: int, layout_version: int
                      ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue one decode forward and its sampler over rows [0, num_rows) (rounded up to a graph's
        batch bucket) from the rows' host inputs -> the (2, B) tokens / logprobs on their way to
        the host and the CUDA event that marks their arrival (None on CPU). The tokens also stay
        on the device (`rows.last`) for the next launch to feed. seqs: the decode set (their
        sampling batch is rebuilt when `layout_version` or the batch size changed)."""
        bs, rows = self.block_size, self.rows
        B = next(b for b in self._buckets if b >= num_rows) if self.cuda_graphs else num_rows
        if self.attention == "triton":
            nb = self.max_blocks  # the kernel stops at each row's own length
        else:
            needed = max(rows.position[:B]) // bs + 1  # pad rows sit at position 0
            nb = min(1 << (needed - 1).bit_length(), self.max_blocks) if self.cuda_graphs else needed
        key = (B, layout_version)
        if key != self._sampling_key:  # the decode set changed; built before the forward is queued
            params: list[SamplingParams | None] = [None] * B  # pad rows
            seeds = [0] * B
            for seq in seqs:
                params[seq.row], seeds[seq.row] = seq.request.sampling, seq.seed
            self._sampling_batch = SamplingBatch.build(params, seeds, self.device)
            if self.cuda_graphs:
                self.static_sampling.load(self._sampling_batch)
            self._sampling_key = key
        if self.cuda_graphs:
            # The graph runs the forward and the sampler: one launch for the whole step.
            key = (B, nb, self._sampling_batch.mode())
            if key not in self.graphs:
                self._capture(*key)
            graph, (tokens, logprobs) = self.graphs[key]
            self._push(B)
            graph.replay()
        else:
            self._push(B)
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
        return host, event

    def _push(self, B: int) -> None:
        """The rows' inputs to the device, then the dense k/v of rows that start decoding (CPU)."""
        rows = self.rows
        rows.push(B)
        if rows.refills and self.dense is not None:
            nb = max(rows.position[r] for r in rows.refills) // self.block_size + 1
            self.dense.refill(rows.refills, rows.tables, min(nb, self.max_blocks))
        rows.refills = []

    @staticmethod
    def read_decode(host: torch.Tensor, event: torch.cuda.Event | None) -> tuple[list[int], list[float]]:
        """A launch's (2, B) samples on the host, once they are there -> tokens and logprobs by row."""
        if event is not None:
            event.synchronize()
        return host[0].long().tolist(), host[1].tolist()

    def _decode_forward(self, B: int, nb: int) -> torch.Tensor:
        """The decode forward over rows [0, B) of the buffers -> logits (B, V): what a graph captures."""
        inputs = self.rows.inputs
        if self.states is None:
            dense = DenseDecode(self.dense, inputs[2, :B], inputs[1, :B], nb * self.block_size) if self.dense is not None else None
            attn = PagedAttention(self.kv, inputs[2, :B], inputs[1, :B], self.rows.tables[:B, :nb],
                                  self.rows.context_lens[:B], backend=self.attention, dense=dense)
        else:
            attn = HybridPagedAttention(self.kv, inputs[2, :B], inputs[1, :B], self.rows.tables[:B, :nb],
                                        self.rows.context_lens[:B], backend=self.attention, states=self.states,
                                        rows=self._row_ids[:B])
        hidden = self.model.hidden(inputs[0, :B], inputs[1, :B], attn)  # (B, 1, dim)
        return F.linear(hidden[:, -1], self.model.output_weight)

    def _capture(self, B: int, nb: int, mode: tuple) -> None:
        """Capture the decode forward for B rows and nb blocks and the sampler of `mode` over its
        logits (reading the static sampling buffers); pads write only to the null block."""
        self.rows.inputs[:, :B].zero_()
        self.rows.context_lens[:B].fill_(1)
        batch = self.static_sampling.view(B, mode)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return sample(self._decode_forward(B, nb), batch, self.rows.inputs[3, :B, 0])

        self.graphs[(B, nb, mode)] = self._graph_of(step)

    def _graph_of(self, step: Callable[[], tuple[torch.Tensor, ...]]
                  ) -> tuple[torch.cuda.CUDAGraph | _EmulatedGraph, tuple[torch.Tensor, ...]]:
        """(graph, its outputs) of `step` captured in the engine's graph pool after two warm-up runs
        on a side stream (the triton kernels compile and cuBLAS makes its workspaces outside the
        capture). On CPU, where tests exercise the static-buffer logic, an `_EmulatedGraph`."""
        if self.device.type != "cuda":
            graph = _EmulatedGraph(step)
            return graph, graph.out
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out = step()
        except BaseException:
            # A refused capture can raise again on its way out of torch.cuda.graph before that
            # restores the stream: put this thread back on its own stream and let the device settle.
            torch.cuda.set_stream(current)
            torch.cuda.synchronize(self.device)
            raise
        return graph, out

    # ------------------------------------------------------------------ samples

    def drop_graphs(self) -> None:
        """Forget every captured graph and its memory pool (the engine's KV cache is being freed:
        the graphs hold its addresses); the next decode launches and small prefills capture again."""
        self.graphs.clear()
        self.prefill_graphs.clear()
        if self._graph_pool is not None:
            self._graph_pool = torch.cuda.graph_pool_handle()

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


class _EmulatedGraph:
    """A CPU stand-in for a captured CUDA graph (tests): `replay` reruns the step and writes its
    results into the tensors the capture returned, which is what a graph replay does."""

    def __init__(self, step: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.step = step
        self.out = step()

    def replay(self) -> None:
        for out, new in zip(self.out, self.step()):
            out.copy_(new)
