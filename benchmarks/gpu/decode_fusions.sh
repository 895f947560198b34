#!/usr/bin/env bash
# Decode fusions on one GPU (issue 18 item 3; models/common/fused_decode.py): the gpu tests of
# tests/unit/test_fused_decode.py (each fused kernel against the eager torch path in bf16, and the
# engine's greedy tokens and logprobs with MESHRL_FUSED_DECODE=1 vs 0), then the 0.6B engine bench at
# 8 and 64 sequences with the fusions on and off, alternated twice each. One short line per run to
# stdout; $OUT gets pytest.log, decode_fusions.jsonl (one bench JSON line per run) and errors.log.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/decode_fusions.sh`.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/host_env.sh
python3 -m pytest -q -m gpu -o addopts="" tests/unit/test_fused_decode.py tests/unit/test_fused.py \
  -p no:cacheprovider -rfE > "$OUT/pytest.log" 2>&1
echo "gpu tests rc=$?: $(tail -n 1 "$OUT/pytest.log" | cut -c1-200)"
for n in 8 64; do
  for round in 1 2; do
    for fused in 1 0; do
      line=$(MESHRL_FUSED_DECODE=$fused timeout -k 5 120 meshrl bench engine --flavor 0.6B --num-seqs "$n" \
        --prompt-tokens 128 --gen-tokens 256 --no-hf 2>> "$OUT/errors.log" | tail -n 1)
      if [ -z "$line" ]; then
        echo "n=$n fused=$fused round=$round: no result (see errors.log)"
        continue
      fi
      echo "{\"num_seqs\": $n, \"fused_decode\": $fused, \"round\": $round, \"bench\": $line}" >> "$OUT/decode_fusions.jsonl"
      python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print("n=%s fused=%s round=%s: decode_step_ms=%s tokens_per_s=%.0f" % (*sys.argv[2:5], r["decode_step_ms"], r["tokens_per_s"]))' \
        "$line" "$n" "$fused" "$round"
    done
  done
done
