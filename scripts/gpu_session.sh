#!/usr/bin/env bash
# Every check and measurement of the GPU machine, in ONE command that installs nothing (a fresh machine
# takes a minute to start, so one command does it all):
#   1. the GPU tests (every program through the CUDA and PTX backends, the CUDA fast paths on and off,
#      the megakernel against transformers), without -x so that one failure does not hide the others;
#   2. the autotuner's kernels compiled in parallel (plans and tuning variants from the carried .plans/);
#   3. the kernel benchmark of the ten cases, each plan autotuned over its candidates and variants;
#   3b. (STAGES=profile) Nsight Compute reports of mdsl's kernel of each PROFILE_CASES case;
#   3c. (STAGES=tpprobe) one-way latency between two GPUs: put-with-signal against flagged words (scripts/tp_probe.py);
#   3d. (STAGES=mmabits) whether wgmma's f32 sums are mma.sync's bits (scripts/mma_bits_probe.cu);
#   4. the megakernel decode benchmark (quick mode) and one profiler trace; on a machine with 2 or more GPUs
#      also Qwen3-8B over 2 GPUs (tensor parallelism) under each runtime variant, with a trace of both ranks;
#   4b. (STAGES=rank) the decode benchmark on one rank's shapes of two GPUs, on one GPU;
#   5. (STAGES="sanitize serve servehttp") the GPU serving device under compute-sanitizer, the serving
#      benchmark of the GPU and megakernel devices, and the HTTP load test;
#   5b. (STAGES=gemm) benchmarks/gemm.py on GEMM_ARGS' shapes;
#   5c. (STAGES=prefill) time to first token of the GPU serving device against PyTorch's forward pass;
#   5d. (STAGES=linears) the GPU serving device's linears against their floors and cuBLAS;
#   6. (STAGES=torchbench) torch.compile with the mdsl backend against Inductor, on the plans carried in .plans-torch;
#   7. (STAGES="random call") random programs timed as a user calls them, on the plans carried in .plans-random
#      (RANDOM_ARGS: the seed and count they were searched with), and the host time of a kernel call, on the
#      plans carried in .plans-call (the device has no z3: a plan the cache lacks is not searched there).
# A snapshot records its commit from a COMMIT file (`git rev-parse --short HEAD > COMMIT`, carried: it is ignored).
# A carried .mdsl-state (a copy of the state directory of the user who made and checked those plans:
# mdsl.search.trust) lets the plans be served without re-checking each in every process.
# Each stage has a hard time limit (seconds, overridable) so that a hang costs that stage only;
# STAGES="precompile kernels" runs a subset.
# Output under $OUT (at most 8 files come back from a device call): summary.txt, tests.log, decode.txt (where the
# decode stage ran), serve.md and serve.json (where the serve stage ran), all.tar.gz (every log and every benchmark's results).
#
#   bash scripts/gpu_session.sh          (with the plan cache .plans/ from the CPU machine beside it)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT/all"
PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MDSL_GPU_ARTIFACTS="$OUT/all/failures"
export MDSL_GPU_SEED="${MDSL_GPU_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
# a snapshot (git archive HEAD, no .git) names its commit in a COMMIT file: the harness records that one
[ -f COMMIT ] && export MDSL_COMMIT="$(cat COMMIT)"
# the carried state directory's key must be this user's and closed to others, or mdsl.search.trust ignores it
[ -f .mdsl-state/key ] && chmod 700 .mdsl-state && chmod 600 .mdsl-state/key && export MDSL_STATE_DIR="$PWD/.mdsl-state"
# the GPU tests take about 5 to 6 minutes: the tensor-parallel file with 6 workers beside the rest with 14
TESTS_LIMIT="${TESTS_LIMIT:-360}" DECODE_LIMIT="${DECODE_LIMIT:-280}"
PRECOMPILE_LIMIT="${PRECOMPILE_LIMIT:-120}"
KERNEL_ARGS="${KERNEL_ARGS:---no-compile}"   # e.g. KERNEL_ARGS=" " to include torch.compile (default and max-autotune)
# with torch.compile the kernels stage needs about 450 s (its --time-limit, 60 s less, must leave room for the
# last case's torch.compile contenders); without, 190
case " $KERNEL_ARGS " in *" --no-compile "*) KERNELS_LIMIT="${KERNELS_LIMIT:-190}";; *) KERNELS_LIMIT="${KERNELS_LIMIT:-450}";; esac
STAGES="${STAGES:-tests precompile kernels decode}"   # profile: on request
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

