#!/usr/bin/env bash
# Build-check-test-bench on a GPU machine in one call, a short summary table last.
#   tools/device_check.sh [stage ...]   stages: build info tests tests80 sanitize bench (default: all but build)
# The library is expected at python/flashjax/libflashjax.so (built elsewhere with tools/build.sh and carried);
# the "build" stage builds it here instead. Logs and JSON go to $OUT (or bench/out). Environment knobs:
#   FLASHJAX_SWEEP_N (sweep size), FLASHJAX_TEST_JOBS (pytest-xdist workers), BENCH_ARGS (extra bench.py flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
STAGES=${*:-info tests tests80 sanitize bench}
declare -A RESULT

stage() { [[ " $STAGES " == *" $1 "* ]]; }
record() { RESULT[$1]=$2; echo "== $1: $2"; }

if stage build; then
  # The GPU machine has no network: CUTLASS headers travel in .devcarry/cutlass_include (copied from the
  # nvidia-cutlass package by the caller); the XLA FFI headers come from the jax installed there.
  BUILD=build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}
  { cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$(command -v $PY)" \
      -DFLASHJAX_KERNEL_SET="${FLASHJAX_KERNEL_SET:-full}" -DFLASHJAX_CUDA_ARCHS="${FLASHJAX_CUDA_ARCHS:-90a-real}" \
      -DFLASHJAX_CUTLASS_INCLUDE="$PWD/.devcarry/cutlass_include" \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" &&
    ninja -C "$BUILD" -j "$(nproc)" && cp "$BUILD/libflashjax.so" python/flashjax/ && cp "$BUILD/libflashjax.so" "$OUT/"
  } > "$OUT/build.log" 2>&1 && record build ok || { record build FAILED; grep -E "error|Error" "$OUT/build.log" | head -30; }
fi
if stage info; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
  $PY -m flashjax 2>&1 | tee "$OUT/info.log" | head -40 && record info ok || record info FAILED
fi
run_gpu_tests() {  # $1: label, $2: value of FLASHJAX_DISABLE_FAMILIES
  FLASHJAX_DISABLE_FAMILIES="$2" timeout "${TEST_TIMEOUT:-1800}" $PY -m pytest -q -n "${FLASHJAX_TEST_JOBS:-8}" tests/gpu -p no:cacheprovider \
    -rf --durations=8 ${PYTEST_ARGS:-} > "$OUT/gpu_tests_$1.log" 2>&1
  local rc=$?
  grep -E "^FAILED|s call " "$OUT/gpu_tests_$1.log" | cut -c1-400 | head -20
  record "tests_$1" "$(tail -1 "$OUT/gpu_tests_$1.log") (rc $rc)"
}
# On Hopper the forward runs the sm90 family by default; "sm80" runs the portable family everywhere.
if stage tests; then run_gpu_tests default ""; fi
if stage tests80; then run_gpu_tests sm80 sm90; fi
if stage sanitize; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --kernel-name kns=flashjax --print-limit 20 \
      $PY tests/gpu/sanitize.py > "$OUT/$tool.log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)
    record "$tool" "${summary:-no summary} (rc $rc)"
    [ $rc -eq 0 ] || tail -20 "$OUT/$tool.log"
  done
fi
if stage bench; then
  $PY bench/bench.py --quick --json "$OUT/bench.json" --png "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  rc=$?
  record bench "rc $rc"
fi

echo
echo "================ summary ================"
for key in build info tests_default tests_sm80 memcheck racecheck bench; do
  [ -n "${RESULT[$key]:-}" ] && printf '%-10s %s\n' "$key" "${RESULT[$key]}"
done
if stage bench && [ -f "$OUT/bench.log" ]; then
  echo "---- bench (tail) ----"
  tail -25 "$OUT/bench.log"
fi
