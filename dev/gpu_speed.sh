#!/usr/bin/env bash
# The kernels' evidence on one CUDA GPU, in one call, from the repository root:
#   bash dev/gpu_speed.sh                                  # every stage that fits in BUDGET_S seconds
#   STAGES=maze,ref_maze BUDGET_S=400 bash dev/gpu_speed.sh   # chosen stages (sudoku_all: only so)
#   AB=gated bash dev/gpu_speed.sh                         # the A/B stages time kernels=gated against off, not auto
#   AB=quack bash dev/gpu_speed.sh                         # ... kernels=quack (quack-kernels, installed as below)
#   AB_MAZE=cudnn ...                                      # the Maze A/B's value apart (AB=auto: cudnn)
#   DRY=1 bash dev/gpu_speed.sh                            # on a CPU: each stage starts, tiny, in Triton's interpreter
# Stages, in this order (each skipped when its estimate no longer fits the budget, each under its own timeout):
#   check     backends/kernels.py vs the plain path vs float64 at the real shapes, the gated GEMMs' TMA tiles vs
#             their loads bit for bit (dev/kernels_check.py exact)
#   sudoku    bench.py config/baseline.py, kernels off then AB (auto: what a user gets, mlp_t on Hopper) in one
#             run (--kernels_ab), and a profile of two compiled steps with AB's kernels (top kernels by GPU time)
#   ref_mlp   the reference's step and evaluation, Sudoku MLP batch 768 (.gpu/ref_gpu_bench.py, .gpu/ref/models)
#   maze      bench.py config/maze.py --global_batch_size=192, kernels off then AB (AB=auto: cudnn, as auto is off
#             for attention; AB=gated times the gated GEMMs), and a profile of the second's two steps (into
#             bench_maze.txt)
#   ref_maze  the reference's step and evaluation, Maze attention batch 192
#   train     a tiny training run's token accuracy with every kernel and with none (dev/kernels_check.py train)
#   ops       each fused op's ms per call against the compiled plain path (the gated GEMMs: against cuBLAS's bare
#             product too), the autotuner's pick and every tile it timed, each in ms and useful TFLOP/s; then mlp_t
#             in a sequence-major layout ([S, B, D]: plain matmuls, no transpose), compiled plain, to decide on it;
#             the Maze attention through each of SDPA's backends and SDPA's own pick
#   sudoku_all  (only where STAGES names it) the Sudoku A/B with every fused kernel: off then triton, no profile
#             (into knobs.txt, not the table)
#   autotune  (KNOBS=1 only) the Sudoku step with kernels=AB under compile_mode max-autotune-no-cudagraphs
#             (inductor's autotuning: minutes of compilation), to set beside
#             the sudoku stage's figures
# Everything goes to $OUT (at most 8 files); the summary table is printed last. The machine has no network: what
# the reference and quack need comes in ignored folders that dev/gpu_stage.sh fills on this side. The reference's
# pydantic is installed from .gpu/whl into /tmp/site and put on its PYTHONPATH only. quack-kernels (kernels='quack',
# optional): its wheels in .gpu/quack are unzipped into .gpu_site/site-packages with every call; its CuTe DSL
# compiler library (193 MB unpacked, .gpu_libs/cu13.tar.xz: too big to travel beside .gpu) is unpacked there by an
# earlier call on the same warm machine: first `mkdir -p .gpu_site/site-packages && tar -xJf .gpu_libs/cu13.tar.xz
# -C .gpu_site/site-packages` carrying .gpu_libs, then this script carrying .gpu. Without them the quack line says
# why and 'quack' runs as 'off'. The folder's name matters: quack keys its epilogues by what they call, and takes a
# function for an installed library's, keyed by its name, only where its file lies under a site-packages folder.
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_speed_out}
BUDGET_S=${BUDGET_S:-540}
DRY=${DRY:-0}
STAGES=${STAGES:-check,sudoku,ref_mlp,maze,ref_maze,train,ops}
AB=${AB:-auto}
# a budget in minutes ends every stage in a bash error, a switch spelt otherwise is ignored: said now, in one line
case $BUDGET_S in ''|*[!0-9]*)
    echo "gpu_speed: BUDGET_S='$BUDGET_S' (allowed: a whole number of seconds)" >&2; exit 1 ;; esac
