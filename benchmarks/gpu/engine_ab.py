"""The native engine with one switch on and off, in one process (issue 18), then a profile of refill.

    python3 benchmarks/gpu/engine_ab.py [rounds, default 2] [fused_decode|prefill_graphs|compact_rows,
                                                             default fused_decode]

The switch: `fused_decode` (MESHRL_FUSED_DECODE, the decode fusions), `prefill_graphs` (the
runner's graphs for small fresh prefills, `ModelRunner.graph_prefill`; MESHRL_PREFILL_GRAPHS at
start-up) or `compact_rows` (`Scheduler.compact_rows`, moving a sparse tail of rows down), which
drives one workload of its own instead of the four below and skips the refill profile: "tail", 512
sequences submitted at once, 128-token prompts, completions of 16 + 1008 u^4 tokens (most short, a
few near 1,024), the shape a mixed-length RL batch has.

Builds the Qwen3-0.6B engine (random weights, bf16) as `meshrl bench engine --compare vllm` does
(runtime/engine/bench_matrix.py: max_num_seqs 512, max_model_len 4352, prefix sharing, CUDA graphs)
and drives the matrix's plain_8, plain_64, plain_256 and refill workloads through
`bench_matrix.drive`, with MESHRL_FUSED_DECODE=1 and =0 alternated `rounds` times (per setting the
decode graphs are dropped and warmed up again). One JSON line per run: tok/s, mean decode step ms,
time to first token. The first setting also pays the kernels' first compiles, so its first rows read
slow; compare later rounds. Then one refill run with every step synchronised, under torch.profiler
over a window that includes prefill steps: per-kind step times and the top host and device ops.
docs/benchmarks.md (2026-12-02) has the first run of an earlier version of this script."""
import json, os, sys, time
import torch
from meshrl.models import get_family
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.engine import bench_matrix as bm

OUT = os.environ.get("OUT", ".")
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
switch = sys.argv[2] if len(sys.argv) > 2 else "fused_decode"
assert switch in ("fused_decode", "prefill_graphs", "compact_rows"), switch
fam = get_family("qwen3"); args = fam.flavors["0.6B"]
with torch.device("meta"):
    model = fam.model_cls(args)
model.to_empty(device="cuda"); model.init_weights(seed=0); model = model.to(torch.bfloat16)
engine = NativeEngine(model, max_num_seqs=512, max_model_len=4352, device="cuda", dtype=torch.bfloat16,
                      max_num_batched_tokens=bm.PREFILL_TOKENS, prefix_sharing=True, cuda_graphs=True, seed=0)
driver = bm.NativeDriver(engine, 0)


def tail_workload() -> bm.Workload:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.vocab_size, (512, 128), generator=g).tolist()
    return bm.Workload("tail", prompts, (16 + 1008 * torch.rand(512, generator=g) ** 4).long().tolist())


workloads = {"tail": tail_workload()} if switch == "compact_rows" else {
    wl: bm.make_workload(wl, engine.vocab_size) for wl in ("plain_8", "plain_64", "plain_256", "refill")}
rows = []
for r in range(rounds):
    for fused in ("1", "0"):
        if switch == "fused_decode":
            os.environ["MESHRL_FUSED_DECODE"] = fused
        elif switch == "prefill_graphs":
            engine.runner.graph_prefill = fused == "1"
        else:
            engine.scheduler.compact_rows = fused == "1"
        engine.runner.drop_graphs(); torch.cuda.synchronize()
        bm.warm_up(driver, engine.vocab_size, 512)
        for wl, workload in workloads.items():
            res = bm.drive(driver, workload)
            row = {"round": r, switch: int(fused), "workload": wl, "tokens_per_s": round(res["tokens_per_s"]),
                   "decode_step_ms": round(res["decode_step_ms"], 3), "ttft_s": round(res["ttft_s"], 3)}
            rows.append(row); print(json.dumps(row), flush=True)
with open(f"{OUT}/engine_ab.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
if switch == "compact_rows":
    sys.exit(0)
os.environ.pop("MESHRL_FUSED_DECODE", None)
engine.runner.graph_prefill = True
engine.runner.drop_graphs(); bm.warm_up(driver, engine.vocab_size, 512)
orig, pre, dec, prof = driver.step, [], [], {"p": None}


def timed():
    p0 = engine.num_prefill_tokens
    t0 = time.perf_counter(); out = orig(); torch.cuda.synchronize()
    (pre if engine.num_prefill_tokens > p0 else dec).append(time.perf_counter() - t0)
    if prof["p"] is not None:
        prof["p"].step()
    return out


driver.step = timed
from torch.profiler import ProfilerActivity, profile, schedule
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=20, warmup=2, active=300, repeat=1)) as p:
    prof["p"] = p
    res = bm.drive(driver, bm.make_workload("refill", engine.vocab_size))
pre.sort(); dec.sort()
print(json.dumps({"refill_synced_tokens_per_s": round(res["tokens_per_s"]), "prefill_steps": len(pre),
                  "prefill_s": round(sum(pre), 2), "prefill_median_ms": round(1e3 * pre[len(pre) // 2], 1),
                  "decode_median_ms": round(1e3 * dec[len(dec) // 2], 2)}), flush=True)
averages = p.key_averages()
for key in ("self_cpu_time_total", "self_device_time_total"):
    print(averages.table(sort_by=key, row_limit=25, max_name_column_width=55))
