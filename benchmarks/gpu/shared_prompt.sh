#!/usr/bin/env bash
# Shared-prompt packing on one GPU (issue 18): the gpu tests of tests/unit/test_shared_prompt.py
# (varlen, flex, split, sdpa on shared rows in bf16 against the fp32 dense rule), then the trainer
# step with share_prompts off and on at the Qwen3-0.6B shape (bf16 weights, random tokens; GRPO groups
# of 16 samples, 256-token prompts, 1-512 token completions) for each attention backend. Writes
# $OUT/pytest.log and one JSON line per setting to $OUT/shared_prompt.jsonl.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/shared_prompt.sh`.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/unit/test_shared_prompt.py -p no:cacheprovider > "$OUT/pytest.log" 2>&1
tail -n 3 "$OUT/pytest.log"
for attention in varlen flex split sdpa; do
  timeout 240 python3 benchmarks/shared_prompt.py --device cuda --flavor 0.6B --prompt-len 256 --gen-len 512 \
    --prompts 4 --samples 16 --seq-len 16384 --rounds 3 --attention "$attention" \
    >> "$OUT/shared_prompt.jsonl" 2> "$OUT/$attention.log" || echo "{\"attention\": \"$attention\", \"error\": \"see $attention.log\"}" >> "$OUT/shared_prompt.jsonl"
done
cat "$OUT/shared_prompt.jsonl"
