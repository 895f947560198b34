#!/usr/bin/env bash
# SFT on a generated chat JSONL, then RL on a prompt file, on CPU (examples/sft_chat/README.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one-rank SFT on a shared CPU: see README
python examples/sft_chat/make_data.py --out runs/sft_chat/data
meshrl sft @ configs/sft_chat/sft.toml
meshrl eval @ configs/sft_chat/eval.toml --output-dir runs/sft_chat/eval_sft
meshrl rl @ configs/sft_chat/rl.toml
meshrl eval @ configs/sft_chat/eval.toml --model.path runs/sft_chat/rl/checkpoints/final --output-dir runs/sft_chat/eval_rl