for kv in "DRY=$DRY" "KNOBS=${KNOBS:-0}"; do
    case ${kv#*=} in 0|1) ;; *) echo "gpu_speed: ${kv%%=*}='${kv#*=}' (allowed: 0, 1)" >&2; exit 1 ;; esac
done
[ "${KNOBS:-0}" = 1 ] && STAGES="$STAGES,autotune"
PY=${PY:-$(command -v python || command -v python3)}
mkdir -p "$OUT"
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    DRYFLAG=--dry
    # tiny shapes on the CPU: the kernels in the interpreter, float32; the stages start, their figures mean nothing
    TINY="--device=cpu --forward_dtype=float32 --hidden_size=32 --num_heads=2 --H_cycles=1 --L_cycles=1
          --halt_max_steps=2 --global_batch_size=2 --eval_batch_size=2 --steps=1 --warmup_steps=1 --eval_batches=1
          --seq_len=16 --puzzle_emb_len=2 --puzzle_emb_ndim=32"
    SUDOKU_ARGS="$TINY"
    MAZE_ARGS="$TINY"
    PROFILE=""
    # auto's pick on a Hopper GPU for the Sudoku A/B: on a CPU auto is off, and the A/B would time nothing
    AB_SUDOKU=$([ "$AB" = auto ] && echo mlp_t || echo "$AB")
else
    DRYFLAG=""
    AB_SUDOKU=$AB
    SUDOKU_ARGS="--steps=10 --warmup_steps=2 --eval_batches=2"
    MAZE_ARGS="--global_batch_size=192 --steps=10 --warmup_steps=2 --eval_batches=2"
    PROFILE="--profile_steps=0:2 --profile_dir=/tmp/gpu_speed_profile"
fi

# auto is off for attention models: the Maze A/B times cuDNN's attention instead (AB_MAZE=... another value)
AB_MAZE=${AB_MAZE:-$([ "$AB" = auto ] && echo cudnn || echo "$AB")}

# a misspelt stage or value is said now, not after the stages before it have spent the session's time
KNOWN_STAGES="check sudoku sudoku_all ref_mlp train ops maze ref_maze autotune"
for s in ${STAGES//,/ }; do
    case " $KNOWN_STAGES " in *" $s "*) ;; *)
        echo "gpu_speed: STAGES names '$s' (allowed: ${KNOWN_STAGES// /, })" >&2; exit 1 ;; esac
done
KERNELS=$("$PY" -c 'from configurator import KERNELS; print(*KERNELS)')
for kv in "AB=$AB" "AB_MAZE=$AB_MAZE"; do
    case " $KERNELS " in *" ${kv#*=} "*) ;; *)
        echo "gpu_speed: ${kv%%=*}='${kv#*=}' (allowed: ${KERNELS// /, })" >&2; exit 1 ;; esac
done

say "gpu_speed: $(date -u +%FT%TZ) | budget ${BUDGET_S} s | stages $STAGES | A/B off vs $AB (Maze: $AB_MAZE) | out $OUT | dry $DRY"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "machine: ${GPU:-no GPU (nvidia-smi absent)} | $(nproc) CPUs"
VERSIONS='import sys, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = "none (%s)" % type(e).__name__
print(sys.version.split()[0], "| torch", torch.__version__, "| triton", tv, "| cuda", torch.version.cuda)'
say "python: $($PY -c "$VERSIONS" 2>&1 | tail -1)"
say "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"

# the reference's pydantic, from the carried wheels
REF_OK=1
for p in .gpu/ref_gpu_bench.py .gpu/ref/models .gpu/whl; do
    [ -e "$p" ] || { REF_OK=0; say "note: $p is missing: the reference stages are skipped"; }
done
if [ "$REF_OK" = 1 ]; then
    if $PY -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1 \
        || PYTHONPATH=/tmp/site $PY -c 'import pydantic' 2>/dev/null; then
        say "reference: pydantic from .gpu/whl in /tmp/site"
    else
        REF_OK=0; say "note: pydantic did not install from .gpu/whl: the reference stages are skipped"
    fi
fi

