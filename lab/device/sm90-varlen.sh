#!/usr/bin/env bash
# Issue 37, sm90 varlen forward (branch sm90-varlen): the GPU checks and timings of this branch's work, on an H200
# with jax 0.11.2 + CUDA 13, from the repository root, after `tools/device_check.sh build` (the full kernel set,
# python/flashjax/libflashjax.so and the sanitizer driver) of a tree whose tools/gen_kernels.py VARLEN has
# ("sm90", "fwd") (steps 1-4 test dispatch's pick; step 0 needs no build). No network needed. Logs go to $OUT
# (default /tmp/out); a short summary is printed last.
#   0. lab/experiments/sm90_varlen_sweep.cu: the varlen kernel outside JAX on random packings;
#   1. tests/gpu/test_varlen.py, default mode (the sm90 forward + sm80 backward) and sm80 mode
#      (FLASHJAX_DISABLE_FAMILIES=sm90), and the default mode again with the sm90 grid capped at 3 CTAs (many tiles
#      per CTA: the virtual-block walk's hand-over from tile to tile);
#   2. the dense sweep's forward-kernel subset, briefly: that the dense sm90 forward did not break;
#   3. compute-sanitizer memcheck (and racecheck, synccheck) on the sanitizer driver's varlen configs, both modes;
#   4. bench/varlen.py's rows (issue 37's 6a / 6b / 6c), forward and backward.
# STEPS picks steps (default "0 1 2 3 4"; "1" is the three test_varlen.py runs), so that one call can build and run
# the first steps and the next call on the still-warm machine the rest.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
JOBS=${FLASHJAX_TEST_JOBS:-8}
declare -a SUMMARY
STEPS=" ${STEPS:-0 1 2 3 4} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
note() { SUMMARY+=("$1"); echo "== $1"; }

# 0. The kernel alone against the CPU reference (lab/experiments/sm90_varlen_sweep.cu; built here unless $SWEEP
#    names a binary built elsewhere, e.g. on a CPU machine with nvcc and carried over): 400 random packings.
SWEEP=${SWEEP:-/tmp/varlen_sweep}
if step 0; then
if [ ! -x "$SWEEP" ]; then
  CUTLASS=${CUTLASS_INCLUDE:-.devcarry/cutlass_include}  # as tools/device_check.sh build
  nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Icsrc -Icsrc/include \
    -isystem "$CUTLASS" lab/experiments/sm90_varlen_sweep.cu -o "$SWEEP" > "$OUT/sweep_build.log" 2>&1
fi
timeout 600 "$SWEEP" 400 0 > "$OUT/sweep.log" 2>&1
rc=$?
note "kernel sweep: $(tail -1 "$OUT/sweep.log") (rc $rc)"
grep -E "BAD|HANG|ERROR" "$OUT/sweep.log" | cut -c1-200 | head -5
fi

$PY -c "import flashjax, jax, jax.numpy as jnp
q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16); k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
cu = jax.ShapeDtypeStruct((5,), jnp.int32)
print(flashjax.explain(q, k, k, cu, cu, causal=True))" 2>&1 | tee "$OUT/explain.log" | tail -1

run_tests() {  # $1 tag, $2 disabled families, then pytest arguments
  local tag=$1 disabled=$2
  shift 2
  FLASHJAX_DISABLE_FAMILIES="$disabled" timeout "${TEST_TIMEOUT:-1200}" $PY -m pytest -q -n "$JOBS" \
    -p no:cacheprovider -rf "$@" > "$OUT/$tag.log" 2>&1
  local rc=$?
  grep -E "^FAILED" "$OUT/$tag.log" | cut -c1-300 | head -10
  note "$tag: $(tail -1 "$OUT/$tag.log") (rc $rc)"
}
if step 1; then
  run_tests varlen_default "" tests/gpu/test_varlen.py tests/gpu/test_varlen_jvp.py tests/gpu/test_varlen_export.py
  run_tests varlen_sm80 sm90 tests/gpu/test_varlen.py
  FLASHJAX_SM90_MAX_CTAS=3 FLASHJAX_VARLEN_N=16 run_tests varlen_capped3 "" tests/gpu/test_varlen.py \
    -k "random or fixed"
fi
step 2 && FLASHJAX_SWEEP_N=${SWEEP_N:-60} run_tests dense_forward "" tests/gpu/test_kernels.py \
  -k "sweep or tile_choices or several_tiles or past_the_last_row or packed_gqa or split_keys or explain"

DRIVER=${SANITIZE_DRIVER:-build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}/tests/sanitize/flashjax_sanitize}
[ -x "$DRIVER" ] || DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if ! step 3; then :
elif [ -n "$DRIVER" ] && [ -x "$DRIVER" ]; then
  ONLY=$("$DRIVER" --list | grep -i "varlen" | sed -E 's/^\[([0-9]+)\].*/--only \1/' | tr '\n' ' ')
  for tool in memcheck racecheck synccheck; do
    for mode in default sm80; do
      disabled=$([ $mode = sm80 ] && echo sm90 || true)
      FLASHJAX_DISABLE_FAMILIES="$disabled" timeout 600 "$SANITIZER" --tool $tool --kernel-name kns=flashjax \
        --print-limit 20 "$DRIVER" $ONLY > "$OUT/sanitize_${tool}_$mode.log" 2>&1
      rc=$?
      summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize_${tool}_$mode.log" | tail -1 | sed 's/^=* *//')
      families=$(grep -oE "fwd sm[0-9]+ bwd sm[0-9]+" "$OUT/sanitize_${tool}_$mode.log" | sort | uniq -c | tr '\n' ';')
      note "sanitize $tool $mode: ${summary:-no summary} (rc $rc, $(grep -c ': ok$' "$OUT/sanitize_${tool}_$mode.log") configs ok; $families)"
      [ $rc -eq 0 ] || grep -E "FAILED|Invalid|error" "$OUT/sanitize_${tool}_$mode.log" | head -5
    done
  done
else
  note "sanitize: no flashjax_sanitize binary (run tools/device_check.sh build first)"
fi

if step 4; then
  timeout 900 $PY bench/varlen.py > "$OUT/bench_varlen.log" 2>&1
  note "bench/varlen.py rc $?"
  FLASHJAX_DISABLE_FAMILIES=sm90 timeout 600 $PY bench/varlen.py --rows "^pack64|^decode" --dirs fwd \
    > "$OUT/bench_varlen_sm80.log" 2>&1
  note "bench/varlen.py sm80 forward (for comparison) rc $?"
fi

echo
echo "==================== sm90-varlen summary ===================="
for line in "${SUMMARY[@]}"; do echo "$line"; done
step 4 || exit 0
echo "--- bench/varlen.py (default: sm90 forward, sm80 backward; cost <= 1.1, speedup > 1.58 / 1.63, of copy >= 0.9)"
cat "$OUT/bench_varlen.log"
echo "--- bench/varlen.py, sm80 forward"
cat "$OUT/bench_varlen_sm80.log"
