"""The engine's paged decode attention kernel alone on one GPU: a sweep of its launch settings
(tile, warps, stages, programs per SM) over eight (rows, context) shapes of the engine matrix, at the
Qwen3-0.6B attention shape (16 q / 8 kv heads, head dim 128, block 16, 272-block tables).

    python3 benchmarks/gpu/decode_attention_sweep.py [OLD_KERNELS_PY]

OLD_KERNELS_PY: a kernels.py to compare against (e.g. `git show 2c03c59:runtime/engine/kernels.py >
/tmp/kernels_old.py`: the kernel before the row-span change); without it the current module at its
defaults is the reference. Each timing: a CUDA graph of 20 calls, best of 5 replays. One JSON line
per shape to stdout (reference us, current defaults, the best setting), every setting to
$OUT/attn_sweep.jsonl. docs/benchmarks.md (2026-12-02 evening) has the first run."""
import importlib.util, json, os, sys, itertools
import torch
from meshrl.runtime.engine import kernels as new
if len(sys.argv) > 1:
    spec = importlib.util.spec_from_file_location("kernels_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
else:
    old = new
OUT = os.environ.get("OUT", "/tmp")
DEFAULTS = (new.TILE, new._DECODE_WARPS, new._DECODE_STAGES, new._PROGRAMS_PER_SM)
dev = torch.device("cuda")
Hq, Hkv, D, bs, NB = 16, 8, 128, 16, 272
num_blocks = 40000
k = torch.randn(num_blocks, bs, Hkv, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
SHAPES = [("plain_8", 8, 400), ("plain_64", 64, 400), ("plain_256", 256, 250), ("grpo", 512, 384),
          ("long_4k@512", 32, 512), ("long_4k@2k", 32, 2048), ("long_4k@4k", 32, 4000), ("multiturn", 64, 1000)]

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

rows = []
for name, B, ctx in SHAPES:
    g = torch.Generator(device=dev).manual_seed(B)
    tables = torch.randint(1, num_blocks, (B, NB), device=dev, dtype=torch.int32, generator=g)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16)
    gb = B * ctx * Hkv * D * 2 * 2 / 1e9
    new.TILE, new._DECODE_WARPS, new._DECODE_STAGES, new._PROGRAMS_PER_SM = DEFAULTS  # the reference
    ref = old.paged_decode_attention(q, k, v, tables, lens)
    t_old = timed(lambda: old.paged_decode_attention(q, k, v, tables, lens))
    res = {"shape": name, "B": B, "ctx": ctx, "old_us": round(t_old, 2), "old_gbps": round(gb / t_old * 1e6)}
    best = None
    for tile, warps, stages, ppsm in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3), (4, 8, 16)):
        new.TILE, new._DECODE_WARPS, new._DECODE_STAGES, new._PROGRAMS_PER_SM = tile, warps, stages, ppsm
        try:
            out = new.paged_decode_attention(q, k, v, tables, lens)
            err = (out.float() - ref.float()).abs().max().item()
            t = timed(lambda: new.paged_decode_attention(q, k, v, tables, lens))
        except Exception as e:
            print("fail", name, tile, warps, stages, ppsm, repr(e)[:100], flush=True); continue
        cfg = {"tile": tile, "warps": warps, "stages": stages, "ppsm": ppsm, "us": round(t, 2), "err": err}
        if (tile, warps, stages, ppsm) == DEFAULTS:
            res["new_default_us"] = round(t, 2); res["new_default_gbps"] = round(gb / t * 1e6)
        rows.append({"shape": name, **cfg})
        if best is None or t < best["us"]:
            best = cfg
    res["best"] = best; res["best_gbps"] = round(gb / best["us"] * 1e6)
    print(json.dumps(res), flush=True)
with open(f"{OUT}/attn_sweep.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
# The config that is best summed over the shapes (weighted equally by relative time)
from collections import defaultdict
score = defaultdict(float); mins = {}
for r in rows:
    mins[r["shape"]] = min(mins.get(r["shape"], 1e9), r["us"])
for r in rows:
    score[(r["tile"], r["warps"], r["stages"], r["ppsm"])] += r["us"] / mins[r["shape"]]
top = sorted(score.items(), key=lambda kv: kv[1])[:5]
print("overall best (sum of time / best):", [(k, round(s, 2)) for k, s in top])
print("defaults", DEFAULTS, round(score[DEFAULTS], 2))
