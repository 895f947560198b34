"""`meshrl bench engine`: native engine throughput on a fixed synthetic workload, beside transformers.

    meshrl bench engine [--family qwen3] [--flavor 0.6B] [--num-seqs 256] [--prompt-tokens 64] [--gen-tokens 256]
                        [--device cuda|cpu] [--no-hf] [--block-size 16] [--attention auto|torch|triton]
                        [--no-cuda-graphs] [--max-num-batched-tokens N] [--seed 0] [--profile TRACE]
                        [--stub] [--quantization none|fp8] [--kv-cache-dtype auto|fp8]

A model of the flavor (of any native family, `--family`; Qwen3 by default) with random weights; `num_seqs` random prompts
of `prompt_tokens` tokens, all submitted at once, each sampled (temperature 1, no truncation, no
stop token) for exactly `gen_tokens` tokens. The KV cache is sized to the workload. On CUDA one
untimed run of the same shape (other prompts, so nothing comes from the prefix cache) captures the
CUDA graphs first. Prints one JSON line:

- tokens_per_s: generated tokens / wall time from submission to the last completion;
- time_to_first_token_s: mean over sequences of the time from submission to their first token;
- decode_step_ms: mean wall time of the steps after every sequence has its first token (pure
  decode steps of the whole batch: what the memory-bandwidth floor of a decode step compares to);
- peak_memory_gib: CUDA: peak allocated memory of the engine run (weights + KV cache + activations);
  CPU: the process's peak resident memory;
- hf_tokens_per_s, speedup_vs_hf (unless --no-hf): transformers `generate` on the same weights
  (saved through models/hf.py), same dtype, same batch and lengths, sampling, EOS off.

With --stub, a stand-in with the flavor's vocabulary but one 16-wide attention head and no
layers replaces the model: compute is negligible, so the run measures the engine's own cost per
step (scheduling and bookkeeping on the host, copies, kernel launches, sampling over the full
vocabulary). Its decode_step_ms against the real model's says how much of a step is the engine.

--quantization fp8 keeps the decoder linears in FP8 (e4m3, 128x128 block scales) and
--kv-cache-dtype fp8 the paged cache in e4m3 (docs/inference.md, FP8); the result then also
carries weight_quantize_ms, the time to quantise the whole model's bf16 weights in place (what a
weight sync adds on the engine's side).

With --profile TRACE, a further run of the same shape is profiled (torch.profiler, host and
device) over 20 of its pure decode steps: the top operators by self device time (CUDA) or self
host time (CPU) go to stderr, the timeline to the Chrome trace TRACE (gaps between device
kernels there are host time the device waited for).

Defaults: the 0.6B flavor in bf16 on CUDA, the demo's tiny flavor in fp32 on CPU. Nothing is
asserted here; docs/benchmarks.md records runs.

With `--compare vllm` or `--workloads`, the command runs the RL workload matrix instead (plain
batches, GRPO groups, a 4k-token generation, multi-turn continuation, continuous refill), through
the native engine and, with `--compare vllm`, through vLLM in the same run: see
runtime/engine/bench_matrix.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

import torch
from torch import nn

from meshrl.models import get_family
from meshrl.runtime.engine.api import Request, SamplingParams
from meshrl.runtime.engine.bench_matrix import check_flavor, default_flavors
from meshrl.runtime.engine.native import NativeEngine


def flavor_args(family: str, flavor: str):
    check_flavor(family, flavor)  # SystemExit naming the families / flavors
    return get_family(family).flavors[flavor]


def build_model(family: str, flavor: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A randomly initialised model of the flavor on device in dtype -> (model, args)."""
    fam = get_family(family)
    args = flavor_args(family, flavor)
    with torch.device("meta"):
        model = fam.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model.to(dtype), args


