#!/usr/bin/env bash
# One switch of the trainer on and off on one GPU: `meshrl bench trainer` at the 0.6B and 1.7B shapes
# (TRAINER_AB_FLAVORS), 16 packed documents of 16k tokens in all, compiled blocks, varlen attention,
# with the environment variable named by the first argument set to 1 and to 0, alternated per flavor.
#     bash benchmarks/gpu/trainer_ab.sh MESHRL_FUSED_ADAMW      # fused AdamW (runtime/train/trainer.py)
#     bash benchmarks/gpu/trainer_ab.sh MESHRL_FUSED_LOGPROBS   # the fused logprob head
# One short line per run to stdout (step_s, tokens/s, MFU, peak memory, dynamo's compiled graphs and
# graph breaks); $OUT/trainer_ab.jsonl gets one bench JSON line per run, $OUT/errors.log the stderr.
# On the GPU host: carry .whl (../shared/gpu-host/README.md). About 40 s a run (each compiles its blocks).
set -u
VAR=${1:?"usage: trainer_ab.sh ENV_VAR (set to 1, then 0)"}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/host_env.sh
for flavor in ${TRAINER_AB_FLAVORS:-0.6B 1.7B}; do
  for value in 1 0; do
    line=$(env "$VAR=$value" timeout -k 5 ${TRAINER_AB_T:-100} python3 -m meshrl.runtime.cli bench trainer \
      --flavor "$flavor" --seq-len 16384 --docs 16 --compile --attention varlen --steps 5 --warmup 3 \
      2>> "$OUT/errors.log" | tail -n 1)
    if [ -z "$line" ]; then
      echo "flavor=$flavor $VAR=$value: no result (see errors.log)"
      continue
    fi
    echo "{\"flavor\": \"$flavor\", \"switch\": \"$VAR\", \"value\": $value, \"bench\": $line}" >> "$OUT/trainer_ab.jsonl"
    python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print("flavor=%s %s=%s: step_s=%s tokens_per_s=%s mfu=%s peak_memory_gib=%s graphs=%s breaks=%s" % (*sys.argv[2:5], r["step_s"], r["tokens_per_s"], r["mfu"], r.get("peak_memory_gib"), r.get("compiled_graphs"), r.get("graph_breaks")))' \
      "$line" "$flavor" "$VAR" "$value"
  done
done