stage() {   # stage NAME LIMIT LOG COMMAND...: run with a hard limit, record rc and seconds
    local name=$1 limit=$2 log=$3; shift 3
    case " $STAGES " in *" $name "*) ;; *) echo "== $name: skipped (STAGES=$STAGES)"; return;; esac
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - t0 ))
    tail -n 30 "$log"
    printf '%-10s rc=%-4s %4ss  %s\n' "$name" "$rc" "$took" \
        "$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 2 | tr '\n' ' ')" \
        | tee -a "$SUMMARY"
    [ "$rc" -eq 124 ] && echo "           (killed at its ${limit}s limit)" | tee -a "$SUMMARY"
}

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  if [ -n "${MDSL_COMMIT:-}" ]; then echo "commit $MDSL_COMMIT (snapshot)"
  else git log -1 --format='commit %h %s' 2>/dev/null || true; fi; } 2>&1 | tee -a "$SUMMARY"

# a throwaway plan cache for the tests (no plan from an earlier run is reused); the benchmark reads .plans.
# GPU_TESTS: the tests besides the tensor-parallel file (default: every GPU test); TP_TESTS: which of the
# tensor-parallel file's (pytest node ids; default: the whole file). -v, the passes filtered
# out: a run cut at its limit still names the tests that failed.
# The tensor-parallel tests (a minute or more each: one GPU's engine and every rank's) run beside the
# others from the start in their own pytest, so that the stage's limit does not fall on them. No -q: it
# cancels -v out, and a run cut at its limit would name no test.
TESTS_CMD="$PY -m pytest -m gpu --maxfail=40 --timeout=240 -p no:cacheprovider -rfE"
stage tests "$TESTS_LIMIT" "$OUT/tests.log" env MDSL_CACHE_DIR="$(mktemp -d)" bash -c "
    $TESTS_CMD -v ${TP_TESTS:-tests/gpu/test_tensor_parallel_gpu.py} -n ${TP_TEST_WORKERS:-6} > '$OUT/all/tests_tp.log' 2>&1 &
    $TESTS_CMD -v ${GPU_TESTS:-tests/gpu tests/backend/ptx/test_ptx_gpu.py} --ignore=tests/gpu/test_tensor_parallel_gpu.py \
        -n ${TEST_WORKERS:-14} | tee '$OUT/all/tests_verbose.log' | grep -vE ' PASSED '; wait
    echo '== tensor-parallel tests'; cat '$OUT/all/tests_tp.log'"
grep -hE '^(FAILED|ERROR) ' "$OUT/tests.log" | head -n 40 >> "$SUMMARY"
[ -f "$OUT/all/tests_verbose.log" ] && ! grep -qE '^=+ .* in [0-9.]+s' "$OUT/all/tests_verbose.log" && {   # cut
    echo "tests (cut): $(grep -cE ' PASSED ' "$OUT/all/tests_verbose.log") passed before the cut"
    grep -hE ' (FAILED|ERROR) ' "$OUT/all/tests_verbose.log"; } >> "$SUMMARY"
[ -f "$OUT/all/tests_tp.log" ] && ! grep -qE '^=+ .* in [0-9.]+s' "$OUT/all/tests_tp.log" && {   # cut
    # (-v: each test's verdict is printed as it ends, so a cut run still names the ones that failed)
    echo "tensor-parallel tests (cut): $(grep -cE ' PASSED ' "$OUT/all/tests_tp.log") passed before the cut"
    grep -hE ' (FAILED|ERROR) ' "$OUT/all/tests_tp.log"; } >> "$SUMMARY"

# the autotuner's kernels compiled in parallel first (16 cores here), so that the benchmark's time goes to timing
stage precompile "$PRECOMPILE_LIMIT" "$OUT/all/precompile.log" env MDSL_CACHE_DIR="$PWD/.plans" \
    $PY scripts/precompile_parallel.py --jobs 15 --autotune 3 --variants 8 ${PRECOMPILE_CASES:-}
stage kernels "$KERNELS_LIMIT" "$OUT/all/kernels.log" env MDSL_CACHE_DIR="$PWD/.plans" \
    $PY benchmarks/kernels.py $KERNEL_ARGS --reps 100 --autotune 3 --variants 8 \
    --time-limit $(( KERNELS_LIMIT - 60 )) --out "$OUT/all/kernels"
cp "$OUT/all/kernels/results.md" "$OUT/kernels.md" 2>/dev/null