class StubModel(nn.Module):
    """The models/ contract at negligible compute: embedding, one attention call with two 16-wide
    query heads on one kv head (so k/v still go through the paged cache and its kernels, GQA
    included), output weight tied to the embedding. For measuring the engine's own cost (--stub)."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict()

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attn=None) -> torch.Tensor:
        """tokens, positions (B, T) -> (B, T, dim); positions only reach the attention context."""
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        kv = h[:, None]  # (B, 1, T, dim)
        q = torch.cat([kv, kv], dim=1)  # (B, 2, T, dim)
        if attn is None:
            out = nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        else:
            out = attn.attend(0, q, kv, kv)
        return h + out[:, 0]


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _submit(engine: NativeEngine, prompts: list[list[int]], gen_tokens: int, seed: int) -> None:
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=1.0, max_tokens=gen_tokens, seed=seed * 1_000_003 + i)
        engine.add(Request(i, prompt, sampling))


def run_engine(engine: NativeEngine, prompts: list[list[int]], gen_tokens: int, seed: int) -> dict:
    """Submit every prompt at once and step to the end -> wall_s, tokens, mean time to first
    token, mean wall time of a pure decode step."""
    _sync(engine.device)
    start = time.perf_counter()
    _submit(engine, prompts, gen_tokens, seed)
    first_tokens = start_tokens = engine.num_first_tokens
    ttft_sum, tokens, decode_s, decode_steps = 0.0, 0, 0.0, 0
    now = 0.0
    while engine.has_work():
        all_started = first_tokens - start_tokens == len(prompts)
        for completion in engine.step():
            tokens += len(completion.token_ids)
        step_s = time.perf_counter() - start - now
        now += step_s
        if all_started:
            decode_s += step_s
            decode_steps += 1
        ttft_sum += (engine.num_first_tokens - first_tokens) * now
        first_tokens = engine.num_first_tokens
    _sync(engine.device)
    return {"wall_s": time.perf_counter() - start, "tokens": tokens, "ttft_s": ttft_sum / len(prompts),
            "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1)}


def profile_engine(engine: NativeEngine, prompts: list[list[int]], gen_tokens: int, seed: int, trace: str,
                   num_steps: int = 20) -> None:
    """Run the workload again, profiling num_steps pure decode steps; table to stderr, trace to file."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    start_tokens = engine.num_first_tokens
    _submit(engine, prompts, gen_tokens, seed)
    while engine.has_work() and engine.num_first_tokens - start_tokens < len(prompts):
        engine.step()
    for _ in range(2):  # past the step where the last prompts joined the decode batch
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            if engine.has_work():
                engine.step()
        _sync(engine.device)
    while engine.has_work():
        engine.step()
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=30), file=sys.stderr, flush=True)
    prof.export_chrome_trace(trace)


def run_hf(model, args, prompts: list[list[int]], gen_tokens: int, device: torch.device, dtype: torch.dtype) -> float:
    """transformers generate on the same weights and workload -> generated tokens per second."""
    from transformers import AutoModelForCausalLM

    from meshrl.models.hf import save_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_model(model, args, f"{tmp}/model")
        hf = AutoModelForCausalLM.from_pretrained(f"{tmp}/model", dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        if device.type == "cuda":  # warm up kernels and allocator
            hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        _sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=gen_tokens, min_new_tokens=gen_tokens, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), ids.shape[1] + gen_tokens)
    return len(prompts) * gen_tokens / elapsed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3", help="a native model family (meshrl.models.MODEL_FAMILIES)")
    parser.add_argument("--flavor", default=None, help="a flavor of the family; default (qwen3) 0.6B on CUDA, tiny on "
                                                       "CPU; other families: debug on CPU, required on CUDA")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", metavar="TRACE", default=None,
                        help="profile 20 decode steps of a further run: top ops to stderr, Chrome trace to TRACE")
    parser.add_argument("--stub", action="store_true",
                        help="a stand-in model of negligible compute (implies --no-hf): the engine's own cost per step")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="fp8: FP8 (e4m3, 128x128 block-scaled) decoder weights in the engine")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the paged KV cache in e4m3 with per-(token, head) scales")
    return parser


