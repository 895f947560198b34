#!/usr/bin/env bash
# LoRA vs full fine-tuning on one GPU at the Qwen3-1.7B and Qwen3-8B shapes (docs/lora.md).
# Runs `meshrl bench trainer` (random weights and tokens, bf16 compute, fp32 parameters, AdamW,
# one packed row of SEQ tokens per step) once per setting, each in a fresh process, and writes one
# JSON line per setting to $OUT/lora.jsonl; a setting that fails (out of memory) gets a line with
# its error instead, and its log is kept in $OUT/<name>.log.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/lora.sh`.
set -u
OUT=${OUT:-/tmp/out}
SEQ=${SEQ:-8192}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
LIMIT=${LIMIT:-150}  # seconds a setting may take
mkdir -p "$OUT"
run() {  # name, then bench flags
  local name=$1; shift
  local start=$(date +%s)
  if timeout "$LIMIT" python3 -m meshrl.runtime.train.bench --seq-len "$SEQ" --steps "$STEPS" --warmup "$WARMUP" "$@" \
       > "$OUT/$name.json" 2> "$OUT/$name.log"; then
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['name']=sys.argv[2]; r['wall_s']=int(sys.argv[3]); print(json.dumps(r))" \
      "$OUT/$name.json" "$name" "$(( $(date +%s) - start ))" >> "$OUT/lora.jsonl"
  else
    python3 - "$OUT/$name.log" "$name" "$*" >> "$OUT/lora.jsonl" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
err = next((l for l in reversed(lines) if "OutOfMemory" in l or "out of memory" in l), lines[-1] if lines else "timed out")
print(json.dumps({"name": sys.argv[2], "flags": sys.argv[3], "error": err[-600:]}))
PY
  fi
  tail -n 1 "$OUT/lora.jsonl"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
run 8B-lora16 --flavor 8B --ac full --lora-rank 16 --lora-alpha 32
run 8B-full --flavor 8B --ac full
run 1.7B-lora16 --flavor 1.7B --lora-rank 16 --lora-alpha 32
run 1.7B-full --flavor 1.7B
