"""FP8 block-scaled matmuls against bf16 at the Qwen3-1.7B and 8B linear shapes (one JSON line each).

    python benchmarks/gpu/fp8_kernels.py [--rows 256 512] [--sweep]

For every (flavor, linear, rows): microseconds per call of bf16 F.linear, the Triton kernel
(models/common/fp8_kernels.py, its default tile choice; --sweep: every tile config too) and
`torch._scaled_mm` with 1x128 x 128x128 block scales (+ its activation-quantisation kernel).
Each op is captured 20 times into one CUDA graph over 8 different weight copies (so the weights
do not sit in L2) and the graph is replayed: device time, no launch overhead, as in the engine's
captured decode step. Also the time to quantise one decoder layer's bf16 weights (weight sync).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from meshrl.models.common import fp8_kernels
from meshrl.models.common.fp8 import quantize_blocks

SHAPES = {  # linear: (N, K) = (out, in)
    "1.7B": {"wq": (2048, 2048), "wk": (1024, 2048), "wv": (1024, 2048), "wo": (2048, 2048),
             "w1": (6144, 2048), "w3": (6144, 2048), "w2": (2048, 6144)},
    "8B": {"wq": (4096, 4096), "wk": (1024, 4096), "wv": (1024, 4096), "wo": (4096, 4096),
           "w1": (12288, 4096), "w3": (12288, 4096), "w2": (4096, 12288)},
}
SWEEP = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
         (32, 128, 4, 4), (16, 128, 4, 4)]
COPIES, REPS = 8, 20


def graph_us(fn, args_list) -> float:
    """Mean device microseconds of fn(*args) over REPS calls in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in args_list[:2]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            fn(*args_list[i % len(args_list)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / REPS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--sweep", action="store_true")
    opts = parser.parse_args()
    torch.manual_seed(0)
    for flavor, linears in SHAPES.items():
        totals: dict[str, dict[int, float]] = {}
        for name, (N, K) in linears.items():
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            qs = [quantize_blocks(w) for w in ws]
            for M in opts.rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                row = {"flavor": flavor, "linear": name, "M": M, "N": N, "K": K}
                row["bf16_us"] = graph_us(F.linear, [(x, w) for w in ws])
                row["triton_us"] = graph_us(fp8_kernels.block_fp8_linear, [(x, q, s) for q, s in qs])
                row["triton_config"] = fp8_kernels._config(M, N, x.device)
                try:
                    row["scaled_mm_us"] = graph_us(fp8_kernels.scaled_mm_linear, [(x, q, s) for q, s in qs])
                except Exception as e:  # noqa: BLE001 (a benchmark reports what failed and goes on)
                    row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                if opts.sweep:
                    row["sweep_us"] = {str(c): graph_us(lambda a, b, c2, cfg=c: fp8_kernels.block_fp8_linear(
                        a, b, c2, config=cfg), [(x, q, s) for q, s in qs]) for c in SWEEP}
                for key in ("bf16_us", "triton_us", "scaled_mm_us"):
                    if key in row:
                        totals.setdefault(key, {}).setdefault(M, 0.0)
                        totals[key][M] += row[key]
                print(json.dumps(row), flush=True)
        torch.cuda.synchronize()
        w = ws[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        layer = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for N, K in linears.values()]
        quantize_blocks(layer[0])
        start.record()
        for t in layer:
            quantize_blocks(t)
        end.record()
        torch.cuda.synchronize()
        print(json.dumps({"flavor": flavor, "per_layer_linears_us": totals,
                          "quantize_one_layer_ms": start.elapsed_time(end)}), flush=True)
        del ws, qs, w, layer


if __name__ == "__main__":
    main()
