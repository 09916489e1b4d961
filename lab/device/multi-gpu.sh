#!/usr/bin/env bash
# Issue 42 on one GPU: bench/multi_gpu.py runs on the kernels (a ring of 1, batch/head "sharding" over a mesh of 1),
# so that the multi-GPU run is known to work before a multi-GPU machine is lent. Run from the repo root on an H200
# machine (jax 0.11.2 + CUDA 13, no network) after `tools/device_check.sh build`:
#   lab/device/multi-gpu.sh            # about 5 minutes; logs, JSON and the profiler traces go to $OUT
# Stages: smoke (tiny bf16 sizes on the kernels), ring tests (tests/gpu/test_ring.py; its 2-GPU tests skip on one),
# bench ((a) S 4k and 16k, (b) S 32k and 64k total tokens, D 128, with jax.profiler traces). A short summary is last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
declare -a SUMMARY

[ -f python/flashjax/libflashjax.so ] || echo "warning: python/flashjax/libflashjax.so is missing (run tools/device_check.sh build)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader

timeout 300 $PY bench/multi_gpu.py --smoke --dtype bfloat16 --json "$OUT/multi_gpu_smoke.json" > "$OUT/multi_gpu_smoke.log" 2>&1
rc=$?; SUMMARY+=("smoke (bf16, kernels): rc $rc")
tail -22 "$OUT/multi_gpu_smoke.log"

timeout 600 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_ring.py > "$OUT/multi_gpu_ring_tests.log" 2>&1
rc=$?; SUMMARY+=("tests/gpu/test_ring.py: $(tail -1 "$OUT/multi_gpu_ring_tests.log") (rc $rc)")

timeout 600 $PY bench/multi_gpu.py --sizes a=4096,16384 --sizes b=32768,65536 --trace "$OUT/multi_gpu_trace" \
  --json "$OUT/multi_gpu.json" > "$OUT/multi_gpu.log" 2>&1
rc=$?; SUMMARY+=("bench (a: S 4k,16k; b: S 32k,64k): rc $rc (JSON $OUT/multi_gpu.json, traces $OUT/multi_gpu_trace)")
grep -E "^\[|FAILED|note:|profile:" "$OUT/multi_gpu.log" | cut -c1-200
sed -En '/^[0-9]+ x /,$p' "$OUT/multi_gpu.log"

echo; echo "== summary (rc 0 = every check passed; 124 = timed out)"
printf '%s\n' "${SUMMARY[@]}"
