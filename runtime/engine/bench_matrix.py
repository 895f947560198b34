"""`meshrl bench engine --compare vllm`: the native engine and vLLM on an RL workload matrix.

    meshrl bench engine --compare vllm [--flavors 0.6B,1.7B] [--workloads plain_8,grpo,...]
                        [--out FILE.jsonl] [--scale 1.0] [--batch-scale 1.0] [--hbm-gbps 4800]
                        [--device cuda|cpu] [--gpu-memory-utilization 0.9] [--vllm-timeout 420]
                        [--quantization none|fp8] [--kv-cache-dtype auto|fp8]
    meshrl bench engine --workloads all          # the native engine alone on the same matrix

Workloads (random prompts over the vocabulary, temperature 1, every token's logprob returned, no
stop token: each sample runs to its max_tokens; P prompt tokens, G generated, `--scale` scales both,
`--batch-scale` the numbers of prompts, requests and episodes):

    plain_8, plain_64      B sequences submitted at once, 128 + 512 tokens
    plain_256, plain_512   the same with 128 + 256 tokens
    grpo                   32 prompts x 16 samples (SamplingParams.n): 256 + 256, shared prompts
    long_4k                2 prompts x 16 samples, 128 + 4096 (reasoning-trace length)
    multiturn              64 episodes x 4 turns: 512 + 128, then each finished turn continues at
                           once with its prompt + completion + 32 new tokens (a cached prefix)
    refill                 512 requests kept 128 at a time (a new one as each finishes), prompts
                           32-256 and completions 16-512 tokens, uniformly mixed

Per model shape, one native engine and one vLLM engine serve every workload (vLLM's start-up is
70-95 s on an H200). The native engine runs in this process; vLLM runs in a child process
(`python -m meshrl.runtime.engine.bench_matrix`, so that its memory is gone when the child exits
and its "mp" executor can re-import the main module), which prints its rows as JSON lines that
this process forwards. Without vLLM installed the native engine runs alone and one line says so.

Models: any native family (`--family`, its `--flavors`), random weights. With `--compare vllm`
this process writes the native model's weights as an HF folder (runtime/engine/bench_export.py:
models/hf.py's exporter, Qwen3.5 in the vision-language layout vLLM 0.26 serves) that the vLLM
child loads, so both engines run the very same model; the folder is removed after the shape.

Settings. Native: prefix sharing on (off for linear-attention models, which cannot share
prefixes), CUDA graphs on CUDA, every request seeded (its sampler is
counter-based, seeds cost nothing). vLLM, its best fair settings: prefix caching on (the grpo,
multiturn and long_4k rows share prefixes; the others have no hits to find), async scheduling,
CUDA graphs + torch.compile (enforce_eager off), `logprobs=0` with processed logprobs (the
engine protocol's contract), DELTA outputs, no per-request seeds (vLLM samples seeded requests on
a slower path), its LLM-class defaults otherwise (max_num_batched_tokens; the native engine gets
the same prefill budget). `--quantization fp8` / `--kv-cache-dtype fp8`: the native engine's FP8
weights (128x128 block scales) / FP8 KV cache, and vLLM's `quantization="fp8"` (its online
quantisation of the same bf16 folder) / `kv_cache_dtype="fp8"`. Both: max_num_seqs 512 (`--max-num-seqs`), one max_model_len for every row, the prefix
cache reset between rows. Each row's `settings` field logs what was used.

One JSON line per (shape, workload, engine):

- tokens_per_s: generated tokens / wall time from the first submission to the last completion;
- ttft_s: mean over samples of the time from their request's submission to their first token;
- decode_step_ms: mean wall time of the steps that gave no sample its first token (and, native,
  computed no prompt tokens): decode steps of whatever batch was running;
- floor_step_ms: the HBM floor of a decode step: (weight bytes + KV bytes read + linear-attention
  states read and written) / bandwidth, the KV bytes being every decoding sample's whole context
  (prefixes shared between samples counted once per sample, as paged kernels read them; MLA: its
  latent), averaged over the fewest decode steps the workload allows (its longest chain of
  dependent tokens, or its tokens / its concurrency);
- floor_tokens_per_s = tokens / (those steps x floor_step_ms); wall_vs_floor and
  step_vs_floor: measured over floor (1.0 = at the floor). Prefill is not in the floor.
  Bandwidth by device name (H200 4.8 TB/s, H100 3.35, A100 2.0) or `--hbm-gbps`; none on CPU;
- native rows on CUDA: peak_memory_gib (allocated since the engine was built: weights, KV cache,
  states, activations); their settings carry kv_bytes_per_token and state_bytes_per_seq.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

MODULE = "meshrl.runtime.engine.bench_matrix"
WORKLOADS = ("plain_8", "plain_64", "plain_256", "plain_512", "grpo", "long_4k", "multiturn", "refill")
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "B200": 8000.0}
MAX_NUM_SEQS = 512
PREFILL_TOKENS = 16384  # vLLM's LLM-class default max_num_batched_tokens on large GPUs; both get it


# ----------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """Requests of one row. prompts[i] gets n samples of max_tokens[i] tokens; with `concurrency`
    at most that many requests are live at once (the rest are submitted as others finish); with
    turns > 1 each finished sample continues as its own next request, adding turn_tokens."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    concurrency: int | None = None
    turns: int = 1
    turn_tokens: list[list[int]] = field(default_factory=list)  # per episode: tokens the env adds each turn

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.n * self.turns

    @property
    def shares_prefix(self) -> bool:
        return self.n > 1 or self.turns > 1

    def max_context(self) -> int:
        """Most tokens one sequence reaches (prompt + completions + added turns)."""
        env = len(self.turn_tokens[0]) if self.turn_tokens else 0
        return max(len(p) + self.turns * g + (self.turns - 1) * env for p, g in zip(self.prompts, self.max_tokens))


