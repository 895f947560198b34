"""vLLM engine adapter: the `InferenceEngine` protocol over vLLM (`inference.backend = "vllm"`).

vLLM is an optional extra that lives in its own environment (docs/inference.md); this module imports
it only inside `VLLMEngine.__init__`, so `import meshrl` never needs it.

Process layout (one replica per inference rank, tensor parallel size 1):

    inference rank (our torchrun world)                 vLLM worker process (its own torch world of 1)
    VLLMEngine -> vllm.LLMEngine                        spawned by vLLM's "mp" executor, pinned to this
                  + EngineCore in-process               rank's GPU through CUDA_VISIBLE_DEVICES
                  (VLLM_ENABLE_V1_MULTIPROCESSING=0)    model forward, sampling, KV cache
    receive_weights: NCCL broadcast (sync group) into a bucket,
                     collective_rpc("meshrl_load_weights", CUDA IPC handle) ----> load_weights(HF names)

Why not `distributed_executor_backend="external_launcher"`: it makes vLLM adopt the existing default
process group as its world (every process of the job would have to join vLLM's `new_group` calls and
its world all-reduces, and the world must be a multiple of tp x pp). Our torchrun world also holds the
controller and the trainer ranks, which never run vLLM, so vLLM would hang there. Why not vLLM's
in-process "uni" executor: its worker initialises vLLM's distributed state in the calling process,
which hits the same problem. The "mp" executor puts the one worker in a child process with a fresh
torch world, while the scheduler (EngineCore) stays in the rank's process, so `step()` is one
synchronous scheduler iteration, exactly as with the native engine.

Per-token versions: because `step()` runs exactly one scheduler iteration (in-process EngineCore,
`async_scheduling=False`), the tokens it returns were sampled during that call, with the weights
loaded at that moment; each one records `self.version`. A weight load happens between two `step()`
calls and requests in flight keep their KV cache, as in the native engine.

Logprobs: `logprobs_mode="processed_logprobs"` with `SamplingParams(logprobs=0)` returns, per sampled
token, fp32 log_softmax of the logits after temperature, after the argmax-invariant processors
(min_p) and after top_k/top_p masking. With top_p = 1, top_k off, min_p = 0 and no penalties that is
exactly log_softmax(logits / temperature), the engine protocol's contract (the default "raw_logprobs"
would be the temperature-1 distribution). Greedy rows (temperature 0) report temperature-1 logprobs,
as the native engine does. Truncated sampling would report the truncated distribution, so `add`
refuses top_p < 1, top_k and min_p.

Weight names: the trainer broadcasts in OUR parameter order and names (runtime/weight_sync.py). This
engine keeps a meta-device copy of our model (`self.model`: names and shapes only, no storage) to
derive the same bucket plan; `receive_weights` joins each bucket's broadcast, renames the slices to
HF names with the family's state-dict adapter (`to_hf`; a tied LM head is not sent, vLLM ties it to
the embedding) and hands them to vLLM's `model.load_weights`, which fuses q/k/v and gate/up itself.
Weight sync for this backend must go through `engine.receive_weights`, not through
`weight_sync.receive_weights(engine.model, ...)` (the meta parameters have no storage).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshrl.runtime.engine.api import Completion, FinishReason, Request, SamplingParams
from meshrl.runtime.weight_sync import bucket_plan

INSTALL_DOC = "docs/inference.md"
# vLLM loads this class into its worker (engine argument worker_extension_cls) by qualified name.
WORKER_EXTENSION = "meshrl.runtime.engine.vllm_engine.MeshrlWorkerExtension"
# torchrun's variables: the vLLM worker forms its own world of one and must not see ours. Every
# TORCHELASTIC_* variable goes too: with TORCHELASTIC_USE_AGENT_STORE=True (set by torchrun) torch
# makes the worker's tcp:// store a client of a server nobody starts, and vLLM hangs at start-up
# for the store's 600 s timeout (seen on the H200, 2026-12-01).
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
_TORCHRUN_PREFIX = "TORCHELASTIC_"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def import_vllm() -> Any:
    """Import vllm, or raise a ModuleNotFoundError that says where the install is described."""
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise  # vllm is there but one of its own dependencies is broken: show that error
        raise ModuleNotFoundError(
            'inference.backend = "vllm" needs the vllm package, which is not installed in this environment. '
            f"vLLM pins its own torch and transformers, so it goes into a separate environment: see {INSTALL_DOC}. "
            'Or use inference.backend = "native".',
            name="vllm",
        ) from None
    return vllm


# ----------------------------------------------------------------------------- the worker side


def share_tensor(tensor: Tensor) -> Any:
    """How a weight bucket crosses to the vLLM worker process.

    A CUDA tensor travels as a CUDA IPC handle (the worker maps the same memory on the same GPU; no
    copy). A CPU tensor travels as itself: that only happens with an in-process engine, such as the
    fake vLLM of the unit tests (real vLLM is CUDA only).
    """
    if tensor.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)  # (rebuild function, its args); vLLM's executor pickles it
    return tensor


def open_shared(handle: Any, device: torch.device) -> Tensor:
    """The tensor `share_tensor` described, in the receiving process on `device`."""
    if isinstance(handle, Tensor):
        return handle
    rebuild, args = handle
    # The sender numbers this GPU by its own CUDA_VISIBLE_DEVICES; the worker sees it as `device`.
    args = list(args)
    args[list(inspect.signature(rebuild).parameters).index("storage_device")] = device.index
    return rebuild(*args)


class MeshrlWorkerExtension:
    """Methods vLLM mixes into its GPU worker (engine argument `worker_extension_cls`).

    They run in the worker process, where `self.model_runner.model` is vLLM's model and
    `self.device` the worker's GPU. Names start with `meshrl_` so they cannot clash with the worker's.
    """

    def meshrl_load_weights(self, handle: Any, entries: list[tuple[str, int, list[int]]]) -> int:
        """Load HF-named tensors packed in one shared buffer: entries are (name, element offset, shape).

        Returns the number of tensors handed to load_weights.
        """
        flat = open_shared(handle, self.device)
        weights = [(name, flat[offset:offset + math.prod(shape)].view(shape)) for name, offset, shape in entries]
        self.model_runner.model.load_weights(weights=weights)
        if flat.is_cuda:
            # The sender reuses or frees the buffer as soon as this call returns.
            torch.cuda.synchronize(flat.device)
        return len(weights)


# ----------------------------------------------------------------------------- the engine


def pack_tensors(tensors: dict[str, Tensor]) -> tuple[Tensor, list[tuple[str, int, list[int]]]]:
    """Copy tensors of one dtype into one flat buffer; returns (buffer (N,), [(name, offset, shape)])."""
    dtypes = {t.dtype for t in tensors.values()}
    assert len(dtypes) == 1, f"a weight bucket must have one dtype, got {dtypes}"
    first = next(iter(tensors.values()))
    flat = torch.empty(sum(t.numel() for t in tensors.values()), dtype=first.dtype, device=first.device)
    entries, offset = [], 0
    for name, t in tensors.items():
        flat[offset:offset + t.numel()].view(t.shape).copy_(t)
        entries.append((name, offset, list(t.shape)))
        offset += t.numel()
    return flat, entries


@dataclass
class _Sample:
    """What one sample of a live request has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class _Live:
    request: Request
    samples: list[_Sample]

    def completions(self, abort: bool = False) -> list[Completion]:
        r = self.request
        return [Completion(r.request_id, list(r.prompt_ids), s.token_ids, s.logprobs, s.versions,
                           "abort" if abort else s.finish_reason) for s in self.samples]


