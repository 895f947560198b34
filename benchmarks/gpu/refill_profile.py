"""Where the native engine's `refill` workload spends its time (issue 18): 0.6B shape, one GPU.

The 0.6B matrix (docs/benchmarks.md, late night) has the native engine at 0.38x vLLM on refill
(512 requests kept 128 live, prompts 32-256, completions 16-512), although its pure decode steps
are shorter than vLLM's (4.18 vs 6.69 ms): 1,038 decode steps explain ~4.3 s of a 28.3 s run, so
~24 s went to the ~300 steps that prefill a new request (~80 ms each). Not profiled yet.

    python3 benchmarks/gpu/refill_profile.py [max_model_len, default 4352 as in the matrix]

Builds the engine as `meshrl bench engine --compare vllm` does (runtime/engine/bench_matrix.py),
warms it up the same way, then drives `refill` with every step synchronised and timed, under
cProfile. Prints the workload's row, per-kind totals (prefill steps: time, prompt tokens; the
slowest steps) and the host profile; writes the same to $OUT/refill_prof.txt."""
import cProfile, io, json, os, pstats, sys, time
import torch
from meshrl.models import get_family
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.engine import bench_matrix as bm

OUT = os.environ.get("OUT", ".")
fam = get_family("qwen3"); args = fam.flavors["0.6B"]
with torch.device("meta"):
    model = fam.model_cls(args)
model.to_empty(device="cuda"); model.init_weights(seed=0); model = model.to(torch.bfloat16)
engine = NativeEngine(model, max_num_seqs=512, max_model_len=int(sys.argv[1]) if len(sys.argv) > 1 else 4352,
                      device="cuda", dtype=torch.bfloat16, max_num_batched_tokens=bm.PREFILL_TOKENS, prefix_sharing=True,
                      cuda_graphs=True, seed=0)
driver = bm.NativeDriver(engine, 0)
t = time.perf_counter(); bm.warm_up(driver, engine.vocab_size, 512); print("warmup", round(time.perf_counter() - t, 1), flush=True)
steps = []
orig = driver.step
def timed():
    p0 = engine.num_prefill_tokens; live0 = sum(len(v) for v in engine.scheduler.live.values())
    t0 = time.perf_counter(); r = orig(); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    steps.append((dt, engine.num_prefill_tokens - p0, live0)); return r
driver.step = timed
w = bm.make_workload("refill", engine.vocab_size)
prof = cProfile.Profile(); prof.enable(); res = bm.drive(driver, w); prof.disable()
print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}))
pre = [s for s in steps if s[1]]; dec = [s for s in steps if not s[1]]
summ = {"steps": len(steps), "prefill_steps": len(pre), "prefill_s": round(sum(s[0] for s in pre), 3),
        "prefill_tokens": sum(s[1] for s in pre), "decode_steps": len(dec), "decode_s": round(sum(s[0] for s in dec), 3),
        "slowest": sorted([(round(s[0] * 1e3, 1), s[1], s[2]) for s in steps], reverse=True)[:15],
        "prefill_ms_by_tokens": sorted([(s[1], round(s[0] * 1e3, 1)) for s in pre])[:: max(1, len(pre) // 25)]}
print(json.dumps(summ))
s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(25); st.sort_stats("cumulative").print_stats(30)
open(f"{OUT}/refill_prof.txt", "w").write(json.dumps(res) + "\n" + json.dumps(summ) + "\n" + s.getvalue())
print("\n".join(l[:200] for l in s.getvalue().splitlines()[:90]))
