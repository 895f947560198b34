#!/usr/bin/env bash
# trainer.overlap_rollout on GPUs (docs/architecture.md, "Overlapped training"): on-policy RL
# (max_off_policy_steps = 0) at the Qwen3-0.6B shape with random weights and the char tokenizer on
# reverse-text (32 prompts x 16 samples, up to 512 tokens: random weights stop at random lengths, so
# groups finish at different times), 8 steps, with overlap on and off, alternated, in two layouts:
# split (trainer on GPU 0, engine on GPU 1) and colocated (one GPU). One JSON line per run in
# $OUT/overlap.jsonl: mean time/step_s, time/rollout_s, time/train_s, time/train_tail_s and
# batch/train_parts over steps 2-7, and the reward of the last step (equal with overlap on and off,
# up to sampling flips from float reassociation). Logs in $OUT/<name>.log. With one GPU only the
# colocated runs; OVERLAP_ROUNDS (default 2) sets the rounds.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/overlap.sh`.
set -u
source "$(dirname "$0")/host_env.sh"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() {  # name, then meshrl flags
  local name=$1; shift
  local run="/tmp/overlap/$name"
  rm -rf "$run"
  timeout 500 python3 -m meshrl.runtime.cli rl --model.flavor 0.6B --model.tokenizer char --env.name reverse-text \
    --max-steps 8 --max-off-policy-steps 0 --prompts-per-step 32 --samples-per-prompt 16 \
    --inference.sampling.max-tokens 512 --inference.max-model-len 640 --dist.device cuda --log.console false \
    --output-dir "$run" "$@" > "$OUT/$name.log" 2>&1
  python3 - "$name" "$?" "$run/metrics.jsonl" "$*" >> "$OUT/overlap.jsonl" <<'PY'
import json, os, statistics as st, sys
name, code, metrics, flags = sys.argv[1:]
rows = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
keys = ["time/step_s", "time/rollout_s", "time/train_s", "time/train_tail_s", "batch/train_parts"]
out = {"name": name, "flags": flags, "exit": int(code), "steps": len(rows)}
if len(rows) > 2:
    out.update({k: round(st.mean(r[k] for r in rows[2:]), 4) for k in keys})
    out["reward_last"] = rows[-1]["reward/mean"]
print(json.dumps(out))
PY
  tail -n 1 "$OUT/overlap.jsonl"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
for r in $(seq 0 $(( ${OVERLAP_ROUNDS:-2} - 1 ))); do
  if [ "$gpus" -ge 2 ]; then  # the split layout needs a trainer GPU and an inference GPU
    run "split-on-$r" --layout.colocate false --trainer.overlap-rollout true
    run "split-off-$r" --layout.colocate false --trainer.overlap-rollout false
  fi
  run "colocated-on-$r" --layout.colocate true --trainer.overlap-rollout true
  run "colocated-off-$r" --layout.colocate true --trainer.overlap-rollout false
done
