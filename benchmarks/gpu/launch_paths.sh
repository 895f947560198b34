#!/usr/bin/env bash
# The launcher's start paths on one GPU (issue 16 item 7, runtime/launch.py rank_start): a CUDA job's
# agent is `meshrl` forked and its ranks are exec'd `python -u -m meshrl.runtime.rl` processes; a CPU
# job's ranks are forked from the agent. Not yet run on a GPU. This runs a 2-step RL job of the debug
# model through `meshrl rl` three ways: on the GPU (colocated, exec'd ranks), on the CPU (forked ranks)
# and on the CPU with MESHRL_RANK_START=exec, and writes one JSON line each to $OUT/launch_paths.jsonl
# (exit code, wall seconds, the final reward/mean, which must be equal for the two CPU runs); the logs
# are kept in $OUT/<name>.log.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/launch_paths.sh`.
set -u
source "$(dirname "$0")/host_env.sh"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() {  # name, env assignment (or -), then meshrl flags
  local name=$1 envset=$2; shift 2
  local start=$(date +%s.%N) run="/tmp/launch_paths/$name"
  rm -rf "$run"
  env ${envset/#-/} timeout 300 python3 -m meshrl.runtime.cli rl --model.flavor debug --model.tokenizer char \
    --env.name reverse-text --max-steps 2 --prompts-per-step 4 --samples-per-prompt 4 \
    --inference.sampling.max-tokens 12 --inference.max-model-len 48 --log.console false \
    --output-dir "$run" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  python3 - "$name" "$code" "$start" "$(date +%s.%N)" "$run/metrics.jsonl" >> "$OUT/launch_paths.jsonl" <<'PY'
import json, os, sys
name, code, start, end, metrics = sys.argv[1:]
rows = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
print(json.dumps({"name": name, "exit": int(code), "wall_s": round(float(end) - float(start), 2),
                  "steps": len(rows), "final_reward_mean": rows[-1]["reward/mean"] if rows else None}))
PY
  tail -n 1 "$OUT/launch_paths.jsonl"
}
run gpu_colocated_exec - --dist.device cuda --layout.colocate true
run cpu_fork - --dist.device cpu --max-off-policy-steps 0
run cpu_exec MESHRL_RANK_START=exec --dist.device cpu --max-off-policy-steps 0
