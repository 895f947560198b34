#!/usr/bin/env bash
# Issue 14's GPU benchmarks on one H200: three family shapes (docs/models.md, "Benchmark shapes"),
#   glm4_moe air-like-3L    GLM-4.5-Air's layers, 3 of them (6.17B parameters, 2.02B active)
#   deepseek_v3 v3-like-3L  DeepSeek-V3's MLA + MoE layers, 3 of them, 32 experts (5.72B, 3.60B active)
#   qwen3_5 like-2B-24L     a Qwen3.5-like hybrid: 18 Gated DeltaNet + 6 full-attention layers (1.88B)
# each through, in this order (FAMILIES_PARTS picks; random weights, bf16):
#   train   meshrl bench trainer (one row of 8192 tokens, AdamW; tokens/s, MFU, peak memory; a run
#           that fails, e.g. out of memory, is retried once with --ac full)
#   engine  meshrl bench engine, native (256 sequences x (128 + 256) tokens: decode tok/s, step ms, memory;
#           a run that fails is retried once with --attention torch, which the vllm part then uses too)
#   vllm    meshrl bench engine --compare vllm (plain_256 through the native engine and through
#           vLLM, which loads the native engine's weights as an HF folder; only where vLLM imports)
# Every command runs under `timeout -k 5`, capped by what is left of FAMILIES_BUDGET (540 s from the
# start of this script; the vLLM part shares what is left equally among its shapes): a command
# that would get under 20 s is skipped and says so. FAMILIES_ONLY=glm4_moe,qwen3_5 picks shapes;
# FAMILIES_ATTENTION=torch sets the vllm part's native decode attention (default auto). Written as they come:
#   $OUT/families.jsonl    one JSON line per result (the command's own, plus part/family/flavor/rc)
#   $OUT/families.status   one line per command: part family flavor rc seconds
#   $OUT/<part>_<family>[_retry].out / .log   each command's stdout / stderr; $OUT/gpu.txt
#
# Device-tool calls (../shared/gpu-host/README.md; run from the project root on the CPU machine
# first: `../shared/gpu-host/wheels.sh` and `../shared/gpu-host/vllm-bundle.sh`):
#   A (trainer + native engine, ~5 min, no vLLM needed):
#     carry [".whl"], command:
#       python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit; FAMILIES_PARTS=train,engine bash benchmarks/gpu/families.sh
#   1-5 (back to back, K = 0..4): carry [".vllm/part0K"], command: mkdir -p /tmp/vb && cp .vllm/part0K /tmp/vb/
#   6 (vLLM comparison, ~8-9 min): carry [".vllm/part05", ".vllm/bundle.sha256", ".whl"], command:
#       mkdir -p /tmp/vb && cp .vllm/part05 .vllm/bundle.sha256 /tmp/vb/ && (cd /tmp/vb && cat part0? > bundle.tar && sha256sum -c bundle.sha256 && tar -xf bundle.tar) && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vb/core/*.whl /tmp/vb/extra/*.whl .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 || exit; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit; FAMILIES_PARTS=vllm bash benchmarks/gpu/families.sh
# (One call with all three parts also works; the budget then cuts what does not fit.)
#
# CPU smoke run of the same commands (debug flavors, a few tokens; what tests/unit/test_families_script.py
# runs): FAMILIES_TINY=1 OUT=/tmp/fam PYTHON=.venv/bin/python bash benchmarks/gpu/families.sh
set -u
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
PARTS=${FAMILIES_PARTS:-train,engine,vllm}
BUDGET=${FAMILIES_BUDGET:-540}
TINY=${FAMILIES_TINY:-0}
START=$(date +%s)
mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1

if [ "$TINY" = 1 ]; then
  SHAPES=("glm4_moe debug" "deepseek_v3 debug" "qwen3_5 debug")
  TRAIN=(--device cpu --seq-len 64 --docs 2 --steps 1 --warmup 1)
  ENGINE=(--device cpu --num-seqs 3 --prompt-tokens 5 --gen-tokens 4 --no-hf)
  MATRIX=(--device cpu --workloads plain_256 --scale 0.01 --batch-scale 0.01 --max-num-seqs 16)
  CAP_TRAIN=120; CAP_ENGINE=120; CAP_VLLM=120
else
  SHAPES=("glm4_moe air-like-3L" "deepseek_v3 v3-like-3L" "qwen3_5 like-2B-24L")
  TRAIN=(--seq-len 8192 --docs 1 --steps 5 --warmup 2)
  ENGINE=(--num-seqs 256 --prompt-tokens 128 --gen-tokens 256 --no-hf)
  MATRIX=(--workloads plain_256 --max-num-seqs 256)
  CAP_TRAIN=100; CAP_ENGINE=100; CAP_VLLM=220
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
fi
if [ -n "${FAMILIES_ONLY:-}" ]; then  # e.g. FAMILIES_ONLY=qwen3_5: these families' shapes only
  picked=()
  for shape in "${SHAPES[@]}"; do case ",$FAMILIES_ONLY," in *",${shape%% *},"*) picked+=("$shape") ;; esac; done
  SHAPES=("${picked[@]}")
fi

"$PY" -c "import meshrl.runtime.engine.bench_matrix" 2>/dev/null \
  || "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "meshrl is not importable (see $OUT/install.log)"; exit 1; }
