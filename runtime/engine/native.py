"""Native inference engine: models/ definitions, continuous batching over a paged KV cache.

The engine is three parts, wired here:

    runtime/engine/scheduler.py   sequences, rows, queues, admission, prefill chunks, decode
                                  blocks (copy-on-write, preemption), forks of shared prompts,
                                  prefix-cache registration, stop rules, finish / abort / free
    runtime/engine/runner.py      the model's forwards (prefill, decode, CUDA graphs), the
                                  persistent decode buffers, sampling, copies to the host
    runtime/engine/native.py      `NativeEngine`: arguments, KV-cache sizing, the public API and
                                  the order of one step (the one-step lookahead)

with runtime/engine/sequence.py (one sample's state), kv_cache.py (blocks, prefix cache, paged
attention), dense_decode.py (CPU decode attention over a dense copy of the rows' k/v),
sampling.py and kernels.py below them.

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

Steps 1, 2 and the bookkeeping of 3-5 are the scheduler's; the forwards of 3 and 4 the runner's.
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
(tokens and logprobs together).

Weights. Weight sync copies new weights into `engine.model`'s parameters in place (the CUDA
graphs read those very storages) between `step()` calls, then calls `set_version(v)`. Requests
in flight keep their k/v (off-policy by design, bounded by the controller) and the tokens they
sample from then on record version v. The prefix cache is dropped on a version change: a new
request must not silently reuse keys computed by the old weights, and a sequence whose k/v
predate the current version never registers its blocks.

FP8 (quantization="fp8", models/common/fp8.py): the decoder blocks' linears become `Fp8Linear`
modules (e4m3 weights, 128x128 block scales) right after the model is moved; weight sync then
quantises each bf16 tensor it receives into them, in place, between steps (runtime/weight_sync.py),
so a forward never sees two versions. kv_cache_dtype="fp8": the paged cache stores e4m3 keys and
values with one scale per token and head (runtime/engine/kv_cache.py).

Sampling and logprobs: runtime/engine/sampling.py (fp32 log_softmax(logits / temperature) over the
full vocabulary; seeded counter-based draws independent of the batch).

Tensor parallelism inside a replica (`tp_group`): each rank of the group holds its shard of the
model (parallel/tensor_parallel.py), gets the same requests and runs the same scheduler; the
model's all-reduces run inside its forwards, and every step the group's first rank's samples are
broadcast to the others (`ModelRunner._samples`), so every rank appends the same tokens and the
schedulers stay in lockstep.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

from meshrl.models.common import fp8, packed_projections
from meshrl.models.common.probe import probe as probe_shapes
from meshrl.runtime.engine.api import Completion, Request
from meshrl.runtime.engine.kv_cache import BlockManager, KVCache, triton_available
from meshrl.runtime.engine.recurrent_state import RecurrentStates
from meshrl.runtime.engine.runner import ModelRunner
from meshrl.runtime.engine.scheduler import Scheduler, check as check_scheduler
from meshrl.runtime.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Launch:
    """A queued decode forward: which sequence sampled in which row (and its epoch then), the
    weight version, and the (2, B) tokens / logprobs on their way to the host."""

    seqs: list[Sequence]
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
        block); default: room for max_num_seqs full-length sequences, at most `kv_cache_bytes` when
        given (a fixed budget: colocated engines, inference.kv_cache_gib), else on CUDA at most
        `kv_cache_memory_fraction` of the device memory left free once the model is loaded.
    max_num_batched_tokens: prefill tokens per step (padded B x T); default max(8192, max_model_len).
    prefix_sharing: prefix cache and prefill-once forks of identical prompts (off: every sequence
        computes its whole prompt; always off for models with linear-attention layers, whose
        per-row recurrent states live in `states`, runtime/engine/recurrent_state.py).
    cuda_graphs: capture decode forwards (default: on for CUDA). attention: decode attention
        backend, "torch" (gather + SDPA) or "triton" (paged kernel, CUDA); "auto" picks triton when
        it can. detokenize: ids -> text, needed by requests with stop strings. seed: the engine's
        RNG for requests without a seed. tp_group: the ranks of a tensor-parallel replica (each
        passes its shard of the model and the same requests; the group's first rank's samples are
        broadcast to the others every step). quantization: "fp8" keeps the decoder blocks' linear
        weights in e4m3 with 128x128 block scales (models/common/fp8.py). kv_cache_dtype: "fp8"
        stores the paged cache in e4m3 with per-(token, head) scales; "auto" the model dtype.

    `scheduler` (runtime/engine/scheduler.py) and `runner` (runtime/engine/runner.py) are its parts.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int, max_model_len: int,
        device: torch.device | str, dtype: torch.dtype,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_fraction: float = 0.85,
        kv_cache_bytes: int | None = None,
        max_num_batched_tokens: int | None = None,
        prefix_sharing: bool = True,
        cuda_graphs: bool | None = None,
        attention: Literal["auto", "torch", "triton"] = "auto",
        detokenize: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        tp_group: torch.distributed.ProcessGroup | None = None,
        quantization: Literal["none", "fp8"] = "none", kv_cache_dtype: Literal["auto", "fp8"] = "auto",
    ) -> None:
        _check_sizes(max_num_seqs, max_model_len, block_size, kv_cache_memory_fraction)
        self.device = _resolve_device(device)
        self.dtype = dtype
        _check_model_fits(model, self.device, dtype)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.kv_fp8 = _quantize(self.model, self.device, quantization, kv_cache_dtype, tp_group)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens or max(8192, max_model_len)
        if self.max_num_batched_tokens < 2:  # a prompt's last two tokens must fit one prefill
            raise ValueError(f"max_num_batched_tokens must be >= 2, got {max_num_batched_tokens}")
        self.prefix_sharing = prefix_sharing
        self.detokenize = detokenize
        # A tensor-parallel replica: `model` holds this rank's shard (parallel/tensor_parallel.py)
        # and every rank of the group runs this same scheduler on the same requests.
        self.tp_group = tp_group if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1 else None
        self.vocab_size = self.model.output_weight.shape[0]
        is_cuda = self.device.type == "cuda"
        cuda_graphs = is_cuda if cuda_graphs is None else cuda_graphs
        if cuda_graphs and not is_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device")
        # Positions 0..max_model_len-2 hold k/v: the last token of a full-length sequence is never fed.
        self.max_blocks = math.ceil((max_model_len - 1) / block_size)
        layer_ids, num_kv_heads, head_dim, v_head_dim, linear = self._probe()
        self.attention = _decode_attention(attention, head_dim, is_cuda, v_head_dim)
        self.states = self._make_states(linear)  # before the KV cache is sized from the memory left
        self.kv = self._make_cache(layer_ids, num_kv_heads, (head_dim, v_head_dim), num_blocks,
                                   kv_cache_memory_fraction, kv_cache_bytes)
        self.blocks = BlockManager(self.kv.num_blocks, block_size)
        self.runner = ModelRunner(self.model, self.kv, max_num_seqs=max_num_seqs, max_blocks=self.max_blocks,
                                  block_size=block_size, device=self.device, attention=self.attention,
                                  cuda_graphs=cuda_graphs, tp_group=self.tp_group, states=self.states)
        self.scheduler = Scheduler(self.blocks, self.kv, self.runner.rows, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   prefix_sharing=self.prefix_sharing, detokenize=detokenize,
                                   compact_rows=self.states is None)
        self._rng = random.Random(seed)  # seeds of samples whose request has none
        self._pending_aborts: list[Completion] = []
        self._launched: _Launch | None = None  # the decode launch whose tokens the next step reads
        self.num_prefill_tokens = 0
        """Prompt tokens computed so far (what prefix sharing saves shows here)."""

    def _probe(self) -> tuple[list[int], int, int, int, dict]:
        """One throw-away forward -> the model's attention layer ids, k/v heads, k and v head dims
        (ValueError if its layers differ: the cache has one shape for all of them), and the state
        shapes of its linear-attention layers by layer id."""
        probe = probe_shapes(self.model)
        layer_ids = [layer_id for layer_id, *_ in probe.layers]
        first = probe.layers[0][1:]
        for layer_id, *shape in probe.layers:
            if tuple(shape) != first:
                raise ValueError(f"attention layer {layer_id} has (kv heads, k dim, v dim) {tuple(shape)}, layer "
                                 f"{layer_ids[0]} {first}: the native engine's KV cache needs one shape for all layers")
        return layer_ids, *first, probe.linear

    def _make_states(self, linear: dict) -> RecurrentStates | None:
        """Linear-attention layers (Qwen3-Next, Qwen3.5): a state slot per row
        (runtime/engine/recurrent_state.py), and no prefix sharing, which would skip their state."""
        if not linear:
            return None
        if self.prefix_sharing:
            logger.info("native engine: prefix sharing is off for this model: its linear-attention layers keep a "
                        "recurrent state per sequence that a shared prefix would skip")
            self.prefix_sharing = False
        return RecurrentStates(linear, self.max_num_seqs, self.device, self.dtype)

    def _make_cache(self, layer_ids: list[int], num_kv_heads: int, head_dims: tuple[int, int],
                    num_blocks: int | None, kv_cache_memory_fraction: float, kv_cache_bytes: int | None) -> KVCache:
        """The KV cache, `num_blocks` or sized as the class docstring says; ValueError if one
        sequence of max_model_len cannot fit. head_dims: (k head dim, v head dim)."""
        block_size = self.block_size
        head_dim, v_head_dim = head_dims
        per_block = KVCache.bytes_per_block(len(layer_ids), block_size, num_kv_heads, head_dim, self.dtype, v_head_dim,
                                            self.kv_fp8)
        if num_blocks is None:
            # More blocks than max_num_seqs full-length sequences only lengthen the prefix cache's
            # memory: never take more by default (an engine for a small eval stays small).
            num_blocks = self.max_num_seqs * self.max_blocks + 1
            if kv_cache_bytes is not None:
                num_blocks = min(num_blocks, kv_cache_bytes // per_block)
            elif self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                num_blocks = min(num_blocks, int(kv_cache_memory_fraction * free) // per_block)
        if num_blocks - 1 < self.max_blocks:
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0)} blocks of {block_size} tokens "
                f"({per_block / 2**20:.2f} MiB each) but one sequence of max_model_len {self.max_model_len} needs "
                f"{self.max_blocks}: lower max_model_len, raise the KV-cache budget (kv_cache_memory_fraction, "
                "gpu_memory_fraction, kv_cache_gib) / num_blocks, "
                "or use a device with more memory")
        return KVCache(layer_ids, num_blocks, block_size, num_kv_heads, head_dim, self.dtype, self.device, v_head_dim,
                       fp8=self.kv_fp8)

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """The weight version that tokens sampled from now on record (`set_version`)."""
        return self.scheduler.version

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode forwards are captured and replayed as CUDA graphs (emulated on CPU, for tests)."""
        return self.runner.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        self.runner.cuda_graphs = on

    @property
    def num_preemptions(self) -> int:
        """Running sequences preempted so far (blocks freed, recomputed later)."""
        return self.scheduler.num_preemptions

    @property
    def num_first_tokens(self) -> int:
        """Samples that have produced their first token (benchmarks time the first token with it)."""
        return self.scheduler.num_first_tokens

    def set_version(self, version: int) -> None:
        """Tokens sampled from now on are recorded with this weight version; drops the prefix cache."""
        self.scheduler.set_version(version)

    def add(self, request: Request) -> None:
        """Queue a request (its n samples); ValueError if it can never be served."""
        prompt, sampling = request.prompt_ids, request.sampling
        if not 1 <= len(prompt) <= self.max_model_len - 1:
            raise ValueError(f"request {request.request_id}: prompt has {len(prompt)} tokens, "
                             f"must be 1..{self.max_model_len - 1} (max_model_len - 1)")
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            raise ValueError(f"request {request.request_id}: prompt token ids must be in [0, {self.vocab_size})")
        if request.request_id in self.scheduler.live:
            raise ValueError(f"request {request.request_id} is already live")
        if sampling.stop and self.detokenize is None:
            raise ValueError(f"request {request.request_id} has stop strings but the engine has no detokenize")
        samples = []
        for i in range(sampling.n):
            seed = sampling.seed + i if sampling.seed is not None else self._rng.getrandbits(62)
            limit = min(len(prompt) + sampling.max_tokens, self.max_model_len)
            samples.append(Sequence(request, i, seed, list(prompt), len(prompt), limit))
        self.scheduler.add(request.request_id, samples)

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.scheduler.live or self._pending_aborts)

    def abort(self, request_id: int) -> Completion | None:
        """Drop every sample of a live request and free its blocks now; None if it is not live.

        Returns the completion (finish_reason "abort") of its lowest live sample; with n > 1 the
        other samples' abort completions come out of the next `step()`.
        """
        done = self.scheduler.abort(request_id)
        if done is None:
            return None
        self._pending_aborts += done[1:]
        return done[0]

    def step(self) -> list[Completion]:
        """One scheduler iteration (see the module docstring); returns the samples that finished."""
        finished, self._pending_aborts = self._pending_aborts, []
        with torch.inference_mode():
            launched, self._launched = self._launched, None
            decode, num_rows = self.scheduler.reserve_decode()
            prefill = self.scheduler.schedule_prefill()
            if prefill:
                finished += self._prefill(prefill)
            if decode:
                # Queued before the previous launch's tokens are read: the device computes this
                # step while the host does the previous one's bookkeeping (one-step lookahead).
                self._launched = self._launch_decode(decode, num_rows)
            if launched is not None:
                finished += self._complete_decode(launched)
        return finished

    def sleep(self) -> int:
        """Free the KV cache, the linear-attention layers' recurrent states and the captured CUDA
        graphs while no request is live (a colocated engine in synchronous RL, so that the trainer
        can use the memory); returns the bytes freed. The prefix cache goes with them. `wake` takes
        the cache and the states back; graphs are captured again."""
        if self.scheduler.live or self._pending_aborts:
            raise RuntimeError("the engine cannot sleep while requests are live")
        if self.asleep:
            return 0
        if self._launched is not None:  # its sequences all finished: read and drop its tokens
            self._complete_decode(self._launched)
            self._launched = None
        self.blocks.clear_prefix_cache()
        freed = self.kv.release() + (self.states.release() if self.states is not None else 0)
        freed += self.runner.dense.release() if self.runner.dense is not None else 0
        self.runner.drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    @property
    def asleep(self) -> bool:
        """Whether `sleep` freed the KV cache and `wake` has not taken it back yet."""
        return self.kv.released

    def wake(self) -> None:
        """Allocate the KV cache and the recurrent states again after `sleep` (their contents are
        gone: every block is free, every state slot zero)."""
        if self.asleep:
            self.kv.restore()
            if self.states is not None:
                self.states.restore()
            if self.runner.dense is not None:
                self.runner.dense.restore()

    def check(self) -> None:
        """Assert the bookkeeping invariants between steps: blocks, every row's host inputs and
        device block table against its sequence, and a CPU engine's dense k/v of every decoding
        row against the paged cache (for tests)."""
        check_scheduler(self.scheduler)
        if self.runner.dense is not None and not self.asleep:
            for r, seq in self.scheduler.running.items():
                if seq.ready:
                    self.runner.dense.check(r, seq.table, seq.num_computed)

    # ------------------------------------------------------------------ one step's parts

    def _prefill(self, rows: list[tuple[Sequence, int]]) -> list[Completion]:
        """One eager forward of the prefill rows; rows that complete sample their next token, and
        the followers they fork sample from the same logits."""
        hidden = self.runner.prefill_forward(rows)  # (B, T, dim)
        self.num_prefill_tokens += sum(n for _, n in rows)
        done_rows, last, samplers, logit_rows = self.scheduler.prefilled(rows)
        if not done_rows:
            return []
        tokens, logprobs = self.runner.prefill_sample(hidden, done_rows, last, logit_rows, samplers)
        return self.scheduler.append(samplers, tokens, logprobs)

    def _launch_decode(self, seqs: list[Sequence], num_rows: int) -> _Launch:
        """Queue one token for every sequence of the decode set (rows < num_rows) and advance the
        rows' host inputs to the next position; the tokens are read by `_complete_decode`.

        A sequence whose in-flight token (from the previous launch) ends it by length is not fed
        again: its row is a pad in this launch. One stopped by a stop token is not known yet and
        computes one wasted position, which the completion drops (its epoch changed).
        """
        fed = self.scheduler.feedable(seqs)
        host, event = self.runner.launch_decode(seqs, num_rows, self.scheduler.layout_version)
        self.scheduler.advance(fed)
        return _Launch(fed, [seq.row for seq in fed], [seq.epoch for seq in fed], self.scheduler.version, host, event)

    def _complete_decode(self, launch: _Launch) -> list[Completion]:
        """Append a launch's tokens to its sequences that still hold their row; finish them."""
        sampled, sampled_logprobs = self.runner.read_decode(launch.host, launch.event)
        return self.scheduler.complete(launch.seqs, launch.rows, launch.epochs, launch.version, sampled,
                                       sampled_logprobs)


