#!/usr/bin/env bash
# The mask-bits branch's GPU work (issue 38, the mask-bits half): tests/gpu/test_mask_bits.py (every example mod's
# kernel bits against the reference at ragged sizes, recompile counting, export, a B4 S4096 timing print) and
# lab/tools/mask_bits_time.py (per-call time and first compile of the masks issue 38 measures), then a summary.
#   lab/device/mask-bits.sh        from the repository root, on a GPU, with python/flashjax/libflashjax.so built
#                                  from this branch (tools/device_check.sh build); logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LIB=python/flashjax/libflashjax.so
if ! $PY -c "import ctypes, sys; ctypes.CDLL(sys.argv[1]).flashjax_mask_bits_execute" "$LIB" 2>/dev/null; then
  echo "== $LIB lacks the flashjax_mask_bits target: build it from this branch (tools/device_check.sh build)"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true

$PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_mask_bits.py 2>&1 | tee "$OUT/mask_bits_tests.log"
tests_rc=${PIPESTATUS[0]}
$PY lab/tools/mask_bits_time.py --json "$OUT/mask_bits_time.json" 2>&1 | tee "$OUT/mask_bits_time.log"
time_rc=${PIPESTATUS[0]}

echo
echo "== summary (mask-bits)"
echo "tests/gpu/test_mask_bits.py: rc $tests_rc, $(tail -n 1 "$OUT/mask_bits_tests.log")"
grep "mask-bits B4 S4096" "$OUT/mask_bits_tests.log" || true
echo "lab/tools/mask_bits_time.py: rc $time_rc"
grep -E "us/call|device:" "$OUT/mask_bits_time.log" || true
exit $(( tests_rc != 0 || time_rc != 0 ))