def _scaled(x: int, scale: float) -> int:
    return max(2, round(x * scale))


def make_workload(name: str, vocab_size: int, scale: float = 1.0, seed: int = 0, batch_scale: float = 1.0) -> Workload:
    """The workload `name` (module docstring) with prompt and completion lengths times `scale` and
    numbers of prompts / requests / episodes times `batch_scale` (at least 1; samples per prompt stay)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)  # the same in every process

    def prompts(num: int, length: int) -> list[list[int]]:
        return torch.randint(0, vocab_size, (num, length), generator=g).tolist()

    def count(num: int) -> int:
        return max(1, round(num * batch_scale))

    P, G = _scaled(128, scale), _scaled(512, scale)
    if name.startswith("plain_"):
        B = int(name.removeprefix("plain_"))
        gen = G if B <= 64 else _scaled(256, scale)  # big batches are bandwidth-bound early: keep the run short
        return Workload(name, prompts(count(B), P), [gen] * count(B))
    if name == "grpo":
        num = count(32)
        return Workload(name, prompts(num, _scaled(256, scale)), [_scaled(256, scale)] * num, n=16)
    if name == "long_4k":
        num = count(2)
        return Workload(name, prompts(num, P), [_scaled(4096, scale)] * num, n=16)
    if name == "multiturn":
        episodes = count(64)
        env = prompts(episodes, _scaled(32, scale))
        return Workload(name, prompts(episodes, _scaled(512, scale)), [_scaled(128, scale)] * episodes, turns=4,
                        turn_tokens=env)
    if name == "refill":
        num = count(512)
        lens = torch.randint(_scaled(32, scale), _scaled(256, scale) + 1, (num,), generator=g).tolist()
        gens = torch.randint(_scaled(16, scale), _scaled(512, scale) + 1, (num,), generator=g).tolist()
        return Workload(name, [p[:n] for p, n in zip(prompts(num, max(lens)), lens)], gens, concurrency=count(128))
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def decode_floor(w: Workload, weight_bytes: int, kv_bytes_per_token: int, gbps: float | None,
                 state_bytes_per_seq: int = 0) -> dict:
    """floor_step_ms and floor_tokens_per_s of a workload (module docstring), or {} without a bandwidth.
    state_bytes_per_seq: a sequence's linear-attention states, read and written once per decode step."""
    if not gbps:
        return {}
    env = len(w.turn_tokens[0]) if w.turn_tokens else 0
    kv_tokens, tokens = 0, 0
    for prompt, gen in zip(w.prompts, w.max_tokens):
        context = len(prompt)
        for _ in range(w.turns):
            # decode steps produce tokens 2..G of a turn, reading contexts P+1 .. P+G-1
            kv_tokens += w.n * ((gen - 1) * context + (gen - 1) * gen // 2)
            tokens += w.n * gen
            context += gen + env
    chain = max(w.max_tokens) * w.turns - w.turns
    width = (w.concurrency or len(w.prompts)) * w.n
    steps = max(chain, -(-(tokens - w.num_samples) // width), 1)
    state = 2 * state_bytes_per_seq * (tokens - w.num_samples)  # every decode (sample, step) pair
    floor_s = (steps * weight_bytes + kv_tokens * kv_bytes_per_token + state) / (gbps * 1e9)
    return {"floor_step_ms": 1e3 * floor_s / steps, "floor_tokens_per_s": tokens / floor_s, "floor_steps": steps}


# ----------------------------------------------------------------------------- drivers


class Driver(Protocol):
    """One engine behind the timing loop: add samples, step, report first tokens and finishes."""

    name: str

    def add(self, rid: int, prompt: list[int], n: int, max_tokens: int) -> None: ...

    def step(self) -> tuple[list[tuple[int, int, list[int], list[int]]], list[tuple[int, int]], bool]:
        """-> (finished samples (rid, index, prompt, tokens), samples given their first token
        (rid, index), whether the step computed prompt tokens)."""
        ...

    def has_work(self) -> bool: ...

    def reset(self) -> None: ...


class NativeDriver:
    """The native engine (runtime/engine/native.py) behind the timing loop."""

    name = "native"

    def __init__(self, engine: Any, seed: int = 0) -> None:
        self.engine = engine
        self.seed = seed

    def add(self, rid: int, prompt: list[int], n: int, max_tokens: int) -> None:
        from meshrl.runtime.engine.api import Request, SamplingParams

        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=self.seed * 1_000_003 + rid * 64)
        self.engine.add(Request(rid, prompt, sp))

    def step(self):
        engine = self.engine
        first, prefilled = engine.num_first_tokens, engine.num_prefill_tokens
        done = [(c.request_id, c.index, c.prompt_ids, c.token_ids) for c in engine.step()]
        started: list[tuple[int, int]] = []
        if engine.num_first_tokens != first:  # rare steps: find who started (one token so far)
            started = [(s.request.request_id, s.index) for seqs in engine.scheduler.live.values() for s in seqs
                       if len(s.tokens) - s.num_prompt == 1]
            started += [(rid, i) for rid, i, _, tokens in done if len(tokens) == 1]
        return done, started, engine.num_prefill_tokens != prefilled

    def has_work(self) -> bool:
        return self.engine.has_work()

    def reset(self) -> None:
        self.engine.blocks.clear_prefix_cache()


def drive(driver: Any, w: Workload) -> dict:
    """Run a workload to the end through a driver -> its measurements (module docstring)."""
    pending = deque(range(len(w.prompts)))
    submitted: dict[int, float] = {}
    first_at: dict[tuple[int, int], float] = {}
    live, next_rid, tokens, turn_of = 0, len(w.prompts), 0, {}
    decode_s, decode_steps, steps = 0.0, 0, 0

    def submit(rid: int, prompt: list[int], max_tokens: int) -> None:
        submitted[rid] = time.perf_counter()
        driver.add(rid, prompt, w.n, max_tokens)

    driver.reset()
    start = last = time.perf_counter()
    remaining = {}  # rid -> samples still running
    while pending or driver.has_work():
        while pending and (w.concurrency is None or live < w.concurrency):
            i = pending.popleft()
            turn_of[i] = (i, 0)
            remaining[i] = w.n
            submit(i, w.prompts[i], w.max_tokens[i])
            live += 1
        done, started, prefilled = driver.step()
        now = time.perf_counter()
        steps += 1
        for key in started:
            first_at.setdefault(key, now)
        if not started and not prefilled and first_at:
            decode_s += now - last
            decode_steps += 1
        last = now
        for rid, index, prompt, out in done:
            tokens += len(out)
            first_at.setdefault((rid, index), now)
            episode, turn = turn_of[rid]
            if turn + 1 < w.turns:  # the episode continues at once from its cached prefix
                rid2, next_rid = next_rid, next_rid + 1
                turn_of[rid2] = (episode, turn + 1)
                remaining[rid2] = w.n
                submit(rid2, list(prompt) + list(out) + w.turn_tokens[episode], w.max_tokens[episode])
                live += 1
            remaining[rid] -= 1
            if not remaining[rid]:
                live -= 1
    wall = time.perf_counter() - start
    assert len(first_at) == w.num_samples, f"{w.name}: {len(first_at)} samples started, {w.num_samples} expected"
    ttft = sum(first_at[key] - submitted[key[0]] for key in first_at) / len(first_at)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": ttft, "steps": steps,
            "decode_steps": decode_steps, "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1)}


def warm_up(driver: Any, vocab_size: int, num_seqs: int, max_tokens: int | None = None) -> None:
    """num_seqs prompts of 16 tokens; sample j (row j: rows are taken lowest first) runs for
    num_seqs - j tokens (or max_tokens), so the rows in use shrink from the top by one per step and
    every decode graph bucket is captured before any timed row. (A decode launch spans rows [0,
    highest live row]: with j + 1 tokens for sample j, the top row lived longest and only the
    widest bucket was captured; the first timed rows then captured theirs.) Then
    for the native engine, one and two prompts of each prefill-graph length
    (runtime/engine/runner.py), alone, so that its graphs for small prefills (continuous refill's)
    are captured too."""
    prompts = [[(7 * j + k) % vocab_size for k in range(16)] for j in range(num_seqs)]
    drive(driver, Workload("warmup", prompts, [max_tokens or num_seqs - j for j in range(num_seqs)]))
    if driver.name != "native" or not driver.engine.runner.graph_prefill or driver.engine.states is not None:
        return
    engine = driver.engine
    from meshrl.runtime.engine.runner import _PREFILL_GRAPH_TOKENS

    for length in _PREFILL_GRAPH_TOKENS:
        if length + 2 > engine.max_model_len:  # the prompt and its two tokens must fit
            break
        for rows in (1, 2):
            prompts = [[(11 * j + 3 * k + length) % vocab_size for k in range(length)] for j in range(rows)]
            drive(driver, Workload("warmup", prompts, [2] * rows))


# ----------------------------------------------------------------------------- one shape, one engine


def weight_bytes(family: str, flavor: str, dtype: torch.dtype) -> int:
    """Bytes of the weights a decode step reads: every parameter except an untied input embedding
    (it gathers B rows), counted on the meta device."""
    from meshrl.models import get_family

    fam = get_family(family)
    with torch.device("meta"):
        model = fam.model_cls(fam.flavors[flavor])
    numel = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight
    if model.output_weight is not emb:
        numel -= emb.numel()
    return numel * dtype.itemsize


def model_weight_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads from a built model, in the dtypes it holds them
    (FP8 linears: their e4m3 weights and fp32 block scales), less an untied input embedding."""
    seen, total = set(), 0
    emb = model.tok_embeddings.weight
    for t in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("weight_scale_inv"))]:
        if id(t) in seen or (t is emb and model.output_weight is not emb):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def engine_sizes(engine: Any) -> dict:
    """What one token's k/v (every attention layer; MLA: its latent) and one sequence's
    linear-attention states take in a native engine, in bytes."""
    kv = engine.kv
    per_token = kv.bytes_per_block(len(kv.index), 1, kv.num_kv_heads, kv.head_dim, engine.dtype, kv.v_head_dim,
                                   kv.fp8)
    states = engine.states.nbytes() // engine.max_num_seqs if engine.states is not None else 0
    return {"kv_bytes_per_token": per_token, "state_bytes_per_seq": states}


def run_native(spec: dict, emit, sizes: dict) -> None:
    """Every workload of spec through one native engine of spec's shape; emit(row) per workload.
    With spec["model_dir"], the model is first written there for vLLM (bench_export.py). `sizes`
    gets the engine's kv_bytes_per_token and state_bytes_per_seq before the first row."""
    from meshrl.models import get_family
    from meshrl.runtime.engine.native import NativeEngine

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    fam = get_family(spec["family"])
    args = fam.flavors[spec["flavor"]]
    with torch.device("meta"):
        model = fam.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=spec["seed"])  # random weights, as runtime/engine/bench.py's
    model = model.to(dtype)
    if spec.get("model_dir"):
        from meshrl.runtime.engine.bench_export import export_for_vllm

        start = time.perf_counter()
        export_for_vllm(model, args, spec["model_dir"], dtype)
        print(f"meshrl bench engine: wrote {spec['model_dir']} for vLLM in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = NativeEngine(model, max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"], device=device,
                          dtype=dtype, num_blocks=spec.get("num_blocks"), max_num_batched_tokens=PREFILL_TOKENS,
                          prefix_sharing=True, attention=spec.get("attention", "auto"),
                          cuda_graphs=device.type == "cuda", seed=spec["seed"],
                          quantization=spec.get("quantization", "none"),
                          kv_cache_dtype=spec.get("kv_cache_dtype", "auto"))
    if spec.get("quantization", "none") != "none":  # FP8 linears: the bytes a step reads changed
        sizes["weight_bytes"] = model_weight_bytes(engine.model)
    settings = {"quantization": spec.get("quantization", "none"), "kv_cache_dtype": spec.get("kv_cache_dtype", "auto"),
                "prefix_sharing": engine.prefix_sharing, "cuda_graphs": engine.cuda_graphs, "attention": engine.attention,
                "max_num_seqs": spec["max_num_seqs"], "max_num_batched_tokens": PREFILL_TOKENS,
                "block_size": engine.block_size,
                "max_model_len": spec["max_model_len"], "kv_cache_blocks": engine.kv.num_blocks,
                "seeded_requests": True}
    sizes.update(engine_sizes(engine))
    settings.update(sizes)
    driver = NativeDriver(engine, spec["seed"])
    start = time.perf_counter()
    if device.type == "cuda":
        warm_up(driver, engine.vocab_size, spec["max_num_seqs"])
    settings["warmup_s"] = round(time.perf_counter() - start, 2)
    for name in spec["workloads"]:
        w = make_workload(name, engine.vocab_size, spec["scale"], spec["seed"], spec["batch_scale"])
        row = {"engine": "native", "workload": name, **drive(driver, w), "settings": settings}
        if device.type == "cuda":  # weights + KV cache + states + activations, since the engine was built
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        emit(row)
    engine.sleep()  # the KV cache and graphs go now: vLLM's child wants the memory next


