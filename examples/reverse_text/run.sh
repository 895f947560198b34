#!/usr/bin/env bash
# Reverse-text demo: supervised warm-up of a tiny char-level Qwen3, then asynchronous RL, then both
# checkpoints evaluated on held-out words (greedy exact match, lcs reward, length ratio).
# Runs on a CPU-only machine; on one GPU the trainer and the engine share it (layout.colocate =
# "auto"); with two GPUs exposed (CUDA_VISIBLE_DEVICES=0,1) each gets its own.
# Extra arguments go to the RL stage, e.g.: bash examples/reverse_text/run.sh --max-steps 40
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch is pinned on purpose: on a CPU machine torch==2.13.0 resolves to a CPU wheel, while a
# looser pin downloads a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0 -e .

.venv/bin/meshrl sft @ configs/reverse_text/sft.toml
.venv/bin/meshrl rl @ configs/reverse_text/rl.toml "$@"
for stage in sft rl; do
    .venv/bin/meshrl eval @ configs/reverse_text/eval.toml --model.path runs/reverse_text/$stage/checkpoints/final \
        --output-dir runs/reverse_text/eval_$stage > /dev/null
done
.venv/bin/python - <<'PY'
import json
print("held-out (256 words, greedy)   exact   reward  length_ratio")
for stage in ("sft", "rl"):
    r = json.load(open(f"runs/reverse_text/eval_{stage}/results.json"))
    k = "env/reverse-text/"
    print(f"{stage:>28}   {r[k + 'exact']:.3f}   {r[k + 'lcs']:.3f}   {r[k + 'length_ratio']:.3f}")
PY