def _build(opts: argparse.Namespace, device: torch.device, flavor: str, dtype: torch.dtype):
    """The model (real or stub) and an engine over it with a KV cache sized to the workload ->
    (model, args or None, engine); CUDA's peak-memory count starts before the engine."""
    args = None
    if opts.stub:
        torch.manual_seed(opts.seed)
        model = StubModel(flavor_args(opts.family, flavor).vocab_size).to(device=device, dtype=dtype)
    else:
        model, args = build_model(opts.family, flavor, device, dtype, opts.seed)
    max_model_len = opts.prompt_tokens + opts.gen_tokens
    blocks_per_seq = -(-(max_model_len - 1) // opts.block_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = NativeEngine(model, max_num_seqs=opts.num_seqs, max_model_len=max_model_len, device=device,
                          dtype=dtype, block_size=opts.block_size, num_blocks=opts.num_seqs * blocks_per_seq + 1,
                          max_num_batched_tokens=opts.max_num_batched_tokens, attention=opts.attention,
                          cuda_graphs=device.type == "cuda" and not opts.no_cuda_graphs, seed=opts.seed,
                          quantization=opts.quantization, kv_cache_dtype=opts.kv_cache_dtype)
    return model, args, engine


def time_weight_quantize(engine: NativeEngine, dtype: torch.dtype, repeats: int = 3) -> float:
    """Milliseconds to quantise every FP8 weight of the engine from bf16 tensors, in place (the
    engine's share of a weight sync; the source is each weight dequantised, made once up front)."""
    from meshrl.models.common.fp8 import Fp8Linear, dequantize_blocks

    modules = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    sources = [dequantize_blocks(m.weight, m.weight_scale_inv, dtype) for m in modules]
    best = float("inf")
    for _ in range(repeats):
        _sync(engine.device)
        start = time.perf_counter()
        for m, w in zip(modules, sources):
            m.load_weight(w)
        _sync(engine.device)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main(argv: list[str]) -> None:
    if any(a.split("=")[0] in ("--compare", "--workloads", "--flavors") for a in argv):
        from meshrl.runtime.engine import bench_matrix

        bench_matrix.main(argv)
        return
    opts = _parser().parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("meshrl bench engine: --device cuda but CUDA is not available")
    flavor = opts.flavor or default_flavors(opts.family, device, "0.6B")
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    model, args, engine = _build(opts, device, flavor, dtype)
    vocab = model.output_weight.shape[0]
    if device.type == "cuda":  # capture the graphs of this shape outside the timed run
        run_engine(engine, random_prompts(opts.num_seqs, opts.prompt_tokens, vocab, opts.seed + 1), opts.gen_tokens,
                   opts.seed + 1)
    prompts = random_prompts(opts.num_seqs, opts.prompt_tokens, vocab, opts.seed)
    stats = run_engine(engine, prompts, opts.gen_tokens, opts.seed)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "family": opts.family, "flavor": flavor + (" (stub)" if opts.stub else ""),
        "dtype": str(dtype).removeprefix("torch."),
        "num_seqs": opts.num_seqs, "prompt_tokens": opts.prompt_tokens, "gen_tokens": opts.gen_tokens,
        "attention": engine.attention, "cuda_graphs": engine.cuda_graphs,
        "quantization": opts.quantization, "kv_cache_dtype": opts.kv_cache_dtype,
        "tokens_per_s": stats["tokens"] / stats["wall_s"],
        "time_to_first_token_s": stats["ttft_s"],
        "decode_step_ms": stats["decode_step_ms"],
        "peak_memory_gib": peak,
        "wall_s": stats["wall_s"],
    }
    if opts.quantization == "fp8":
        result["weight_quantize_ms"] = time_weight_quantize(engine, dtype)
    if opts.profile:
        profile_engine(engine, random_prompts(opts.num_seqs, opts.prompt_tokens, vocab, opts.seed + 2),
                       opts.gen_tokens, opts.seed + 2, opts.profile)
    if not (opts.no_hf or opts.stub):
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf_tps = run_hf(model, args, prompts, opts.gen_tokens, device, dtype)
        result["hf_tokens_per_s"] = hf_tps
        result["speedup_vs_hf"] = result["tokens_per_s"] / hf_tps
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
