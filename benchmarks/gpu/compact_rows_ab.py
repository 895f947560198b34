"""Row compaction on/off (`Scheduler.compact_rows`) in one process: `python3 benchmarks/gpu/compact_rows_ab.py`. 0.6B, random weights, bf16, the matrix's engine settings; a long-tailed RL batch:
512 sequences submitted at once, 128-token prompts, completions 16-1024 tokens (16 + 1008 u^4: most short). Two rounds; rows to $OUT/compact_ab.jsonl; docs/benchmarks.md (2026-12-02 night) has the first run."""
import json, os, torch
from meshrl.models import get_family
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.engine import bench_matrix as bm
OUT = os.environ.get("OUT", ".")
fam = get_family("qwen3"); args = fam.flavors["0.6B"]
with torch.device("meta"):
    model = fam.model_cls(args)
model.to_empty(device="cuda"); model.init_weights(seed=0); model = model.to(torch.bfloat16)
engine = NativeEngine(model, max_num_seqs=512, max_model_len=4352, device="cuda", dtype=torch.bfloat16,
                      max_num_batched_tokens=bm.PREFILL_TOKENS, prefix_sharing=True, cuda_graphs=True, seed=0)
driver = bm.NativeDriver(engine, 0)
bm.warm_up(driver, engine.vocab_size, 512)
g = torch.Generator().manual_seed(0)
prompts = torch.randint(0, engine.vocab_size, (512, 128), generator=g).tolist()
u = torch.rand(512, generator=g)
gens = (16 + (1008 * u ** 4)).long().tolist()  # long tail: median ~80, a few near 1024
w = bm.Workload("tail", prompts, gens)
rows = []
sched = engine.scheduler
for r in range(2):
    for on in (True, False):
        sched.compact_rows = on
        res = bm.drive(driver, w)
        row = {"round": r, "compact_rows": on, "tokens_per_s": round(res["tokens_per_s"]),
               "decode_step_ms": round(res["decode_step_ms"], 3), "wall_s": round(res.get("wall_s", 0), 3)}
        rows.append(row); print(json.dumps(row), flush=True)
open(f"{OUT}/compact_ab.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
