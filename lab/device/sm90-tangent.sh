#!/usr/bin/env bash
# Issue 39, sm90 tangent kernel (branch sm90-tangent): the GPU checks and timings of this branch's work, on an H100 or
# H200 with jax 0.11.2 + CUDA 13, from the repository root, after `tools/device_check.sh build` (the full kernel set
# for 90a: python/flashjax/libflashjax.so and the sanitizer driver). No network needed. Logs go to $OUT (default
# /tmp/out); a short summary is printed last.
#   1. tests/gpu/test_jvp.py (dense jvp / linearize / jacfwd / jvp of grad: on Hopper the sm90 tangent kernel) and
#      tests/gpu/test_varlen_jvp.py (varlen tangents: still the sm80 kernel);
#   2. compute-sanitizer memcheck on the sanitizer driver's dense configs but the mask-mod ones (each runs the
#      tangent that dispatch picks, the sm90 one here, and checks it against float64), then racecheck and synccheck on
#      two of them (SANITIZE_RACE="" skips those);
#   3. bench/bench.py fwd and jvp at D 64/128/256, S 4096, causal and full (issue 39's <= 3x: jvp time / fwd time).
# STEPS picks steps (default "0 1 2 3"; 0 is a one-call smoke test whose failure skips the rest unless FORCE=1).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
JOBS=${FLASHJAX_TEST_JOBS:-8}
declare -a SUMMARY
STEPS=" ${STEPS:-0 1 2 3} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
note() { SUMMARY+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import flashjax, jax, jax.numpy as jnp
q = jax.ShapeDtypeStruct((2, 1000, 8, 128), jnp.bfloat16); k = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
print(flashjax.explain(q, k, k, causal=True))" > "$OUT/explain.log" 2>&1
grep -i "tangent" "$OUT/explain.log" | cut -c1-300
grep -qi "tangent (jax.jvp): sm90 tangent kernel" "$OUT/explain.log" && note "explain: dense tangent on sm90" ||
  note "explain: dense tangent NOT on sm90 (see $OUT/explain.log)"

# 0. Smoke: one small jvp (causal, GQA, D 128, ragged) against the reference under a short timeout, so that a hang or
#    a crash of the new kernel costs two minutes, not the whole budget: the later steps are skipped if it fails.
if step 0; then
  timeout 180 $PY - > "$OUT/smoke.log" 2>&1 <<'PY'
import jax, jax.numpy as jnp, numpy as np, flashjax
rng = np.random.default_rng(0)
def arr(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
q, k, v = arr(2, 300, 8, 128), arr(2, 517, 2, 128), arr(2, 517, 2, 128)
tq, tk, tv = arr(2, 300, 8, 128), arr(2, 517, 2, 128), arr(2, 517, 2, 128)
def run(backend):
    f = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend=backend)
    return jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), (tq, tk, tv))
(_, t_kernel), (_, t_ref) = run("kernel"), run("reference")
a, b = np.asarray(t_kernel, np.float64), np.asarray(t_ref, np.float64)
err = np.linalg.norm(a - b) / np.linalg.norm(b)
print(f"smoke: jvp tangent rel err {err:.3e}, finite {np.isfinite(a).all()}")
assert np.isfinite(a).all() and err < 3e-2, err  # test_jvp: 2e-2 against f32; this reference is bf16 out
PY
  rc=$?
  tail -1 "$OUT/smoke.log"
  note "smoke jvp: rc $rc"
  if [ $rc -ne 0 ]; then
    tail -5 "$OUT/smoke.log"
    [ -z "${FORCE:-}" ] && STEPS=" "  # FORCE=1 runs the later steps anyway
  fi
fi

if step 1; then
  timeout "${TEST_TIMEOUT:-600}" $PY -m pytest -q -n "$JOBS" -p no:cacheprovider -rf \
    tests/gpu/test_jvp.py tests/gpu/test_varlen_jvp.py > "$OUT/jvp_tests.log" 2>&1
  rc=$?
  grep -E "^FAILED|FLASHJAX_SWEEP_SEED=" "$OUT/jvp_tests.log" | cut -c1-300 | head -12
  note "test_jvp + test_varlen_jvp: $(tail -1 "$OUT/jvp_tests.log") (rc $rc)"
fi

if step 2; then
  DRIVER=${SANITIZE_DRIVER:-build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}/tests/sanitize/flashjax_sanitize}
  [ -x "$DRIVER" ] || DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
  SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -z "$DRIVER" ] || [ ! -x "$DRIVER" ]; then
    note "sanitize: FAILED, no flashjax_sanitize binary (run tools/device_check.sh build, or set SANITIZE_DRIVER)"
  else
    # Dense configs: the --list lines with a "(what)" part (varlen ones have none), less the mask-mod ones (no
    # tangent kernel takes mask bits, so they run no tangent).
    "$DRIVER" --list > "$OUT/sanitize_list.txt" 2>&1
    mapfile -t DENSE < <(grep -v "mask bits" "$OUT/sanitize_list.txt" | sed -n 's/^\[\([0-9]*\)\] .*  (.*$/\1/p')
    # racecheck / synccheck: the first dense config and the one that reaches D 256 with every feature.
    RACE=("${DENSE[0]}" $(grep "tangent D 256" "$OUT/sanitize_list.txt" | sed -n 's/^\[\([0-9]*\)\].*/\1/p'))
    ONLY=()
    for i in "${DENSE[@]}"; do ONLY+=(--only "$i"); done
    timeout "${SANITIZE_TIMEOUT:-300}" "$SANITIZER" --tool memcheck --error-exitcode 9 "$DRIVER" "${ONLY[@]}" \
      > "$OUT/memcheck.log" 2>&1
    rc=$?
    grep -E "tangent|FAILED|ERROR SUMMARY" "$OUT/memcheck.log" | cut -c1-200 | head -12
    note "memcheck, ${#DENSE[@]} dense configs: $(grep -c ': ok$' "$OUT/memcheck.log") ok, $(grep -c 'FAILED' \
      "$OUT/memcheck.log") FAILED, $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log") (rc $rc)"
    for tool in ${SANITIZE_RACE-racecheck synccheck}; do
      ONLY=()
      for i in "${RACE[@]}"; do ONLY+=(--only "$i"); done
      timeout "${SANITIZE_TIMEOUT:-400}" "$SANITIZER" --tool "$tool" --error-exitcode 9 "$DRIVER" "${ONLY[@]}" \
        > "$OUT/$tool.log" 2>&1
      rc=$?
      note "$tool, configs ${RACE[*]}: $(grep -m1 'ERROR SUMMARY' "$OUT/$tool.log") (rc $rc)"
    done
  fi
fi

if step 3; then
  timeout "${BENCH_TIMEOUT:-600}" $PY bench/bench.py --impls flashjax --dirs fwd,jvp \
    --rows '^d(64|128|256)-s4096-(causal|full)$' > "$OUT/bench.log" 2>&1
  rc=$?
  tail -20 "$OUT/bench.log"
  note "bench fwd,jvp: rc $rc (table in $OUT/bench.log; issue 39 asks jvp <= 3x fwd)"
fi

echo
echo "== summary ($(cat "$OUT/gpu.txt"))"
printf '%s\n' "${SUMMARY[@]}"
