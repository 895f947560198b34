#!/usr/bin/env bash
# P/D disaggregation on two H200s (issue 17): the NCCL KV block transfer test, the router test over
# NCCL (aborts across the split, only missing blocks sent: the need mask and the blocks on the kv
# group, engines on GPU against one engine on GPU 0), and the transfer's bandwidth.
#
#   bash benchmarks/gpu/pd_transfer.sh
#
# Needs two GPUs and .whl/ (../shared/gpu-host/wheels.sh) carried along. Writes under $OUT
# (default ./out): tests.txt (the gpu-marked tests) and transfer.jsonl (pd_transfer.py).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/host_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 420 python3 -m pytest -q -m gpu tests/dist/test_disagg.py tests/dist/test_disagg_router.py -k nccl 2>&1 \
  | tail -30 | tee "$OUT/tests.txt"
timeout 300 python3 benchmarks/gpu/pd_transfer.py 2>&1 | tee "$OUT/transfer.jsonl"