def _row(spec: dict, stats: dict, w: Workload, sizes: dict, gbps: float | None) -> dict:
    """A result line: the shape, the workload's sizes, the measurements and the floor."""
    floor = decode_floor(w, sizes["weight_bytes"], sizes["kv_bytes_per_token"], gbps, sizes["state_bytes_per_seq"])
    row = {"family": spec["family"], "flavor": spec["flavor"], "dtype": spec["dtype"], "engine": stats.pop("engine"),
           "workload": w.name, "requests": len(w.prompts), "n": w.n, "turns": w.turns, "samples": w.num_samples,
           "concurrency": w.concurrency, **stats, **floor}
    if floor:
        row["step_vs_floor"] = row["decode_step_ms"] / floor["floor_step_ms"]
        row["wall_vs_floor"] = floor["floor_tokens_per_s"] / row["tokens_per_s"]
    settings = row.pop("settings")
    row["settings"] = settings
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


# ----------------------------------------------------------------------------- the vLLM side


class VLLMDriver:
    """vLLM's LLMEngine (in its default multiprocess mode) behind the timing loop; DELTA outputs."""

    name = "vllm"

    def __init__(self, engine: Any, vllm: Any, logprobs: bool = True) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.vllm, self.logprobs = engine, vllm, logprobs
        self._prompt, self._delta = TokensPrompt, RequestOutputKind.DELTA
        self._live: dict[str, tuple[list[int], list[list[int]], int]] = {}  # rid -> (prompt, tokens per sample, left)

    def add(self, rid: int, prompt: list[int], n: int, max_tokens: int) -> None:
        params = self.vllm.SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True,
                                          logprobs=0 if self.logprobs else None, output_kind=self._delta,
                                          stop_token_ids=[], detokenize=False)
        self.engine.add_request(str(rid), self._prompt(prompt_token_ids=list(prompt)), params)
        self._live[str(rid)] = (list(prompt), [[] for _ in range(n)], n)

    def step(self):
        done, started = [], []
        for out in self.engine.step():
            prompt, samples, left = self._live[out.request_id]
            rid = int(out.request_id)
            for o in out.outputs:
                if o.token_ids and not samples[o.index]:
                    started.append((rid, o.index))
                samples[o.index].extend(o.token_ids)
                if o.finish_reason is not None:
                    done.append((rid, o.index, prompt, samples[o.index]))
                    left -= 1
            if left:
                self._live[out.request_id] = (prompt, samples, left)
            else:
                del self._live[out.request_id]
        return done, started, False

    def has_work(self) -> bool:
        return bool(self._live)

    def reset(self) -> None:
        if hasattr(self.engine, "reset_prefix_cache"):
            self.engine.reset_prefix_cache()