def _check_sizes(max_num_seqs: int, max_model_len: int, block_size: int, kv_cache_memory_fraction: float) -> None:
    """ValueError for an engine argument out of range."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0.0 < kv_cache_memory_fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {kv_cache_memory_fraction}")


def _quantize(model: nn.Module, device: torch.device, quantization: str, kv_cache_dtype: str, tp_group) -> bool:
    """FP8 weights for quantization="fp8" (after the move to the device: .to(dtype) would cast e4m3
    back), then the packed projections of the linears left plain (models/common/packed_projections.py)
    -> whether the KV cache is FP8; ValueError for an option the native engine does not run."""
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization must be 'none' or 'fp8', got {quantization!r}")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    if quantization == "fp8" and tp_group is not None:
        raise ValueError("quantization='fp8' is not supported with tensor parallelism yet (inference.tensor_parallel > 1)")
    if quantization == "fp8":
        fp8.quantize_model(model, device)
    if packed_projections.enabled(device):
        packed_projections.pack(model)  # the plain linears' q/k/v and gate/up as one matmul each
    return kv_cache_dtype == "fp8"


def _resolve_device(device: torch.device | str) -> torch.device:
    """`device` with a CUDA index (the current device when it has none)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _decode_attention(attention: str, head_dim: int, is_cuda: bool,
                      v_head_dim: int | None = None) -> Literal["torch", "triton"]:
    """The decode attention backend an `attention` argument resolves to; ValueError if it cannot run."""
    # A kernel tile spans a head: triton ranges need a power of two, tensor-core products >= 16;
    # the kernel reads k and v with one head dim.
    kernel_fits = _is_pow2(head_dim) and head_dim >= 16 and v_head_dim in (None, head_dim)
    if attention == "auto":
        attention = "triton" if is_cuda and triton_available() and kernel_fits else "torch"
    if attention not in ("torch", "triton"):
        raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {attention!r}")
    if attention == "triton" and not (is_cuda and kernel_fits):
        raise ValueError(f"attention='triton' needs a CUDA device and a power-of-two head_dim >= 16, the same "
                         f"for k and v (got {head_dim} and {v_head_dim or head_dim}); use 'torch'")
    return attention


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
