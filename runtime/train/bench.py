"""`meshrl bench trainer`: training throughput and MFU of one model shape under a parallel layout.

    meshrl bench trainer --flavor 0.6B --seq-len 16384 --steps 10 [--nproc 2 --dp-shard 2 --cp 1 --ep 1]
                         [--ac none|full|selective] [--compile] [--attention auto|sdpa|flex|varlen]
                         [--lora-rank 16 --lora-alpha 32 --lora-targets q_proj,k_proj,...]

Random weights (built on the meta device, sharded, then initialised shard by shard, so no rank
ever holds the full model) and random tokens. Every step each data rank trains
`--rows` packed rows of `--seq-len` tokens, each row holding `--docs` documents of equal
length, through the real `Trainer.sft_step` (chunked logprob head, document-masked attention,
FSDP2, AdamW). With `--nproc N > 1` the command re-runs itself under torchrun.

Prints one JSON line: tokens_per_s (all ranks), mfu, peak_memory_gib (max over ranks),
step_s (median of the measured steps), and the settings. With `--compile` also `compiled_graphs`
and `graph_breaks` (rank 0's dynamo counters: a block should be one graph; breaks inside the
blocks cost host time on every step, docs/parallelism.md).

FLOPs per step (model FLOPs: recomputation by activation checkpointing is not counted):

    6 * N_active * tokens  +  sum over attention layers of 6 * n_heads * (qk_head_dim + v_head_dim) * pairs
                           +  sum over linear-attention layers of 18 * Hv * Dk * Dv * tokens

- N_active: parameters used by matmuls per token: every Linear weight, the LM head (V x dim,
  counted even when tied to the embedding, whose lookup is not a matmul), and for MoE layers
  the router plus top_k / num_experts of the expert weights. 6 = 2 (multiply-add) x 3
  (forward + backward w.r.t. activations and weights).
- pairs: (query, key) pairs attention computes, causal within each document:
  sum over documents of L * (L + 1) / 2 (a sliding layer: at most `sliding_window` keys per
  query). QK^T costs 2 * qk_head_dim and PV 2 * v_head_dim FLOPs per pair and head in the forward,
  x3 for training (qk = v = head_dim for GQA; MLA: nope + rope and v_head_dim, the trainer's
  expanded form; GLM-5's key selection is counted as dense causal attention).
- linear-attention (Gated DeltaNet) layers: the delta-rule state update and read, ~6 * Dk * Dv
  per token and value head in the forward, x3 for training (the chunked form's intra-chunk
  products and the short conv are not counted).

With `--lora-rank R` (docs/lora.md) the base is frozen and only the adapters train: the frozen
matmuls cost 4 (forward + input gradients) instead of 6 per parameter and token, the adapters 6,
so FLOPs = 4 * N_active * tokens + 6 * N_adapter * tokens + attention; `trainable_params` counts
N_adapter.

MFU = FLOPs / step_s / (world size x peak), peak = 989 TFLOP/s dense bf16 for H100/H200
(`--peak-tflops` for other devices; on CPU mfu is null).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

MODULE = "meshrl.runtime.train.bench"
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrl bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen3", help="model family (a key of meshrl.models.MODEL_FAMILIES)")
    p.add_argument("--flavor", default="0.6B", help="flavor of the family")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per packed row")
    p.add_argument("--docs", type=int, default=1, help="documents per row (equal lengths)")
    p.add_argument("--rows", type=int, default=1, help="packed rows per data rank per step")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs); > 1 runs under torchrun")
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--ac-every", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument("--reshard-after-forward", default="auto", choices=["auto", "true", "false"],
                   help="FSDP2 (trainer.parallel.reshard_after_forward); auto: false on one rank without LoRA, "
                        "else true")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flex", "varlen", "flash_attn", "split"])
    p.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per chunk of the logprob head")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default by name)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the flavor's vocabulary")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank; 0 trains every weight (full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (scale alpha / rank)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated LoRA target modules (HF or our names)")
    p.add_argument("--profile", action="store_true",
                   help="after the measured steps, profile one more step and print the top kernels and host ops (rank 0)")
    return p.parse_args(argv)


def active_matmul_params(model: nn.Module) -> int:
    """N_active of the FLOP formula (module docstring). Call before parallelize (full shapes)."""
    from meshrl.models.common.moe import moe_layers

    expert_fraction = {id(m.experts): m.top_k / m.num_experts for m in moe_layers(model)}
    total = 0
    for module in model.modules():
        if id(module) in expert_fraction:  # grouped experts: only top_k of num_experts run per token
            total += int(sum(p.numel() for p in module.parameters(recurse=False)) * expert_fraction[id(module)])
        elif isinstance(module, nn.Linear):
            total += module.weight.numel()
    if getattr(model, "output", None) is None:  # tied head: the embedding matrix is the LM head
        total += model.output_weight.numel()
    return total


def attention_pairs(seq_len: int, docs: int, window: int | None = None) -> int:
    """(query, key) pairs of one row of `docs` equal documents, causal (within `window` keys if given)."""
    lengths = [seq_len // docs + (1 if i < seq_len % docs else 0) for i in range(docs)]
    if window is None:
        return sum(n * (n + 1) // 2 for n in lengths)
    w = window  # the first w queries of a document see every earlier key, later ones w keys each
    return sum(n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + (n - w) * w for n in lengths)


def attention_layers(args) -> list[tuple[str, int, int, int]]:
    """Each layer's attention for the FLOP count: ("full" | "sliding", query heads, q/k head dim,
    v head dim) or ("linear", value heads, key head dim, value head dim) (Gated DeltaNet)."""
    layer_types = tuple(getattr(args, "layer_types", ()) or ())
    out = []
    for i in range(args.n_layers):
        kind = layer_types[i] if layer_types else "full_attention"
        if kind == "linear_attention":
            out.append(("linear", args.linear_v_heads, args.linear_k_dim, args.linear_v_dim))
        elif hasattr(args, "qk_nope_head_dim"):  # MLA: q/k head dim nope + rope, v its own
            out.append(("full", args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim))
        else:
            out.append(("sliding" if kind == "sliding_attention" else "full", args.n_heads, args.head_dim,
                        args.head_dim))
    return out


def attention_flops(args, seq_len: int, docs: int, rows: int) -> float:
    """Attention FLOPs of one training step over `rows` rows (module docstring): 6 x heads x
    (q/k dim + v dim) per pair and layer; a linear layer 18 x value heads x Dk x Dv per token."""
    total = 0.0
    for kind, heads, dk, dv in attention_layers(args):
        if kind == "linear":
            total += 18.0 * heads * dk * dv * seq_len
        else:
            window = getattr(args, "sliding_window", None) if kind == "sliding" else None
            total += 6.0 * heads * (dk + dv) * attention_pairs(seq_len, docs, window)
    return total * rows


def step_flops(n_active: int, tokens: int, attention: float, n_adapter: int | None = None) -> float:
    """Model FLOPs of one step (module docstring); `attention`: `attention_flops` of the step's rows;
    `n_adapter`: LoRA's adapter parameters (None: full fine-tuning)."""
    matmul = 6.0 * n_active if n_adapter is None else 4.0 * n_active + 6.0 * n_adapter
    return matmul * tokens + attention