def vllm_settings(engine: Any, args: dict) -> dict:
    """What vLLM actually runs with (its resolved config where it has one), for the rows' log."""
    cfg = getattr(engine, "vllm_config", None)
    out = {k: args[k] for k in ("enable_prefix_caching", "async_scheduling", "enforce_eager", "max_num_seqs",
                                "max_model_len", "gpu_memory_utilization", "logprobs_mode", "load_format")}
    out["quantization"] = args.get("quantization", "none")
    out["kv_cache_dtype"] = args.get("kv_cache_dtype", "auto")
    if "language_model_only" in args:
        out["language_model_only"] = args["language_model_only"]
    out["vllm_multiprocessing"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    out["seeded_requests"] = False
    if cfg is not None:
        sched, cache, comp = cfg.scheduler_config, cfg.cache_config, cfg.compilation_config
        out.update(async_scheduling=sched.async_scheduling, max_num_batched_tokens=sched.max_num_batched_tokens,
                   enable_prefix_caching=cache.enable_prefix_caching, block_size=cache.block_size,
                   num_gpu_blocks=cache.num_gpu_blocks, cudagraph_mode=str(comp.cudagraph_mode),
                   compilation_mode=str(comp.mode), enforce_eager=cfg.model_config.enforce_eager)
    return out


def vllm_engine_args(spec: dict, args: Any) -> dict:
    """vLLM's EngineArgs for one shape: the folder the parent exported (spec["model_dir"], the
    native engine's weights; module docstring), else random "dummy" weights from a config.json
    alone; no tokenizer; vision-language folders (Qwen3.5) with their vision tower left out."""
    folder = spec.get("model_dir")
    if folder:
        config = json.loads((Path(folder) / "config.json").read_text())
    else:
        folder = tempfile.mkdtemp(prefix="meshrl-bench-vllm-")
        config = args.to_hf_config(dtype=getattr(torch, spec["dtype"]))
        (Path(folder) / "config.json").write_text(json.dumps(config))
    engine_args = dict(model=folder, skip_tokenizer_init=True, dtype=spec["dtype"], seed=spec["seed"],
                       max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                       gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.9), enforce_eager=False,
                       enable_prefix_caching=True, async_scheduling=True,
                       load_format="safetensors" if spec.get("model_dir") else "dummy",
                       logprobs_mode="processed_logprobs", generation_config="vllm", disable_log_stats=True)
    if spec.get("quantization", "none") != "none":
        engine_args["quantization"] = spec["quantization"]
    if spec.get("kv_cache_dtype", "auto") != "auto":
        engine_args["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if "vision_config" in config:
        engine_args["language_model_only"] = True
    return engine_args


def _check_architecture(vllm: Any, folder: str) -> None:
    """Fail at once (not after minutes of start-up) when this vLLM has no class for the folder's model."""
    registry = getattr(vllm, "ModelRegistry", None)
    if registry is None:  # the unit tests' fake vLLM
        return
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    missing = [a for a in archs if a not in registry.get_supported_archs()]
    if missing:
        raise ValueError(f"vLLM {getattr(vllm, '__version__', '?')} has no model class {missing} ({folder}/config.json)")


def run_vllm(spec: dict, emit) -> None:
    """Every workload of spec through one vLLM engine of spec's shape (`vllm_engine_args`);
    emit(row) per workload."""
    import vllm
    from meshrl.models import get_family

    fam = get_family(spec["family"])
    args = fam.flavors[spec["flavor"]]
    engine_args = vllm_engine_args(spec, args)
    _check_architecture(vllm, engine_args["model"])
    start = time.perf_counter()
    kwargs = {}
    try:
        from vllm.usage.usage_lib import UsageContext
    except ImportError:  # the unit tests' fake vLLM has no usage module
        pass
    else:
        kwargs["usage_context"] = UsageContext.LLM_CLASS  # what vllm.LLM uses: its defaults
    engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**engine_args), **kwargs)
    settings = vllm_settings(engine, engine_args)
    settings["startup_s"] = round(time.perf_counter() - start, 1)
    vocab = args.vocab_size
    driver = VLLMDriver(engine, vllm)
    start = time.perf_counter()
    warm_up(driver, vocab, num_seqs=64, max_tokens=16)  # vLLM captured its graphs at start-up
    settings["warmup_s"] = round(time.perf_counter() - start, 2)
    for name in spec["workloads"]:
        w = make_workload(name, vocab, spec["scale"], spec["seed"], spec["batch_scale"])
        emit({"engine": "vllm", "workload": name, **drive(driver, w), "settings": settings})


