#!/usr/bin/env bash
# The GPU check, run from anywhere in the repository on the GPU machine; it installs nothing.
# Prints the machine and versions, runs the GPU tests (log: $OUT/gpu_tests.log, failing programs:
# $OUT/failures.tar.gz), measures host launch overhead ($OUT/launch_overhead.txt) and ends with a
# summary table. Exit status: that of the tests, else that of the measurement.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MDSL_CACHE_DIR="$(mktemp -d)"            # no plan from an earlier run is reused
export MDSL_GPU_ARTIFACTS="$OUT/failures"       # the CUDA source of every failing program
export MDSL_GPU_SEED="${MDSL_GPU_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"   # fresh inputs, reproducible

echo "== machine"
nvidia-smi || echo "nvidia-smi failed (rc $?)"
$PY - <<'PYEOF'
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "torch", "cuda.bindings", "cuda.core", "cuda.pathfinder", "pytest", "z3", "llvmlite"):
    try:
        module = importlib.import_module(name)
        print(f"{name:16} {getattr(module, '__version__', '?')}")
    except ImportError as e:
        note = " (the search needs it: kernels called on GPU arrays run unoptimized)" if name == "z3" else ""
        print(f"{name:16} absent{note}")
try:
    from cuda.bindings import driver, nvrtc
    import cuda.pathfinder as pathfinder
    print("driver          ", driver.cuDriverGetVersion()[1])
    print("nvrtc           ", nvrtc.nvrtcVersion()[1:], "from", pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
except Exception as e:
    print("CUDA versions: could not read them:", type(e).__name__, e)
from mdsl.backend.cuda import runtime
print("mdsl has_gpu()  ", runtime.has_gpu(), "target", runtime.target_arch())
try:   # the PTX backend's code generator (the GPU tests run each program through both backends)
    import llvmlite.binding
    from mdsl.backend.ptx.compile import ptx_features
    print("LLVM            ", llvmlite.binding.llvm_version_info, "PTX features", ptx_features())
except Exception as e:
    print("PTX backend: llvmlite unusable:", type(e).__name__, e)
import tests.gpu.harness  # noqa: F401  (a site-packages `tests` package would shadow ours: fail here, clearly)
PYEOF
preflight=$?
[ $preflight -eq 0 ] || echo "!! the preflight above failed (rc $preflight): the tests below will fail the same way"

echo "== GPU tests (seed $MDSL_GPU_SEED, backends ${MDSL_GPU_BACKENDS:-cuda,ptx})"
# the tests compile some 700 programs (NVRTC, ~0.3 s each) and compute float64 references: spread them
# over processes where pytest-xdist is installed (each has its own CUDA context on the one GPU)
workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
$PY -m pytest tests/gpu -q -m gpu -x --timeout=300 -p no:cacheprovider -p no:benchmark $workers 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== launch overhead"
$PY scripts/launch_overhead.py 2>&1 | tee "$OUT/launch_overhead.txt"
bench_rc=${PIPESTATUS[0]}

if [ -d "$OUT/failures" ]; then   # one file comes back where many might not
    tar -czf "$OUT/failures.tar.gz" -C "$OUT" failures && rm -rf "$OUT/failures"
fi

echo
echo "== summary"
printf '%-16s | %-7s | %s\n' "step" "result" "details"
printf '%-16s-+-%-7s-+-%s\n' "----------------" "-------" "------------------------------------------"
verdict() { [ "$1" -eq 0 ] && echo "ok" || echo "FAILED"; }
printf '%-16s | %-7s | %s\n' "preflight" "$(verdict $preflight)" "versions and has_gpu() above"
printf '%-16s | %-7s | %s\n' "GPU tests" "$(verdict $tests_rc)" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/gpu_tests.log" | tail -n 1) (log: gpu_tests.log)"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | head -n 5 | sed 's/^/                 |         |   /'
printf '%-16s | %-7s | %s\n' "launch overhead" "$(verdict $bench_rc)" "us per call (launch_overhead.txt):"
grep -E '^ +[0-9.]+ us' "$OUT/launch_overhead.txt" | sed 's/^ */                 |         |   /'
[ -f "$OUT/failures.tar.gz" ] && echo "failing programs' CUDA source: failures.tar.gz"
[ $tests_rc -ne 0 ] && exit $tests_rc
exit $bench_rc
