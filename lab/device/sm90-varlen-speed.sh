#!/usr/bin/env bash
# Issue 37 bars 6a / 6c, sm90 varlen forward speed (branch varlen-fwd-speed): the GPU checks and timings of this
# branch, on an H100 / H200 with jax 0.11.2 + CUDA 13, from the repository root, after `tools/device_check.sh build`
# (python/flashjax/libflashjax.so with every kernel, and the sanitizer driver). No network. Logs go to $OUT (default
# /tmp/out); a summary is printed last. About 4-6 minutes with the default steps (STEPS="1", then STEPS="2 3" on the
# still-warm machine, splits it).
#   1. tests/gpu/test_varlen.py: default mode (sm90 forward: cost-balanced CTA ranges, GQA packed where the mean
#      query length is short), the same with the grid capped at 3 CTAs (long ranges per CTA), and with
#      FLASHJAX_SM90_PACK_GQA=1 (every GQA varlen call on the packed varlen kernel);
#   2. compute-sanitizer memcheck on the sanitizer driver's varlen configs (two of them decode-shaped, GQA 4:1: the
#      packed varlen kernel, one with malformed offsets);
#   3. python bench/varlen.py --dirs fwd (pack64 cost <= 1.1, decode of copy >= 0.9; f34164c on the H100: pack64
#      1.34, pack1000 1.02, decode 0.36), then its pack rows again with FLASHJAX_SM90_VARLEN_WALK=1 (the balanced
#      ranges; the default is round robin: the A/B of bar 6a's change in one build).
#   0. (not by default) lab/experiments/sm90_varlen_sweep.cu, the kernel outside JAX on 300 random packings, then
#      200 more with every GQA config packed (its build takes a few minutes).
# STEPS picks steps (default "1 2 3").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
JOBS=${FLASHJAX_TEST_JOBS:-8}
declare -a SUMMARY
STEPS=" ${STEPS:-1 2 3} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
note() { SUMMARY+=("$1"); echo "== $1"; }

SWEEP=${SWEEP:-/tmp/varlen_sweep}
if step 0; then
  if [ ! -x "$SWEEP" ]; then
    CUTLASS=${CUTLASS_INCLUDE:-.devcarry/cutlass_include}
    nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -lineinfo -DSWEEP_D128_ONLY -Icsrc \
      -Icsrc/include -isystem "$CUTLASS" lab/experiments/sm90_varlen_sweep.cu -o "$SWEEP" > "$OUT/sweep_build.log" 2>&1
  fi
  timeout 300 "$SWEEP" 300 0 > "$OUT/sweep.log" 2>&1
  note "kernel sweep: $(tail -1 "$OUT/sweep.log") (rc $?)"
  FLASHJAX_SM90_PACK_GQA=1 timeout 300 "$SWEEP" 200 1000 > "$OUT/sweep_packed.log" 2>&1
  note "kernel sweep, GQA packed: $(tail -1 "$OUT/sweep_packed.log") (rc $?)"
  grep -hE "BAD|HANG|ERROR" "$OUT/sweep.log" "$OUT/sweep_packed.log" | cut -c1-200 | head -5
fi

$PY -c "import flashjax, jax, jax.numpy as jnp
q = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16); k = jax.ShapeDtypeStruct((300000, 8, 128), jnp.bfloat16)
cu = jax.ShapeDtypeStruct((65,), jnp.int32)
print(flashjax.explain(q, k, k, cu, cu))" 2>&1 | tee "$OUT/explain.log" | tail -1

run_tests() {  # $1 tag, then pytest arguments
  local tag=$1
  shift
  timeout "${TEST_TIMEOUT:-600}" $PY -m pytest -q -n "$JOBS" -p no:cacheprovider -rf "$@" > "$OUT/$tag.log" 2>&1
  local rc=$?
  grep -E "^FAILED" "$OUT/$tag.log" | cut -c1-300 | head -10
  note "$tag: $(tail -1 "$OUT/$tag.log") (rc $rc)"
}
if step 1; then
  run_tests varlen_default tests/gpu/test_varlen.py
  FLASHJAX_SM90_MAX_CTAS=3 FLASHJAX_VARLEN_N=16 run_tests varlen_capped3 tests/gpu/test_varlen.py -k "random or fixed"
  FLASHJAX_SM90_PACK_GQA=1 FLASHJAX_VARLEN_N=24 run_tests varlen_packed tests/gpu/test_varlen.py \
    -k "random or fixed or malformed or nan"
fi

DRIVER=${SANITIZE_DRIVER:-build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}/tests/sanitize/flashjax_sanitize}
[ -x "$DRIVER" ] || DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if ! step 2; then :
elif [ -n "$DRIVER" ] && [ -x "$DRIVER" ]; then
  ONLY=$("$DRIVER" --list | grep -i "varlen" | sed -E 's/^\[([0-9]+)\].*/--only \1/' | tr '\n' ' ')
  timeout 400 "$SANITIZER" --tool memcheck --kernel-name kns=flashjax --print-limit 20 "$DRIVER" $ONLY \
    > "$OUT/sanitize_memcheck.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY" "$OUT/sanitize_memcheck.log" | tail -1 | sed 's/^=* *//')
  note "sanitize memcheck varlen: ${summary:-no summary} (rc $rc, $(grep -c ': ok$' "$OUT/sanitize_memcheck.log") configs ok)"
  [ $rc -eq 0 ] || grep -E "FAILED|Invalid|error" "$OUT/sanitize_memcheck.log" | head -5
else
  note "sanitize: no flashjax_sanitize binary (run tools/device_check.sh build first)"
fi

if step 3; then
  timeout 400 $PY bench/varlen.py --dirs fwd > "$OUT/bench_varlen.log" 2>&1
  note "bench/varlen.py --dirs fwd rc $?"
  FLASHJAX_SM90_VARLEN_WALK=1 timeout 300 $PY bench/varlen.py --dirs fwd --rows '^pack' \
    > "$OUT/bench_varlen_round_robin.log" 2>&1
  note "bench/varlen.py pack rows, FLASHJAX_SM90_VARLEN_WALK=1 rc $?"
fi

echo
echo "==================== sm90-varlen-speed summary ===================="
for line in "${SUMMARY[@]}"; do echo "$line"; done
if step 3; then
  echo "--- bench/varlen.py --dirs fwd (pack cost <= 1.1; decode of copy >= 0.9)"
  cat "$OUT/bench_varlen.log"
  echo "--- the pack rows with FLASHJAX_SM90_VARLEN_WALK=1 (balanced ranges)"
  cat "$OUT/bench_varlen_round_robin.log"
fi