# ----------------------------------------------------------------------------- the command

ROW_MARK = "MESHRL_BENCH_ROW "  # the child's result lines (vLLM logs to stdout too)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshrl bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=["vllm"], default=None, help="also run every workload through vLLM")
    p.add_argument("--family", default="qwen3", help="a native model family (meshrl.models.MODEL_FAMILIES)")
    p.add_argument("--flavors", default=None, help="comma-separated flavors of the family; default (qwen3) 0.6B,1.7B "
                                                   "on CUDA (add 8B where memory allows), tiny on CPU; other "
                                                   "families: debug on CPU, required on CUDA")
    p.add_argument("--workloads", default="all", help=f"comma-separated of {','.join(WORKLOADS)}, or all")
    p.add_argument("--out", default=None, help="also append the rows to this JSONL file")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and completion length")
    p.add_argument("--batch-scale", type=float, default=1.0, help="multiply every number of prompts/requests")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth for the floor (default by name)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    p.add_argument("--vllm-timeout", type=float, default=420.0, help="seconds for one shape's vLLM child")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="rows of both engines")
    p.add_argument("--attention", choices=["auto", "torch", "triton"], default="auto",
                   help="the native engine's decode attention backend")
    p.add_argument("--export-dir", default=None, help="where the model folder for vLLM is written (a temporary "
                                                      "folder inside it, removed after the shape; default: the "
                                                      "system's temporary directory)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: FP8 weights in both engines (native: 128x128 block scales; vLLM: quantization='fp8')")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: an FP8 KV cache in both")
    p.add_argument("--seed", type=int, default=0)
    return p