# quack-kernels, where its wheels came: unzipped beside the compiler library (a wheel is a zip of site-packages'
# files; nvidia_cutlass_dsl's .pth names the folder added last)
QSITE=$PWD/.gpu_site/site-packages
if [ "$DRY" != 1 ] && ls .gpu/quack/*.whl >/dev/null 2>&1; then
    mkdir -p "$QSITE"
    for w in .gpu/quack/*.whl; do "$PY" -m zipfile -e "$w" "$QSITE" || say "note: $w did not unzip"; done
    export PYTHONPATH="$QSITE:$QSITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
fi
QUACK='from backends.kernels import load_quack; load_quack(); import quack; print("quack-kernels", quack.__version__)'
say "quack: $(TRITON_INTERPRET= "$PY" -c "$QUACK" 2>&1 | tail -1 | cut -c1-300)"

# estimate (s) and cap (s) of each stage on a cold H100/H200 (compilation included): a stage is skipped only where
# it would not fit, so an estimate is what the stage took there with a margin, not a bound; the budget's default
# leaves the table and the transfers room in the device's 600 s a call
declare -A EST=([check]=60 [sudoku]=165 [sudoku_all]=165 [ref_mlp]=120 [train]=30 [ops]=100 [maze]=170 [ref_maze]=100
                [autotune]=400)
declare -A CAP=([check]=240 [sudoku]=330 [sudoku_all]=330 [ref_mlp]=200 [train]=90 [ops]=240 [maze]=330 [ref_maze]=200
                [autotune]=560)
declare -A TOOK RESULT

run_stage() {  # name, output file, command...: under timeout, appended to the file, its time and status noted
    local name=$1 file=$2; shift 2
    local now left limit t rc
    now=$(date +%s); left=$((BUDGET_S - (now - T0)))
    if [ "$DRY" != 1 ] && [ "$left" -lt "${EST[$name]}" ]; then
        RESULT[$name]="skipped (${left} s left, needs ~${EST[$name]} s)"; say "== $name: ${RESULT[$name]}"; return
    fi
    limit=${CAP[$name]}; [ "$DRY" != 1 ] && [ "$left" -lt "$limit" ] && limit=$left
    say "== $name (timeout ${limit} s) -> $file"
    t=$(date +%s)
    timeout -k 10 "$limit" "$@" >> "$file" 2>&1; rc=$?
    TOOK[$name]=$(( $(date +%s) - t ))
    case $rc in 0) RESULT[$name]=ok ;; 124|137) RESULT[$name]="TIMED OUT" ;; *) RESULT[$name]="FAILED (exit $rc)" ;; esac
    say "   $name: ${RESULT[$name]} in ${TOOK[$name]} s; last lines:"
    tail -n 4 "$file" | sed 's/^/   | /' | tee -a "$SUMMARY"
}

ref_stage() {  # name, variant, batch
    if [ "$REF_OK" != 1 ]; then RESULT[$1]="skipped (no .gpu reference)"; say "== $1: ${RESULT[$1]}"; return; fi
    if [ "$DRY" = 1 ]; then
        RESULT[$1]="dry: $($PY -c 'import ast,sys; ast.parse(open(".gpu/ref_gpu_bench.py").read()); print("parses")')"
        say "== $1: ${RESULT[$1]} (needs CUDA)"; return
    fi
    run_stage "$1" "$OUT/$1.txt" env STEPS=10 REF=.gpu/ref PYTHONPATH=/tmp/site "$PY" .gpu/ref_gpu_bench.py "$2" "$3"
}

summarize_profile() {  # the last stage's trace (bench.py --profile_steps), its top kernels into the file named
    if [ -n "$PROFILE" ] && [ -f /tmp/gpu_speed_profile/trace_0_2.json ]; then
        "$PY" dev/kernels_check.py profile /tmp/gpu_speed_profile/trace_0_2.json "$1" >/dev/null 2>&1 \
            && return 0
        say "note: the profile's summary failed"
    fi
    return 1
}

for stage in ${STAGES//,/ }; do
    case $stage in
        check) run_stage check "$OUT/check.txt" "$PY" dev/kernels_check.py exact $DRYFLAG ;;
        train) run_stage train "$OUT/check.txt" "$PY" dev/kernels_check.py train $DRYFLAG ;;
        ops) run_stage ops "$OUT/check.txt" "$PY" dev/kernels_check.py ops $DRYFLAG ;;
        sudoku)
            rm -rf /tmp/gpu_speed_profile
            run_stage sudoku "$OUT/bench_sudoku.txt" "$PY" bench.py config/baseline.py --kernels=off \
                --kernels_ab="$AB_SUDOKU" $SUDOKU_ARGS $PROFILE
            summarize_profile "$OUT/profile_sudoku.txt" ;;
        sudoku_all) run_stage sudoku_all "$OUT/knobs.txt" "$PY" bench.py config/baseline.py \
                --kernels=off --kernels_ab=triton $SUDOKU_ARGS ;;
        maze)
            rm -rf /tmp/gpu_speed_profile
            run_stage maze "$OUT/bench_maze.txt" "$PY" bench.py config/maze.py --kernels=off --kernels_ab="$AB_MAZE" \
                $MAZE_ARGS $PROFILE
            summarize_profile /tmp/gpu_speed_profile/maze.txt && cat /tmp/gpu_speed_profile/maze.txt \
                >> "$OUT/bench_maze.txt" ;;
        ref_mlp) ref_stage ref_mlp mlp 768 ;;
        ref_maze) ref_stage ref_maze maze 192 ;;
        autotune) run_stage autotune "$OUT/knobs.txt" "$PY" bench.py config/baseline.py --kernels="$AB_SUDOKU" \
                --compile_mode=max-autotune-no-cudagraphs $SUDOKU_ARGS ;;
    esac
done

say ""
say "stages (s): $(for s in ${STAGES//,/ }; do printf '%s=%s:%s ' "$s" "${TOOK[$s]:--}" "${RESULT[$s]:-not run}"; done)"
say "total $(( $(date +%s) - T0 )) s | files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
say ""
"$PY" dev/kernels_check.py table "$OUT" | tee -a "$SUMMARY"