def _sampling_fields(sp: SamplingParams) -> tuple[int, int, float, tuple[str, ...]]:
    """(n, top_k, min_p, stop strings) of a request; fields the native SamplingParams may lack default off."""
    top_k = getattr(sp, "top_k", None)
    return (getattr(sp, "n", 1), 0 if top_k in (None, -1) else top_k, getattr(sp, "min_p", 0.0),
            tuple(getattr(sp, "stop", ()) or ()))


@contextlib.contextmanager
def _engine_env(device: torch.device) -> Iterator[None]:
    """Environment while vLLM builds its engine and spawns its worker (restored afterwards).

    In-process EngineCore (synchronous step); spawned worker (the rank already holds a CUDA context,
    so fork is unsafe); the worker sees only this rank's GPU and none of torchrun's variables.
    """
    changes: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    changes.update({var: None for var in _TORCHRUN_VARS})
    changes.update({var: None for var in os.environ if var.startswith(_TORCHRUN_PREFIX)})
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        index = device.index if device.index is not None else torch.cuda.current_device()
        changes["CUDA_VISIBLE_DEVICES"] = ids[index].strip()
    saved = {var: os.environ.get(var) for var in changes}
    _set_env(changes)
    try:
        yield
    finally:
        _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    """Set each variable, or unset it where the value is None."""
    for var, value in values.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