def peak_flops(opts: argparse.Namespace, device: torch.device) -> float | None:
    if opts.peak_tflops is not None:
        return opts.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def make_rows(opts, vocab_size: int, num_rows: int, seed: int):
    """`num_rows` packed rows of random tokens, `opts.docs` equal documents each, all tokens trained."""
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    rows = []
    lengths = [opts.seq_len // opts.docs + (1 if i < opts.seq_len % opts.docs else 0) for i in range(opts.docs)]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    for _ in range(num_rows):
        ids = torch.randint(3, vocab_size, (1, opts.seq_len), generator=gen)
        rows.append(TensorDict({
            "input_ids": ids, "position_ids": positions, "doc_ids": doc_ids,
            "targets": torch.roll(ids, -1, dims=1), "loss_mask": torch.ones(1, opts.seq_len, dtype=torch.bool),
        }, batch_size=[1, opts.seq_len]))
    return rows


def run_rank(opts: argparse.Namespace) -> dict | None:
    """The benchmark on this rank; returns the result on rank 0."""
    cuda = torch.cuda.is_available() if opts.device == "auto" else opts.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer, args, n_active, dims, dtype = _build(opts, cuda, rank, world)
    device = trainer.device
    rows = make_rows(opts, args.vocab_size, opts.rows, seed=trainer.meshes.data_rank)
    tokens = opts.rows * opts.seq_len * dims.num_data_ranks
    times = []
    for step in range(opts.warmup + opts.steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        trainer.sft_step(rows, num_loss_tokens=tokens)
        if cuda:
            torch.cuda.synchronize()
        if step >= opts.warmup:
            times.append(time.perf_counter() - start)
        if cuda and step == 0:
            torch.cuda.reset_peak_memory_stats(device)
    if opts.profile:
        _profile(trainer, rows, tokens, cuda, rank)
    peak_gib = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak_gib, op=dist.ReduceOp.MAX)
    step_s = statistics.median(times)
    # a DTensor's numel is its global one: the adapters' parameter count over all ranks
    n_adapter = sum(p.numel() for p in trainer.optimizer.param_groups[0]["params"]) if opts.lora_rank else None
    flops = step_flops(n_active, tokens, attention_flops(args, opts.seq_len, opts.docs, opts.rows * dims.num_data_ranks),
                       n_adapter)
    peak = peak_flops(opts, device)
    result = {
        "bench": "trainer", "family": opts.family, "flavor": opts.flavor, "world_size": world,
        "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "ep": dims.ep,
        "seq_len": opts.seq_len, "docs": opts.docs, "rows": opts.rows, "ac": opts.ac, "compile": opts.compile,
        "reshard_after_forward": opts.reshards,
        # one document per row (and no cp): the trainer uses plain causal SDPA whatever the backend
        "attention": "sdpa-causal" if opts.docs == 1 and dims.cp == 1 else trainer.attention,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "lora_rank": opts.lora_rank, "trainable_params": n_adapter,
        "active_params": n_active, "tokens_per_step": tokens,
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
        "tflops_per_device": round(flops / step_s / world / 1e12, 2),
        "mfu": round(flops / step_s / (world * peak), 4) if peak else None,
        "peak_memory_gib": round(float(peak_gib), 2) if cuda else None,
        **_graph_counts(opts.compile),
    }
    dist.destroy_process_group()
    return result if rank == 0 else None


def _graph_counts(compiled: bool) -> dict:
    """Dynamo's count of distinct compiled graphs and of graph breaks in this process (None uncompiled)."""
    if not compiled:
        return {"compiled_graphs": None, "graph_breaks": None}
    from torch._dynamo.utils import counters

    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _build(opts: argparse.Namespace, cuda: bool, rank: int, world: int):
    """(Trainer over the parallelized random model, its args, active matmul parameters, ParallelDims,
    compute dtype)."""
    from meshrl.models import get_family
    from meshrl.parallel import parallelize
    from meshrl.parallel.dims import ParallelDims, build_meshes
    from meshrl.runtime.config import OptimConfig, ParallelConfig
    from meshrl.runtime.layout import pick_device
    from meshrl.runtime.train.trainer import Trainer

    device = pick_device(cuda)
    dims = ParallelDims.resolve(world, opts.dp_replicate, opts.dp_shard, opts.cp, opts.ep)
    meshes = build_meshes(dims, list(range(world)), rank, device.type)
    family = get_family(opts.family)
    if opts.flavor not in family.flavors:
        raise ValueError(f"unknown flavor {opts.flavor!r} of {opts.family}; known: {sorted(family.flavors)}")
    args = family.flavors[opts.flavor]
    if opts.vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=opts.vocab_size)
    with torch.device("meta"):
        model = family.model_cls(args)
    n_active = active_matmul_params(model)
    if opts.lora_rank:
        from meshrl.models.common.lora import add_lora

        add_lora(model, family.state_dict_adapter(args), opts.lora_rank, opts.lora_alpha, 0.0,
                 opts.lora_targets.split(","))
    dtype = torch.bfloat16 if cuda else torch.float32
    given = {"auto": None, "true": True, "false": False}[opts.reshard_after_forward]
    opts.reshards = ParallelConfig(reshard_after_forward=given).reshards(world, False, opts.lora_rank > 0)
    parallelize(model, meshes, dtype, opts.ac, opts.ac_every, opts.compile, opts.reshards)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # each rank initialises its own shards; random weights are all we need
    if opts.lora_rank:
        from meshrl.models.common.lora import init_lora

        init_lora(model, seed=0)
    trainer = Trainer(model, OptimConfig(lr=1e-5), device, dist.group.WORLD, meshes, opts.attention,
                      opts.chunk_tokens, compute_dtype=dtype)
    return trainer, args, n_active, dims, dtype


