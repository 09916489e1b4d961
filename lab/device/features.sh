#!/usr/bin/env bash
# The GPU checks and timings of the kernel paths added on 2026-12-07 (second session), after tools/device_check.sh
# build on the same machine: stages "tests", "sanitize", "bench" (default all), each bounded, a summary last.
#   lab/device/features.sh [tests] [sanitize] [bench]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python:$PWD/tests/gpu" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
STAGES=${*:-tests sanitize bench}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }
if stage tests; then
  FLASHJAX_SWEEP_N=${SWEEP_N:-8} FLASHJAX_VARLEN_N=${SWEEP_N:-8} timeout "${TEST_TIMEOUT:-260}" $PY -m pytest -q \
    -n "${JOBS:-14}" -p no:cacheprovider -rf ${TEST_FILES:-tests/gpu/test_mask_mods.py tests/gpu/test_mask_mod_jvp.py \
    tests/gpu/test_varlen_mask_mods.py tests/gpu/test_jvp.py tests/gpu/test_varlen.py tests/gpu/test_varlen_jvp.py} \
    > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -30
  note "tests rc $rc: $(tail -1 "$OUT/tests.log")"
fi
if stage sanitize; then
  DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SANITIZE_TOOLS:-memcheck}; do
    timeout "${SANITIZE_TIMEOUT:-120}" "$SAN" --tool "$tool" --kernel-name kns=flashjax --print-limit 10 "$DRIVER" \
      ${SANITIZE_ARGS:-} > "$OUT/${tool}.log" 2>&1
    rc=$?
    grep -E "FAILED|failed" "$OUT/${tool}.log" | head -5
    note "$tool rc $rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/${tool}.log" | tail -1), $(grep -c ': ok$' "$OUT/${tool}.log") ok"
  done
fi
if stage bench; then
  timeout 120 $PY bench/bench.py --impls flashjax --dirs fwd,jvp --rows '^d(64|128|256)-s4096-(causal|full)$' \
    > "$OUT/bench_jvp_fused.log" 2>&1; note "jvp fused rc $?"
  FLASHJAX_FUSED_JVP=0 timeout 120 $PY bench/bench.py --impls flashjax --dirs fwd,jvp \
    --rows '^d128-s4096-(causal|full)$' > "$OUT/bench_jvp_pair.log" 2>&1; note "jvp pair rc $?"
  timeout 70 $PY bench/varlen.py --rows '^pack' --dirs fwd > "$OUT/bench_varlen_walk0.log" 2>&1; note "varlen walk0 rc $?"
  FLASHJAX_SM90_VARLEN_WALK=2 timeout 70 $PY bench/varlen.py --rows '^pack' --dirs fwd \
    > "$OUT/bench_varlen_walk2.log" 2>&1; note "varlen walk2 rc $?"
  timeout "${MASK_TIMEOUT:-120}" $PY lab/device/mask_kernels_bench.py --cases "${MASK_CASES:-docs4k,docs16k,prefix,window}" \
    > "$OUT/bench_mask.log" 2>&1; note "mask bench rc $?"
  tail -14 "$OUT"/bench_jvp_fused.log "$OUT"/bench_jvp_pair.log
  grep -hE "cost" "$OUT"/bench_varlen_walk*.log
  tail -40 "$OUT/bench_mask.log"
fi
echo "================ summary"
printf '%s\n' "${SUMMARY[@]}"