class VLLMEngine:
    """The InferenceEngine protocol over an in-process vLLM `LLMEngine` (see the module docstring).

    model: our model built on the meta device, in the sync dtype (names and shapes of the trainer's
        broadcast; no storage). Its `output_weight` gives the vocabulary size.
    adapter: the family's state-dict adapter (`to_hf` renames our keys to HF's, which vLLM loads).
    model_dir: an HF folder with config.json (weights are not read: load_format="dummy", the trainer's
        version 0 arrives by broadcast before the first request).
    tokenizer: an HF tokenizer folder, needed only for stop strings (detokenisation); None skips it.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: Any,
        model_dir: str | os.PathLike,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        gpu_memory_utilization: float = 0.8,
        enforce_eager: bool = False,
        seed: int = 0,
        tokenizer: str | os.PathLike | None = None,
        kv_cache_bytes: int | None = None,
        sleep_mode: bool = False,
        quantization: str = "none", kv_cache_dtype: str = "auto",
    ) -> None:
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._vllm_sampling_params = vllm.SamplingParams
        self._tokens_prompt = TokensPrompt
        self._delta = RequestOutputKind.DELTA
        self.model = model
        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.has_tokenizer = tokenizer is not None
        self.version = 0
        self._live: dict[str, _Live] = {}
        engine_args = vllm.EngineArgs(**_engine_args(
            model_dir, tokenizer, dtype, seed, max_model_len, max_num_seqs, gpu_memory_utilization, enforce_eager,
            kv_cache_bytes, sleep_mode), **_fp8_args(quantization, kv_cache_dtype))
        self._asleep = False
        with _engine_env(self.device):
            self._engine = vllm.LLMEngine.from_engine_args(engine_args)

    # ------------------------------------------------------------------ protocol

    def set_version(self, version: int) -> None:
        """Tokens sampled from now on are recorded with this weight version."""
        self.version = version

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._live)

    def add(self, request: Request) -> None:
        """Queue a request; ValueError if it can never be served or breaks the logprob contract."""
        rid = request.request_id
        num_prompt = len(request.prompt_ids)
        if not 1 <= num_prompt <= self.max_model_len - 1:
            raise ValueError(f"request {rid}: prompt has {num_prompt} tokens, must be 1..{self.max_model_len - 1} "
                             "(max_model_len - 1)")
        vocab_size = self.model.output_weight.shape[0]
        if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab_size:
            raise ValueError(f"request {rid}: prompt token ids must be in [0, {vocab_size})")
        if str(rid) in self._live:
            raise ValueError(f"request {rid} is already live")
        params = self._sampling_params(request)
        self._engine.add_request(str(rid), self._tokens_prompt(prompt_token_ids=list(request.prompt_ids)), params)
        num_samples = _sampling_fields(request.sampling)[0]
        self._live[str(rid)] = _Live(request, [_Sample() for _ in range(num_samples)])

    def step(self) -> list[Completion]:
        """One vLLM scheduler iteration; returns the requests that finished in it.

        A request with n > 1 samples finishes when all its samples have: its n Completions (sharing
        the request_id) come back together, in sample order.
        """
        finished: list[Completion] = []
        for out in self._engine.step():
            live = self._live.get(out.request_id)
            assert live is not None, f"vLLM returned output for request {out.request_id!r}, which is not live"
            for sample_out in out.outputs:
                self._append(live.samples[sample_out.index], sample_out)
            if all(s.finish_reason is not None for s in live.samples):
                del self._live[out.request_id]
                finished += live.completions()
        return finished

    def abort(self, request_id: int) -> Completion | None:
        """Drop a live request at once; returns what it had generated (sample 0 when n > 1), or None."""
        live = self._live.pop(str(request_id), None)
        if live is None:
            return None
        self._engine.abort_request([str(request_id)])
        return live.completions(abort=True)[0]

    # ------------------------------------------------------------------ sleeping (colocated, synchronous)

    def sleep(self) -> int:
        """Free the KV cache (and offload the weights to host memory) while no request is live, so
        that the trainer on the same GPU can use the memory; returns the bytes the device gained.
        Needs the engine built with sleep_mode (inference.sleep_while_training)."""
        if self._live:
            raise RuntimeError("the engine cannot sleep while requests are live")
        if self._asleep:
            return 0
        free = (lambda: torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else (lambda: 0)
        before = free()  # device-wide: vLLM's memory belongs to its worker process
        self._engine.sleep(level=1)  # level 2 would drop buffers (rotary tables) that no weight sync restores
        self._asleep = True
        return max(0, free() - before)

    @property
    def asleep(self) -> bool:
        """Whether `sleep` freed the KV cache and `wake` has not taken it back yet."""
        return self._asleep

    def wake(self) -> None:
        """Take the KV cache and the weights back after `sleep` (the cache's contents are gone)."""
        if self._asleep:
            self._engine.wake_up()
            self._asleep = False

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def receive_weights(self, group: dist.ProcessGroup, src: int, dtype: torch.dtype, bucket_mb: float,
                        device: torch.device) -> None:
        """Join the trainer's broadcast (same buckets as weight_sync.send_weights) and load each bucket."""
        shapes = [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]
        for bucket in bucket_plan(shapes, dtype.itemsize, bucket_mb):
            numel = sum(math.prod(shapes[i][1]) for i in bucket)
            flat = torch.empty(numel, dtype=dtype, device=device)
            dist.broadcast(flat, src=src, group=group)
            named, offset = [], 0
            for i in bucket:
                name, shape = shapes[i]
                named.append((name, flat[offset:offset + math.prod(shape)].view(shape)))
                offset += math.prod(shape)
            self.load_weights(named)
        if torch.device(device).type == "cuda":
            torch.cuda.ipc_collect()  # free the buckets the worker has released

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Load tensors named by OUR parameter names into vLLM (one call; renamed to HF names first)."""
        hf = self.adapter.to_hf(dict(named))
        if not hf:
            return  # e.g. a bucket that held only a tied LM head
        flat, entries = pack_tensors(hf)
        self._engine.collective_rpc("meshrl_load_weights", args=(share_tensor(flat), entries))

    # ------------------------------------------------------------------ helpers

    def _sampling_params(self, request: Request) -> Any:
        """Our SamplingParams as vLLM's, after the checks that keep the logprob contract."""
        sp, rid = request.sampling, request.request_id
        n, top_k, min_p, stop = _sampling_fields(sp)
        if sp.top_p < 1.0 or top_k > 0 or min_p > 0.0:
            raise ValueError(
                f"request {rid}: the vLLM backend reports logprobs of the distribution it samples from, which "
                f"top_p < 1, top_k or min_p truncate (got top_p={sp.top_p}, top_k={top_k}, min_p={min_p}); "
                "the trainer's logprobs are of the full temperature-scaled distribution")
        if stop and not self.has_tokenizer:
            raise ValueError(f"request {rid}: stop strings {stop!r} need a tokenizer; this engine has none "
                             "(stop with stop_token_ids)")
        if n < 1:
            raise ValueError(f"request {rid}: n must be >= 1, got {n}")
        kwargs: dict[str, Any] = dict(
            n=n,
            temperature=sp.temperature,
            top_p=sp.top_p,
            max_tokens=sp.max_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            seed=sp.seed,
            logprobs=0,  # the sampled token's logprob only
            # We stop on stop_token_ids alone (the native engine's rule), not on vLLM's idea of EOS.
            ignore_eos=True,
            output_kind=self._delta,  # each step returns only the new tokens: they get this step's version
            detokenize=bool(stop),
        )
        if stop:
            kwargs["stop"] = list(stop)
        return self._vllm_sampling_params(**kwargs)

    def _append(self, sample: _Sample, out: Any) -> None:
        """Add one vLLM CompletionOutput delta (new tokens, their logprobs, maybe a finish) to a sample."""
        tokens = list(out.token_ids)
        if tokens:
            assert out.logprobs is not None and len(out.logprobs) == len(tokens), (
                f"vLLM returned {len(tokens)} tokens with "
                f"{None if out.logprobs is None else len(out.logprobs)} logprob entries")
            # Each entry maps token id -> Logprob; with logprobs=0 it holds the sampled token.
            sample.logprobs += [float(entry[token].logprob) for token, entry in zip(tokens, out.logprobs)]
            sample.token_ids += tokens
            sample.versions += [self.version] * len(tokens)
        if out.finish_reason is not None:
            if out.finish_reason not in _FINISH:
                raise RuntimeError(f"vLLM finished a request with reason {out.finish_reason!r}")
            sample.finish_reason = _FINISH[out.finish_reason]


def _fp8_args(quantization: str, kv_cache_dtype: str) -> dict[str, str]:
    """inference.quantization / kv_cache_dtype as vLLM's own options (online FP8; docs/inference.md, FP8)."""
    return {"kv_cache_dtype": kv_cache_dtype, **({"quantization": "fp8"} if quantization == "fp8" else {})}


def _engine_args(model_dir, tokenizer, dtype: torch.dtype, seed: int, max_model_len: int, max_num_seqs: int,
                 gpu_memory_utilization: float, enforce_eager: bool, kv_cache_bytes: int | None,
                 sleep_mode: bool) -> dict[str, Any]:
    """vLLM's engine arguments for one adapter engine (see VLLMEngine)."""
    return dict(
        model=str(model_dir),
        tokenizer=None if tokenizer is None else str(tokenizer),
        skip_tokenizer_init=tokenizer is None,
        dtype=str(dtype).removeprefix("torch."),
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        tensor_parallel_size=1,
        distributed_executor_backend="mp",
        worker_extension_cls=WORKER_EXTENSION,
        load_format="dummy",
        logprobs_mode="processed_logprobs",
        # Cached prompt KV would outlive a weight update and be reused under the new version.
        enable_prefix_caching=False,
        # One scheduler iteration per step(): the tokens of a step come from the weights of that step.
        async_scheduling=False,
        # Sampling comes from our requests only, never from the folder's generation_config.json.
        generation_config="vllm",
        disable_log_stats=True,
        # A colocated engine's KV cache is a budget (runtime/memory.py), not whatever vLLM's
        # profile finds free while the trainer on the same GPU allocates.
        kv_cache_memory_bytes=kv_cache_bytes,
        # inference.sleep_while_training: the KV cache can be freed while the trainer steps
        enable_sleep_mode=sleep_mode,
    )


# ----------------------------------------------------------------------------- building from the config


def build_vllm_engine(cfg: Any, model_cfg: Any, device: torch.device, dtype: torch.dtype, seed: int,
                      kv_cache_bytes: int | None = None, memory_bytes: int | None = None) -> VLLMEngine:
    """The vLLM engine of one inference rank from `inference` (cfg) and `model` (model_cfg) sections.

    A colocated engine (runtime/memory.py) gets `kv_cache_bytes` as its KV cache and `memory_bytes`
    as all it may hold (weights, cache, graphs): gpu_memory_utilization becomes that share of the
    GPU, and vLLM then checks at start-up that it is free.

    A fresh `model.flavor` has no HF folder: its config.json is written to a temporary folder for vLLM
    (which reads no weights from it: version 0 arrives by broadcast).
    """
    if device.type != "cuda":
        raise ValueError(f'inference.backend = "vllm" runs on CUDA only, but this inference rank is on {device}; '
                         'use inference.backend = "native" on CPU')
    from meshrl.runtime.policy import policy_skeleton

    model, adapter, args, path = policy_skeleton(model_cfg, dtype)
    if path is None:
        path = tempfile.mkdtemp(prefix="meshrl-vllm-")
        (Path(path) / "config.json").write_text(json.dumps(args.to_hf_config(dtype=dtype), indent=2))
    # No tokenizer: requests are token ids and stop on token ids, so vLLM never detokenises (and a
    # tokenizer saved by our transformers need not load under vLLM's older one).
    utilization = cfg.vllm.gpu_memory_utilization
    if memory_bytes is not None:
        utilization = min(0.95, memory_bytes / torch.cuda.get_device_properties(device).total_memory)
    return VLLMEngine(model, adapter, path, device=device, dtype=dtype, max_num_seqs=cfg.max_num_seqs,
                      max_model_len=cfg.max_model_len, gpu_memory_utilization=utilization,
                      enforce_eager=cfg.vllm.enforce_eager, seed=seed, kv_cache_bytes=kv_cache_bytes,
                      sleep_mode=cfg.sleep_while_training, quantization=cfg.quantization,
                      kv_cache_dtype=cfg.kv_cache_dtype)