HAVE_VLLM=0
"$PY" -c "import vllm" > /dev/null 2>&1 && HAVE_VLLM=1
# the folder vLLM loads (up to ~13 GB): RAM-backed /dev/shm when it has room, else the temp dir
EXPORT_DIR=${FAMILIES_EXPORT_DIR:-}
if [ -z "$EXPORT_DIR" ]; then
  EXPORT_DIR=${TMPDIR:-/tmp}
  shm=$(df -BG --output=avail /dev/shm 2>/dev/null | awk 'NR == 2' | tr -dc 0-9)
  [ "${shm:-0}" -gt 40 ] && EXPORT_DIR=/dev/shm
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run PART FAMILY FLAVOR CAP SHARE -- bench args...: one command under timeout; its JSON lines, tagged, into
# families.jsonl; RC = its exit status (skip: not run for want of budget)
RC=0
run() {
  local part=$1 family=$2 flavor=$3 cap=$4 share=$5; shift 6
  # at most CAP, and at most 1/SHARE of what is left (SHARE: commands still to run, this one included)
  local t; t=$(( ($(left) - 5) / share )); t=$(( t < cap ? t : cap ))
  local name="${part}_${family}" begin rc
  [ -e "$OUT/$name.out" ] && name="${name}_retry"  # a retry keeps the first attempt's files
  if [ "$t" -lt 20 ]; then
    echo "$part $family $flavor skipped (budget: $(left) s left)" | tee -a "$OUT/families.status"
    RC=skip
    return
  fi
  # the native engine's side comes first (build, export, warm-up, rows: ~40-60 s on the H200)
  [ "$part" = vllm ] && set -- "$@" --vllm-timeout $(( t > 120 ? t - 55 : t / 2 ))
  begin=$(date +%s)
  timeout -k 5 "$t" "$PY" -m meshrl.runtime.cli bench "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  rc=$?
  "$PY" - "$OUT/$name.out" "$part" "$family" "$flavor" "$rc" >> "$OUT/families.jsonl" <<'PY'
import json, sys
path, part, family, flavor, rc = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.startswith("{")]
for row in rows or [{"error": f"no result (exit {rc}; see {path[:-4]}.log)"}]:
    print(json.dumps({"part": part, "family": family, "flavor": flavor, "rc": int(rc), **row}))
PY
  echo "$part $family $flavor rc=$rc $(( $(date +%s) - begin ))s" | tee -a "$OUT/families.status"
  RC=$rc
}

for shape in "${SHAPES[@]}"; do
  set -- $shape; family=$1; flavor=$2
  case ",$PARTS," in *,train,*)
    run train "$family" "$flavor" $CAP_TRAIN 1 -- trainer --family "$family" --flavor "$flavor" "${TRAIN[@]}"
    case "$RC" in 0|124|137|skip) ;;  # a crash (out of memory, most likely): once more, recomputing activations
      *) run train "$family" "$flavor" $CAP_TRAIN 1 -- trainer --family "$family" --flavor "$flavor" "${TRAIN[@]}" \
           --ac full ;;
    esac ;;
  esac
done
declare -A ATTN  # family -> the decode attention backend its engine run needed
for shape in "${SHAPES[@]}"; do
  set -- $shape; family=$1; flavor=$2
  case ",$PARTS," in *,engine,*)
    run engine "$family" "$flavor" $CAP_ENGINE 1 -- engine --family "$family" --flavor "$flavor" "${ENGINE[@]}"
    case "$RC" in 0|124|137|skip) ;;  # a crash: once more without the Triton decode kernel
      *) run engine "$family" "$flavor" $CAP_ENGINE 1 -- engine --family "$family" --flavor "$flavor" \
           "${ENGINE[@]}" --attention torch
         [ "$RC" = 0 ] && ATTN[$family]=torch ;;
    esac ;;
  esac
done
todo=${#SHAPES[@]}
for shape in "${SHAPES[@]}"; do
  set -- $shape; family=$1; flavor=$2
  case ",$PARTS," in *,vllm,*)
    # without vLLM the matrix would only repeat the native engine: skipped on the GPU host; the
    # CPU smoke run still drives the command (it says vLLM is missing and runs the native rows)
    if [ "$HAVE_VLLM" = 1 ] || [ "$TINY" = 1 ]; then
      run vllm "$family" "$flavor" $CAP_VLLM $todo -- engine --compare vllm --family "$family" --flavors "$flavor" \
        "${MATRIX[@]}" --export-dir "$EXPORT_DIR" --attention "${ATTN[$family]:-${FAMILIES_ATTENTION:-auto}}"
    else
      echo "vllm $family $flavor skipped (vllm is not importable)" | tee -a "$OUT/families.status"
    fi ;;
  esac
  todo=$(( todo - 1 ))
done

# A short table on stdout.
"$PY" - "$OUT/families.jsonl" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for r in rows:
    head = f'{r["part"]:<6} {r["family"]:<12} {r["flavor"]:<12}'
    if "error" in r:
        print(head, "ERROR", str(r["error"])[:200])
    elif r["part"] == "train":
        print(head, f'{r["tokens_per_s"]:>10.0f} tok/s  mfu {r["mfu"]}  peak {r["peak_memory_gib"]} GiB  ac {r["ac"]}')
    elif r["part"] == "engine":
        print(head, f'{r["tokens_per_s"]:>10.0f} tok/s  step {r["decode_step_ms"]:.2f} ms  peak {r["peak_memory_gib"]:.1f} GiB')
    else:
        print(head, f'{r["engine"]:<6} {r["workload"]:<9} {r["tokens_per_s"]:>10.0f} tok/s  '
                    f'step {r["decode_step_ms"]:.2f} ms  x{r.get("step_vs_floor", 0):.2f} floor')
PY
echo "families.sh: $(( $(date +%s) - START )) s"