def _bandwidth(opts: argparse.Namespace, device: torch.device) -> float | None:
    if opts.hbm_gbps or device.type != "cuda":
        return opts.hbm_gbps
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_GBPS.items() if k in name), None)


def _spec(opts: argparse.Namespace, flavor: str, workloads: list[str], dtype: torch.dtype, vocab: int) -> dict:
    """What one shape's runs share (JSON: the vLLM child gets it on its command line)."""
    made = [make_workload(name, vocab, opts.scale, opts.seed, opts.batch_scale) for name in workloads]
    max_model_len = -(-(max(w.max_context() for w in made) + 1) // 16) * 16
    blocks = max((w.concurrency or len(w.prompts)) * w.n * (max_model_len // 16) for w in made) + 1
    return {"family": opts.family, "flavor": flavor, "dtype": str(dtype).removeprefix("torch."),
            "device": opts.device, "seed": opts.seed, "scale": opts.scale, "batch_scale": opts.batch_scale,
            "workloads": workloads, "max_num_seqs": opts.max_num_seqs, "attention": opts.attention,
            "max_model_len": max_model_len, "gpu_memory_utilization": opts.gpu_memory_utilization,
            "quantization": opts.quantization, "kv_cache_dtype": opts.kv_cache_dtype,
            "num_blocks": None if opts.device == "cuda" else 2 * blocks}


def _run_vllm_child(spec: dict, timeout: float, emit) -> None:
    """One shape's vLLM rows from a child process; a failure becomes an error row, not an exit."""
    import signal
    import threading

    def kill() -> None:  # the whole group: also what the child left behind when it exited
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing of it is left
            pass

    def terminated(signum, frame) -> None:  # `timeout` stopping this process: the child goes too
        raise SystemExit(128 + signum)

    cmd = [sys.executable, "-m", MODULE, "--vllm-child", json.dumps(spec)]
    # its own process group, killed as a whole (on timeout, or when this process is terminated):
    # vLLM's engine-core process holds the GPU and must not outlive the benchmark
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
    timer = threading.Timer(timeout, kill)
    timer.start()
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM's own log lines pass through to stderr
            if line.startswith(ROW_MARK):
                emit(json.loads(line[len(ROW_MARK):]))
            else:
                print(line, end="", file=sys.stderr, flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        kill()
        signal.signal(signal.SIGTERM, previous)
    if code != 0:
        emit({"engine": "vllm", "error": f"the vLLM child exited with {code} (timeout {timeout:.0f} s); "
                                         "its log is above on stderr"})


def main(argv: list[str]) -> None:
    opts = _parser().parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("meshrl bench engine: --device cuda but CUDA is not available")
    workloads = list(WORKLOADS) if opts.workloads == "all" else opts.workloads.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"meshrl bench engine: unknown workload(s) {unknown} (known: {', '.join(WORKLOADS)})")
    flavors = (opts.flavors or default_flavors(opts.family, device, "0.6B,1.7B")).split(",")
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    compare = opts.compare == "vllm"
    if compare and not vllm_installed():
        print("meshrl bench engine: vLLM is not installed here (docs/inference.md); running the native engine alone",
              file=sys.stderr, flush=True)
        compare = False
    gbps = _bandwidth(opts, device)
    out = open(opts.out, "a") if opts.out else None
    for flavor in flavors:
        check_flavor(opts.family, flavor)
        vocab = flavor_vocab(opts.family, flavor)
        spec = _spec(opts, flavor, workloads, dtype, vocab)
        sizes = {"weight_bytes": weight_bytes(opts.family, flavor, dtype)}

        def emit(stats: dict) -> None:
            if "error" in stats:
                row = {"family": spec["family"], "flavor": flavor, **stats}
            else:
                w = make_workload(stats["workload"], vocab, spec["scale"], spec["seed"], spec["batch_scale"])
                row = _row(spec, dict(stats, device=_device_name(device), hbm_gbps=gbps), w, sizes, gbps)
            line = json.dumps(row)
            print(line, flush=True)
            if out is not None:
                out.write(line + "\n")
                out.flush()

        export = tempfile.mkdtemp(prefix="meshrl-bench-vllm-", dir=opts.export_dir) if compare else None
        try:
            if export:
                spec["model_dir"] = f"{export}/model"
            run_native(spec, emit, sizes)
            _free(device)
            if compare:
                _run_vllm_child(spec, opts.vllm_timeout, emit)
        finally:
            if export:
                shutil.rmtree(export, ignore_errors=True)
    if out is not None:
        out.close()


def usage_error(message: str) -> None:
    """One line on stderr, exit status 2 (argparse's for a bad argument)."""
    print(f"meshrl bench engine: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_family(family: str) -> None:
    """SystemExit naming the native families unless `family` is one."""
    from meshrl.models import MODEL_FAMILIES

    if family not in MODEL_FAMILIES:
        usage_error(f"--family {family!r} is not a native model family (known: {', '.join(sorted(MODEL_FAMILIES))})")


def check_flavor(family: str, flavor: str) -> None:
    """SystemExit naming the family's flavors unless `flavor` is one."""
    from meshrl.models import get_family

    check_family(family)
    flavors = get_family(family).flavors
    if flavor not in flavors:
        usage_error(f"unknown flavor {flavor!r} of {family} (known: {', '.join(flavors)})")


def default_flavors(family: str, device: torch.device, qwen3_cuda: str) -> str:
    """The flavor(s) when none is named: Qwen3's `qwen3_cuda` on CUDA and tiny on CPU, another
    family's debug on CPU; on CUDA another family needs one named (SystemExit)."""
    check_family(family)
    if family == "qwen3":
        return qwen3_cuda if device.type == "cuda" else "tiny"
    if device.type == "cuda":
        from meshrl.models import get_family

        usage_error(f"name the flavor(s) of {family} to run on CUDA (known: {', '.join(get_family(family).flavors)})")
    return "debug"


def flavor_vocab(family: str, flavor: str) -> int:
    from meshrl.models import get_family

    return get_family(family).flavors[flavor].vocab_size


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _free(device: torch.device) -> None:
    """Give the native engine's memory back before vLLM's child asks for its share of the GPU."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def child_main(spec_json: str) -> None:
    """The vLLM child: run one shape's workloads, print each row after ROW_MARK."""
    run_vllm(json.loads(spec_json), lambda row: print(ROW_MARK + json.dumps(row), flush=True))


if __name__ == "__main__":  # vLLM's "mp" executor re-imports this module in its worker: build nothing then
    if sys.argv[1:2] == ["--vllm-child"]:
        child_main(sys.argv[2])
    else:
        main(sys.argv[1:])
