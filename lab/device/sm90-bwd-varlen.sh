#!/usr/bin/env bash
# Issue 37, sm90 varlen backward (branch sm90-bwd-varlen): the GPU checks and timings of this branch's work, on an
# H100 / H200 with jax 0.11.2 + CUDA 13, from the repository root, after `tools/device_check.sh build` (the full kernel
# set, python/flashjax/libflashjax.so and the sanitizer driver) of this tree, whose tools/gen_kernels.py VARLEN has
# ("sm90", "bwd"): on Hopper dispatch then gives varlen backward calls to the sm90 backward's varlen variant. No network
# needed. Logs go to $OUT (default /tmp/out); a short summary is printed last.
#   0. (optional, ~3 min) lab/experiments/sm90_bwd_varlen_sweep.cu: the varlen backward alone against a CPU
#      reference, NaN in every unused token and every output / workspace buffer, a 10 s watchdog (HANG), $SWEEP_N
#      random packings (default 20) at each of bf16 D 64 / 96 / 128 / 192 / 256 and fp16 D 128 (one binary per
#      width, built in parallel); the quickest way to a failing config if step 1 fails;
#   1. explain() of a varlen call (its backward must name the sm90 backward kernel) and the host tests of the walk
#      and the row zeroing where the build has them; tests/gpu/test_varlen.py (random packings, the fixed cases incl.
#      bwd_key_blocks_d64/128/192/256, NaN in unused q/k/v/dO tokens at D 64/128/192/256, malformed offsets under
#      jit), test_varlen_jvp.py and test_varlen_export.py, default mode (the sm90 family both ways);
#   2. (optional) test_varlen.py in sm80 mode (FLASHJAX_DISABLE_FAMILIES=sm90): the NaN-cotangent test is new there too;
#   3. compute-sanitizer memcheck on the sanitizer driver's varlen configs (11, two of them new: keys around the sm90
#      backward's 64- and 128-key blocks), default mode; with STEPS containing 3r also racecheck and synccheck;
#   4. python bench/varlen.py --rows '^pack64|^pad64' --dirs bwd (the sm80 backward's rows in performance.md 2.8 for
#      comparison: pack64 bwd 128 TFLOP/s, cost 1.17; pad64 bwd 71.2 TFLOP/s, H100);
#   5. (optional) the dense backward, briefly (the dense kernels' SASS is unchanged, their launcher's host code not).
# STEPS picks steps (default "1 3 4", about 4 minutes; "0 1 2 3 3r 4 5" runs everything).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
JOBS=${FLASHJAX_TEST_JOBS:-8}
declare -a SUMMARY
STEPS=" ${STEPS:-1 3 4} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
note() { SUMMARY+=("$1"); echo "== $1"; }

run_tests() {  # $1 tag, $2 disabled families, then pytest arguments
  local tag=$1 disabled=$2
  shift 2
  FLASHJAX_DISABLE_FAMILIES="$disabled" timeout "${TEST_TIMEOUT:-900}" $PY -m pytest -q -n "$JOBS" \
    -p no:cacheprovider -rf "$@" > "$OUT/$tag.log" 2>&1
  local rc=$?
  grep -E "^FAILED" "$OUT/$tag.log" | cut -c1-300 | head -10
  note "$tag: $(tail -1 "$OUT/$tag.log") (rc $rc)"
}

if step 0; then
  CUTLASS=${CUTLASS_INCLUDE:-.devcarry/cutlass_include}  # as tools/device_check.sh build
  widths="64 96 128 192 256 128fp16"
  for w in $widths; do
    d=${w%fp16}
    flags=$([ "$w" != "$d" ] && echo -DSWEEP_FP16 || true)
    nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Icsrc -Icsrc/include \
      -isystem "$CUTLASS" -DSWEEP_D=$d $flags lab/experiments/sm90_bwd_varlen_sweep.cu -o /tmp/bwd_sweep_$w \
      > "$OUT/bwd_sweep_build_$w.log" 2>&1 &
  done
  wait
  for w in $widths; do
    if [ ! -x /tmp/bwd_sweep_$w ]; then
      note "bwd sweep $w: build failed"; grep -E "error" "$OUT/bwd_sweep_build_$w.log" | head -5; continue
    fi
    timeout 300 /tmp/bwd_sweep_$w "${SWEEP_N:-20}" 0 > "$OUT/bwd_sweep_$w.log" 2>&1
    rc=$?
    note "bwd sweep $w: $(tail -1 "$OUT/bwd_sweep_$w.log" | cut -c1-200) (rc $rc)"
    grep -E "BAD|HANG|ERROR" "$OUT/bwd_sweep_$w.log" | cut -c1-300 | head -3
  done
