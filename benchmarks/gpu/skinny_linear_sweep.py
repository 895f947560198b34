"""The decode projections at small row counts: torch's F.linear (cuBLAS, and cuBLASLt) against
models/common/skinny_linear.py over a sweep of its settings, on one GPU.

    python3 benchmarks/gpu/skinny_linear_sweep.py

Shapes: the per-layer projections of the engine's packed decode path (q/k/v, o, gate/up, down) at
the Qwen3-0.6B and 1.7B shapes, at 1, 8, 16, 32 and 64 rows, bf16. Each timing: a CUDA graph of 20
calls, best of 5 replays. One JSON line per (shape, rows) to stdout: F.linear's us, cuBLASLt's us,
the kernel's best us and setting, and the weight bytes / best time; every setting's time to
$OUT/skinny_sweep.jsonl. Then the sum over a layer's four projections per (flavor, rows)."""
import itertools, json, os
import torch
import torch.nn.functional as F
from meshrl.models.common import skinny_linear as sk

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
SHAPES = {"0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
          "1.7B": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}}
ROWS = (1, 8, 16, 32, 64)


def timed(fn, reps=20, rounds=5):
    fn(); fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(rounds):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); g.replay(); e.record(); e.synchronize()
        best = min(best, s.elapsed_time(e) / reps * 1e3)
    return best  # us


def settings(rows):
    red = [dict(bn=bn, bk=bk, warps=4, stages=s, dot=False) for bn, bk, s in itertools.product((2, 4, 8, 16), (128, 256), (2, 4))]
    dot = [dict(bn=bn, bk=bk, warps=4, stages=3, dot=True) for bn, bk in itertools.product((16, 32, 64), (128, 256))]
    if rows <= 4:
        return red
    if rows <= 16:  # the broadcast product holds rows x bn x bk fp32 values
        return [c for c in red if c["bn"] * c["bk"] * rows <= 16384] + dot
    return dot


all_rows, totals = [], {}
for flavor, shapes in SHAPES.items():
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        for M in ROWS:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            t_torch = timed(lambda: F.linear(x, w))
            torch.backends.cuda.preferred_blas_library("cublaslt")
            t_lt = timed(lambda: F.linear(x, w))
            torch.backends.cuda.preferred_blas_library("cublas")
            best = None
            for cfg in settings(M):
                try:
                    out = sk.linear(x, w, **cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = timed(lambda: sk.linear(x, w, **cfg))
                except Exception as e:  # a setting the compiler refuses (registers, shared memory)
                    all_rows.append({"flavor": flavor, "proj": name, "M": M, **cfg, "error": str(e)[:200]})
                    continue
                all_rows.append({"flavor": flavor, "proj": name, "M": M, **cfg, "us": round(t, 2), "err": err})
                if err < 0.05 and (best is None or t < best[0]):
                    best = (t, cfg, err)
            mb = N * K * 2 / 1e6
            row = {"flavor": flavor, "proj": name, "N": N, "K": K, "M": M, "torch_us": round(t_torch, 2),
                   "cublaslt_us": round(t_lt, 2), "torch_gbps": round(mb / t_torch * 1e3)}
            if best:
                row.update(skinny_us=round(best[0], 2), skinny_gbps=round(mb / best[0] * 1e3), setting=best[1],
                           max_err=best[2], speedup=round(t_torch / best[0], 2))
            print(json.dumps(row), flush=True)
            key = (flavor, M)
            tot = totals.setdefault(key, [0.0, 0.0, 0.0])
            tot[0] += t_torch; tot[1] += min(t_torch, t_lt); tot[2] += best[0] if best else t_torch
with open(f"{OUT}/skinny_sweep.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in all_rows))
for (flavor, M), (a, b, c) in totals.items():
    print(json.dumps({"flavor": flavor, "M": M, "layer_torch_us": round(a, 1), "layer_best_blas_us": round(b, 1),
                      "layer_skinny_us": round(c, 1)}), flush=True)