# Nsight Compute over mdsl's kernel of each PROFILE_CASES case (the autotuner's pick, read from the cache the
# kernels stage wrote; run that stage first): the full section set, the SASS with its stall samples, a text report
PROFILE_CASES="${PROFILE_CASES:-rms_norm_linear_bs1,rms_norm_linear_bs8,gated_mlp}"
profile() {
    local dir="$OUT/all/profile"   # in all.tar.gz, with the other large files
    mkdir -p "$dir"
    for case in ${PROFILE_CASES//,/ }; do
        ncu --clock-control none --set full --import-source no --kernel-name "regex:^${case}_" \
            --launch-skip 3 --launch-count 2 -f -o "$dir/$case" \
            $PY benchmarks/kernels.py --cases "$case" --no-compile --no-graphs --no-ptx --reps 5 --warmup 5 \
            --autotune 3 --variants 8 --out "$OUT/all/profile_$case" || echo "ncu failed on $case"
        ncu --import "$dir/$case.ncu-rep" --page details > "$dir/$case.details.txt" 2>&1
        ncu --import "$dir/$case.ncu-rep" --page raw --csv > "$dir/$case.raw.csv" 2>&1
        ncu --import "$dir/$case.ncu-rep" --page source --print-source sass --csv > "$dir/$case.sass.csv" 2>&1
    done
}
stage profile "${PROFILE_LIMIT:-240}" "$OUT/all/profile.log" env MDSL_CACHE_DIR="$PWD/.plans" bash -c "$(declare -f profile); OUT='$OUT' PY=$PY PROFILE_CASES='$PROFILE_CASES' profile"

# (STAGES=tpprobe, 2 GPUs or more) one-way latency between two GPUs of the megakernel's put-with-signal
# against flagged words (scripts/tp_probe.py)
stage tpprobe "${TPPROBE_LIMIT:-90}" "$OUT/all/tp_probe.log" $PY scripts/tp_probe.py --world 2

# (STAGES=mmabits) mma.sync m16n8k16 against wgmma m64n64k16 (A from shared memory and from registers; B K-major
# and MN-major) over the same k16 chains: the bits of a row computed by either (scripts/mma_bits_probe.cu)
stage mmabits "${MMABITS_LIMIT:-120}" "$OUT/all/mma_bits.log" bash -c \
    'nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o "$0/mma_bits" scripts/mma_bits_probe.cu && "$0/mma_bits"' \
    "$(mktemp -d)"

GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
# the engine's default options only; DECODE_ARGS="--variants ..." adds the kept options' other values
DECODE_ARGS="${DECODE_ARGS:---models qwen3-8b --variants default --trace-model qwen3-8b}"
TP_VARIANTS="${TP_VARIANTS:-default}"
[ "$GPUS" -ge 2 ] && DECODE_ARGS="$DECODE_ARGS --tp 2 --tp-variants $TP_VARIANTS"
stage decode "$DECODE_LIMIT" "$OUT/all/decode.log" $PY benchmarks/decode.py --quick $DECODE_ARGS --out "$OUT/all/decode"
[ -f "$OUT/all/decode.log" ] && grep -E '^\[|^\||Error|error' "$OUT/all/decode.log" | tail -n 150 > "$OUT/decode.txt"
# (STAGES=rank) one rank's shapes of 2 GPUs run on one GPU, without its all-reduces (benchmarks/decode.py
# --rank-of 2): measures a change to a rank's kernel on a machine with one GPU
RANK_ARGS="${RANK_ARGS:---models qwen3-8b --variants default --trace-model qwen3-8b}"
stage rank "${RANK_LIMIT:-200}" "$OUT/all/rank.log" $PY benchmarks/decode.py --quick --rank-of 2 $RANK_ARGS --out "$OUT/all/rank"
[ -f "$OUT/all/rank.log" ] && grep -E '^\[|^\||Error|error' "$OUT/all/rank.log" | tail -n 150 > "$OUT/all/rank.txt"

# (STAGES=sanitize) compute-sanitizer's memcheck over each GPU serving device on a tiny checkpoint: many
# requests, contexts of several attention splits, a pool small enough to preempt
stage sanitize "${SANITIZE_LIMIT:-240}" "$OUT/all/sanitize.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY scripts/serve_check.py --device gpu
stage sanitize "${SANITIZE_LIMIT:-240}" "$OUT/all/sanitize_megakernel.log" compute-sanitizer --tool memcheck \
    --error-exitcode 3 $PY scripts/serve_check.py --device megakernel
# (STAGES=serve) the serving benchmark (benchmarks/serve.py) of the GPU device and then the megakernel device, in
# one process: step times by batch and context (the GPU device's op profile, the megakernel's launches), offline
# and online runs, a prompt arriving while requests decode; SERVE_ARGS picks the model, the parts, the devices
# (--device) and the requests (128 here: the benchmark's default 256 take twice as long in each online run, 64 s
# at 4 requests/s on each device alone)
stage serve "${SERVE_LIMIT:-480}" "$OUT/all/serve.log" $PY benchmarks/serve.py \
    ${SERVE_ARGS:---model qwen3-0.6b --requests 128} --out "$OUT/all/serve"
[ -f "$OUT/all/serve/serve.md" ] && cp "$OUT/all/serve/serve.md" "$OUT/all/serve/serve.json" "$OUT/"
# (STAGES=servehttp) the HTTP load test against the offline engine (benchmarks/serve_http.py)
stage servehttp "${SERVE_HTTP_LIMIT:-400}" "$OUT/all/serve_http.log" $PY benchmarks/serve_http.py \
    ${SERVE_HTTP_ARGS:---model qwen3-8b --device gpu --clients 64 --requests 256 --max-tokens 128 --offline} \
    --out "$OUT/all/serve_http"

# (STAGES=prefill) time to first token (benchmarks/prefill.py): prompts of 128, 1024 and 4096 tokens on the three
# models by the GPU serving device and by transformers' forward pass; about 4 minutes
stage prefill "${PREFILL_LIMIT:-360}" "$OUT/all/prefill.log" $PY benchmarks/prefill.py ${PREFILL_ARGS:-} \
    --out "$OUT/all/prefill"

# (STAGES=linears) the GPU serving device's linears at the models' decode and prompt-chunk rows
# (benchmarks/serve_linears.py); under a minute
stage linears "${LINEARS_LIMIT:-150}" "$OUT/all/serve_linears.log" $PY benchmarks/serve_linears.py \
    ${LINEARS_ARGS:---models qwen3-8b --rows 1,8,32,64,256} --out "$OUT/all/serve_linears"

# (STAGES=gemm) the GEMM benchmark's contenders (torch.matmul, the Hopper wgmma GEMM, ...) on GEMM_ARGS' shapes
stage gemm "${GEMM_LIMIT:-200}" "$OUT/all/gemm.log" $PY benchmarks/gemm.py \
    ${GEMM_ARGS:---rows 1024 --shapes 4096:6144,4096:4096,4096:24576,12288:4096} --out "$OUT/all/gemm"

# (STAGES=torchbench) torch.compile with the mdsl backend against Inductor (benchmarks/torch_compile.py) on the plans
# in .plans-torch (made on a CPU machine with the device's torch and transformers: --plans-only), each re-checked
# once on all cores first (`mdsl cache check`: the benchmark's reads then find them trusted)
TORCHBENCH_LIMIT="${TORCHBENCH_LIMIT:-540}"
stage torchbench "$TORCHBENCH_LIMIT" "$OUT/all/torchbench.log" env MDSL_CACHE_DIR="$PWD/.plans-torch" bash -c \
    "$PY -m mdsl cache check --jobs 16; $PY benchmarks/torch_compile.py --time-limit $(( TORCHBENCH_LIMIT - 90 )) \
     ${TORCHBENCH_ARGS:-} --out '$OUT/all/torchbench'"

# (STAGES=random) the random programs of RANDOM_ARGS' seed timed on the GPU against PyTorch (their plans from
# .plans-random, made by the same command on the CPU machine); each program's first call tunes (its seconds
# are in the results: first_call_s), which a device call's 600 s may not hold for 30 programs: RANDOM_ARGS
# with --first/--count splits the run
stage random "${RANDOM_LIMIT:-560}" "$OUT/all/random.log" $PY benchmarks/random_programs.py ${RANDOM_ARGS:---seed 31 --count 30} \
    --gpu --cache .plans-random --out "$OUT/all/random"
# (STAGES=call) the host time of a kernel call (its plans from .plans-call: benchmarks/call_overhead.py's cases
# searched with its default --budget on the CPU machine)
stage call "${CALL_LIMIT:-90}" "$OUT/all/call.log" env MDSL_CACHE_DIR="$PWD/.plans-call" \
    $PY benchmarks/call_overhead.py --samples 15 --out "$OUT/all/call"

tar -czf "$OUT/all.tar.gz" -C "$OUT" all && rm -rf "$OUT/all"
echo "== summary"; cat "$SUMMARY"