fi

if step 1; then
  $PY -c "import flashjax, jax, jax.numpy as jnp
q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16); k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
cu = jax.ShapeDtypeStruct((5,), jnp.int32)
print(flashjax.explain(q, k, k, cu, cu, causal=True))" > "$OUT/explain.log" 2>&1
  note "explain, varlen backward: $(grep -o 'backward: [^(]*([^)]*)' "$OUT/explain.log" | head -1 | cut -c1-160)"
  HOST=$(ls -t build/*/tests/cpp/flashjax_host_tests 2>/dev/null | head -1)
  if [ -n "$HOST" ]; then
    "$HOST" --gtest_filter='Sm90BwdVarlen*:ChooseKernel*:VarlenScheduler*:Sm90VarlenVRows*' > "$OUT/host_tests.log" 2>&1
    rc=$?
    note "host tests: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/host_tests.log" | tr '\n' ' ') (rc $rc)"
  fi
  run_tests varlen_default "" tests/gpu/test_varlen.py tests/gpu/test_varlen_jvp.py tests/gpu/test_varlen_export.py
fi
step 2 && run_tests varlen_sm80 sm90 tests/gpu/test_varlen.py

DRIVER=${SANITIZE_DRIVER:-build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}/tests/sanitize/flashjax_sanitize}
[ -x "$DRIVER" ] || DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if ! step 3; then :
elif [ -n "$DRIVER" ] && [ -x "$DRIVER" ]; then
  ONLY=$("$DRIVER" --list | grep -i "varlen" | sed -E 's/^\[([0-9]+)\].*/--only \1/' | tr '\n' ' ')
  tools="memcheck"
  step 3r && tools="memcheck racecheck synccheck"
  for tool in $tools; do
    timeout 600 "$SANITIZER" --tool $tool --kernel-name kns=flashjax --print-limit 20 "$DRIVER" $ONLY \
      > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize_$tool.log" | tail -1 | sed 's/^=* *//')
    families=$(grep -oE "fwd sm[0-9]+ bwd sm[0-9]+" "$OUT/sanitize_$tool.log" | sort | uniq -c | tr '\n' ';')
    note "sanitize $tool: ${summary:-no summary} (rc $rc, $(grep -c ': ok$' "$OUT/sanitize_$tool.log") configs ok; $families)"
    [ $rc -eq 0 ] || grep -E "FAILED|Invalid|error" "$OUT/sanitize_$tool.log" | head -5
  done
else
  note "sanitize: no flashjax_sanitize binary (run tools/device_check.sh build first)"
fi

if step 4; then
  timeout 600 $PY bench/varlen.py --rows '^pack64|^pad64' --dirs bwd > "$OUT/bench_varlen_bwd.log" 2>&1
  note "bench/varlen.py --rows '^pack64|^pad64' --dirs bwd: rc $?"
fi

step 5 && FLASHJAX_SWEEP_N=${SWEEP_N:-40} run_tests dense_backward "" tests/gpu/test_kernels.py \
  -k "test_sweep or backward_cases or deterministic or sm90_bwd_head_dims or explain_names_the_sm90_backward"

echo
echo "==================== sm90-bwd-varlen summary ===================="
for line in "${SUMMARY[@]}"; do echo "$line"; done
if step 4; then
  echo "--- bench/varlen.py bwd (sm90 varlen backward; bar: pack64 cost <= 1.1; sm80's: cost 1.17, pad64 71.2 TFLOP/s)"
  cat "$OUT/bench_varlen_bwd.log"
fi
