#!/usr/bin/env bash
# FP8 inference on one H200 (issue 17): kernels, GPU tests, and decode throughput of the native
# engine at the Qwen3-1.7B and 8B shapes for bf16, FP8 weights, FP8 weights + FP8 KV cache.
#
#   bash benchmarks/gpu/fp8.sh            # everything (about 6-8 minutes)
#   FP8_PARTS="tests kernels" bash benchmarks/gpu/fp8.sh   # a subset: tests kernels engine
#   FP8_FLAVORS="8B" FP8_SEQS="256" bash benchmarks/gpu/fp8.sh
#
# Needs .whl/ (../shared/gpu-host/wheels.sh) carried along. Writes under $OUT (default ./out):
# tests.txt, kernels.jsonl, engine.jsonl (one `meshrl bench engine` JSON line per run).
# vLLM with quantization="fp8" is not in this script: `meshrl bench engine --compare vllm` runs the
# workload matrix (runtime/engine/bench_matrix.py), which does not take --quantization yet.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/host_env.sh"
PARTS=${FP8_PARTS:-tests kernels engine}
FLAVORS=${FP8_FLAVORS:-1.7B 8B}
SEQS=${FP8_SEQS:-256 512}
PROMPT=${FP8_PROMPT:-256}
GEN=${FP8_GEN:-128}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for part in $PARTS; do
  case $part in
    tests)
      timeout ${FP8_T_TESTS:-240} python3 -m pytest -q -m gpu tests/unit/test_fp8.py 2>&1 | tail -60 | tee "$OUT/tests.txt" ;;
    kernels)
      timeout ${FP8_T_KERNELS:-240} python3 benchmarks/gpu/fp8_kernels.py ${FP8_SWEEP:+--sweep} 2>&1 | tee "$OUT/kernels.jsonl" | tail -4 ;;
    engine)
      for flavor in $FLAVORS; do
        for n in $SEQS; do
          for q in "none auto" "fp8 auto" "fp8 fp8"; do
            set -- $q
            timeout ${FP8_T_ENGINE:-300} python3 -m meshrl.runtime.cli bench engine --flavor "$flavor" --num-seqs "$n" \
              --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --no-hf --quantization "$1" --kv-cache-dtype "$2" \
              2>>"$OUT/engine.err" | tail -1 | tee -a "$OUT/engine.jsonl"
          done
        done
      done ;;
  esac
done
