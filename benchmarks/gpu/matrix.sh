#!/usr/bin/env bash
# The engine workload matrix, native engine vs vLLM, in one run (issue 18; docs/benchmarks.md).
# `meshrl bench engine --compare vllm` at the Qwen3-0.6B and 1.7B shapes (random weights, bf16):
# plain batches of 8/64/256/512, GRPO groups of 16, a 4k-token generation, multi-turn continuation,
# continuous refill; one native engine and one vLLM engine per shape serve every row.
# On the GPU host, in the call that installs vLLM (../shared/gpu-host/README.md, call 6: its install
# line first, which sets PYTHONPATH), then: `bash benchmarks/gpu/matrix.sh`.
# Writes $OUT/engine_matrix.jsonl (one JSON line per shape, workload and engine, flushed as each row
# ends, so a timeout keeps what was done), $OUT/engine_matrix.log (stderr: vLLM's log) and
# $OUT/gpu.txt. MATRIX_FLAVORS=0.6B,1.7B,8B adds the 8B shape (another ~4 minutes: not in one call
# with the others). MATRIX_WORKLOADS=plain_8,grpo,... picks rows. MATRIX_TIMEOUT bounds the whole run.
set -u
OUT=${OUT:-/tmp/out}
FLAVORS=${MATRIX_FLAVORS:-0.6B,1.7B}
WORKLOADS=${MATRIX_WORKLOADS:-all}
mkdir -p "$OUT"
python3 -c "import meshrl.runtime.engine.bench_matrix" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
python3 -c "import vllm; print('vllm', vllm.__version__)" || echo "vllm is not importable: native rows only"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
start=$(date +%s)
timeout "${MATRIX_TIMEOUT:-530}" python3 -m meshrl.runtime.engine.bench_matrix --compare vllm \
  --flavors "$FLAVORS" --workloads "$WORKLOADS" --vllm-timeout "${MATRIX_VLLM_TIMEOUT:-300}" \
  --out "$OUT/engine_matrix.jsonl" > /dev/null 2> "$OUT/engine_matrix.log"
code=$?
echo "exit $code after $(( $(date +%s) - start )) s"
# A short table on stdout: tokens/s, decode step vs the HBM floor, native / vLLM.
python3 - "$OUT/engine_matrix.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if len(sys.argv) > 1 else []
by = {}
for r in rows:
    if "error" in r:
        print("ERROR", r.get("flavor"), r["error"]); continue
    by[(r["flavor"], r["workload"], r["engine"])] = r
    print(f'{r["flavor"]:>5} {r["workload"]:<10} {r["engine"]:<6} {r["tokens_per_s"]:>9.0f} tok/s  '
          f'step {r["decode_step_ms"]:6.2f} ms  floor {r.get("floor_step_ms", 0):5.2f} ms  '
          f'x{r.get("step_vs_floor", 0):4.2f}  ttft {r["ttft_s"]:.3f} s')
for (flavor, workload, engine), r in by.items():
    v = by.get((flavor, workload, "vllm"))
    if engine == "native" and v:
        print(f'{flavor:>5} {workload:<10} native/vllm {r["tokens_per_s"] / v["tokens_per_s"]:.2f}x')
PY
tail -n 5 "$OUT/engine_matrix.log"
exit $code
