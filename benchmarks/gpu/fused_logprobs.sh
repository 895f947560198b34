#!/usr/bin/env bash
# Fused logprob head on one GPU (issue 18 item 4; runtime/train/logprob_kernels.py): the gpu tests of
# tests/unit/test_logprob_kernels.py and test_logprob_head.py (the Triton kernels against the torch
# path in bf16 at V = 151,936 and a small V, and the fused head's peak memory), then
# `meshrl bench trainer` at the 0.6B and 1.7B shapes, 16 packed documents of 16k tokens in all,
# compiled blocks, varlen attention, with MESHRL_FUSED_LOGPROBS=1 and =0 (benchmarks/gpu/trainer_ab.sh).
# One short line per run to stdout; $OUT gets pytest.log, trainer_ab.jsonl (one bench JSON line per
# run) and errors.log.
# On the GPU host: carry .whl (../shared/gpu-host/README.md), then `bash benchmarks/gpu/fused_logprobs.sh`
# (about 3 minutes: each bench run compiles its blocks).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/host_env.sh
timeout -k 5 60 python3 -m pytest -q -m gpu -o addopts="" tests/unit/test_logprob_kernels.py \
  tests/unit/test_logprob_head.py -p no:cacheprovider -rfE > "$OUT/pytest.log" 2>&1
echo "gpu tests rc=$?: $(tail -n 1 "$OUT/pytest.log" | cut -c1-200)"
bash benchmarks/gpu/trainer_ab.sh MESHRL_FUSED_LOGPROBS
