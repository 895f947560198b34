"""Where the colocated weight sync's time goes at the Qwen3-0.6B shape (one GPU, FSDP2 on one rank).

    python3 benchmarks/gpu/weight_sync_breakdown.py      (GPU host: .whl installed, see ../shared/gpu-host/README.md)

Times (device-synchronised medians of 10) the parts of ColocatedSender.send without an engine: the
walk over the parameters (full_tensors), the grouped fp32 -> bf16 `_foreach_copy_` into a flat
buffer, the same per parameter, one flat cast and one bf16 copy of the same size (the floors), and
the whole send path. Prints one JSON line. docs/benchmarks.md records the run of 2026-12-01.
"""
import json, os, time, argparse, math
import torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1")
from meshrl.runtime.train.bench import parse, _build
from meshrl.parallel.parallelize import full_tensors
from meshrl.runtime import weight_sync as ws

dist.init_process_group("nccl")
opts = parse(["--flavor", "0.6B"])
trainer, args, *_ = _build(opts, True, 0, 1)
model = trainer.model
dev = torch.device("cuda")
entries, numel = ws.flat_plan(model)
buf = torch.empty(numel, dtype=torch.bfloat16, device=dev)
views = [buf[o:o + math.prod(s)].view(s) for o, s in entries]
def t(fn, n=10):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize(); out.append((time.perf_counter() - s) * 1e3)
    return round(sorted(out)[n // 2], 3)
res = {"numel": numel, "n_params": len(entries)}
res["iterate_ms"] = t(lambda: list(full_tensors(model)))
srcs = [p for _, p in full_tensors(model)]
res["src_dtype"] = str(srcs[0].dtype)
res["foreach_cast_copy_ms"] = t(lambda: [torch._foreach_copy_(views[i:i + 64], srcs[i:i + 64]) for i in range(0, len(views), 64)])
res["per_param_copy_ms"] = t(lambda: [v.copy_(s) for v, s in zip(views, srcs)])
flat32 = torch.empty(numel, dtype=torch.float32, device=dev)
res["one_flat_cast_ms"] = t(lambda: buf.copy_(flat32))
b2 = torch.empty_like(buf)
res["one_flat_bf16_copy_ms"] = t(lambda: b2.copy_(buf))
def full():
    it = full_tensors(model)
    for i in range(0, len(views), 64):
        vs = views[i:i + 64]; torch._foreach_copy_(vs, [next(it)[1] for _ in vs])
res["full_send_path_ms"] = t(full)
res["bytes_cast_gb"] = numel * 6 / 1e9
print(json.dumps(res))
dist.destroy_process_group()
