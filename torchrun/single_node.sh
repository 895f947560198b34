#!/usr/bin/env bash
# Run a meshrl rank module under torchrun on this node, without the `meshrl` launcher.
#
# usage: torchrun/single_node.sh [NPROC] rl|sft CONFIG.toml [@ more.toml ...] [--dotted.key value ...]
#        NPROC=3 torchrun/single_node.sh rl CONFIG.toml [overrides]
#
# NPROC is the number of processes: the first argument if it is a number, else the NPROC
# environment variable. It must equal the config's world size:
#   rl:  1 + layout.num_trainer_ranks + layout.num_inference_ranks   (one CPU controller + one GPU per rank)
#   sft: num_ranks
# On a mismatch the ranks exit 2 (local rank 0 prints "the config lays out N ranks but torchrun started M")
# before any process group starts; torchrun then reports the failed ranks.
# On a CUDA node, rl needs num_trainer_ranks + num_inference_ranks visible GPUs (set
# CUDA_VISIBLE_DEVICES): the controller is the process whose local rank has no GPU (or, with more
# GPUs visible, the last local rank, whose GPU then idles).
#
# Unlike `meshrl rl|sft`, this neither clears old RUN_DIR/logs/error-rank*.txt files nor prints a
# failure summary; after a failure read RUN_DIR/logs/ (error-rank{R}.txt, rank{R}-{role}.log).
# Environment: PYTHON (default: .venv/bin/python of this repository if present, else python3),
# OMP_NUM_THREADS (default: CPU cores / NPROC), MASTER_PORT is chosen by torchrun --standalone,
# MAX_RESTARTS (default 0): when a rank dies, torchrun restarts every rank up to this many times
# and the run resumes from its latest complete checkpoint (set checkpoint.every; docs/checkpoints.md).
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

if [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]]; then
    NPROC=$1
    shift
fi
[[ $# -ge 2 ]] || usage
MODE=$1
CONFIG=$2
shift 2
case "$MODE" in
    rl|sft) ;;
    *) echo "single_node.sh: MODE must be rl or sft, got '$MODE'" >&2; usage ;;
esac
if [[ -z "${NPROC:-}" ]]; then
    echo "single_node.sh: set NPROC (env var or first argument); rl: 1 + trainer + inference ranks, sft: num_ranks" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
CORES=$(nproc 2>/dev/null || echo 1)
THREADS=$(( CORES / NPROC ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    -m "meshrl.runtime.$MODE" @ "$CONFIG" "$@"