def _profile(trainer, rows: list, tokens: int, cuda: bool, rank: int) -> None:
    """One more step under the torch profiler; rank 0 prints the top kernels to stderr and, on CUDA,
    the top host operations too (a step whose device idles is bound by them), then one JSON line
    `{"profile_timeline": ...}` (`timeline`): where the step's device time went."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.sft_step(rows, num_loss_tokens=tokens)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if rank == 0:
        averages = prof.key_averages()
        for key in ("self_cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",):
            print(averages.table(sort_by=key, row_limit=30, max_name_column_width=70), file=sys.stderr)
        if cuda:
            print(json.dumps({"profile_timeline": timeline(prof.profiler.kineto_results.events(), wall)}),
                  file=sys.stderr)


# kernel name -> category of `timeline`, first match wins
_CATEGORIES = (("nccl", re.compile(r"nccl", re.I)),
               ("attention", re.compile(r"flash|fmha|attn|attention", re.I)),
               # FSDP2's foreach copies are multi-tensor kernels too: copies first
               ("copy", re.compile(r"memcpy|memset|copy|CatArray|split_with_sizes|chunk_cat", re.I)),
               ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)),  # AdamW, the clip's norm and rescale
               ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm100_", re.I)),
               ("compiled", re.compile(r"^triton_")))


def timeline(events, wall_s: float) -> dict:
    """Device time of one profiled step from the profiler's raw events: the busy time (the union of
    all kernels, memcpys and memsets over every stream; the GPU-side copies of record_function ranges
    are left out), the idle rest of the step's wall time, each stream's busy time, and kernel time by
    category (`_CATEGORIES`; "other" for the rest, e.g. the eager element-wise kernels). Categories
    sum kernel durations: overlapping streams count twice."""
    spans, by_stream, by_category = [], {}, {}
    cuda = torch.autograd.DeviceType.CUDA
    # record_function ranges are mirrored on the GPU timeline under their names (spanning kernels
    # and the gaps between them): not work. torch 2.11's events have no activity_type to tell them.
    ranges = {e.name() for e in events if e.device_type() != cuda and e.is_user_annotation()}
    for e in events:
        if e.device_type() != cuda or e.duration_ns() <= 0 or e.is_user_annotation() or e.name() in ranges:
            continue
        begin, end = e.start_ns(), e.start_ns() + e.duration_ns()
        spans.append((begin, end))
        stream = int(e.device_resource_id())
        by_stream[stream] = by_stream.get(stream, 0) + e.duration_ns()
        name = e.name()
        category = next((c for c, pattern in _CATEGORIES if pattern.search(name)), "other")
        by_category[category] = by_category.get(category, 0) + e.duration_ns()
    busy, last = 0, None
    for begin, end in sorted(spans):
        if last is None or begin > last:
            busy += end - begin
            last = end
        elif end > last:
            busy += end - last
            last = end
    ms = lambda ns: round(ns / 1e6, 2)  # noqa: E731
    return {"wall_ms": round(wall_s * 1e3, 2), "device_busy_ms": ms(busy),
            "device_idle_ms": round(wall_s * 1e3 - busy / 1e6, 2), "kernels": len(spans),
            "streams_busy_ms": {str(k): ms(v) for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])},
            "by_category_ms": {k: ms(v) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])}}


def main(argv: list[str]) -> None:
    opts = parse(argv)
    if opts.nproc > 1 and "LOCAL_RANK" not in os.environ:
        # the ranks get every option but --nproc (which torchrun would take for its own --nproc-per-node)
        rank_argv = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")
                     and not a.startswith("--nproc=")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.nproc}",
               "-m", MODULE, *rank_argv]
        sys.exit(subprocess.call(cmd))
    if "LOCAL_RANK" not in os.environ:  # one process: a world of one
        import socket

        with socket.socket() as sock:  # a free port, so several single-GPU runs can share a host
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    result = run_rank(opts)
    if result is not None:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
