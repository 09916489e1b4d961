#!/usr/bin/env bash
# The mask-kernels branch's GPU work (issue 38, the kernels half): run from the repo root on an H200 machine where
# `tools/device_check.sh build` built python/flashjax/libflashjax.so (full kernel set) and the sanitizer driver.
#   1. tests/gpu/test_mask_mods.py (and the CPU wiring tests of the mask path, quick);
#   2. compute-sanitizer memcheck + racecheck on flashjax_sanitize's mask-bits configs (default plan and sm80-only);
#   3. lab/device/mask_kernels_bench.py: B4 S4096 H16 D128 causal document mask (16 docs), fwd and bwd, against the
#      same call without the mask and against flash_attn_varlen over the same documents.
# Logs under $OUT (default bench/out/mask-kernels); a short summary at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/mask-kernels}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
summary=()
record() { summary+=("$(printf '%-22s %s' "$1" "$2")"); }

timeout 2400 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_mask_mods.py > "$OUT/test_mask_mods.log" 2>&1
rc=$?
record test_mask_mods "rc $rc: $(tail -1 "$OUT/test_mask_mods.log")"
[ $rc -eq 0 ] || grep -E "^FAILED|Error" "$OUT/test_mask_mods.log" | head -20
grep -o "FLASHJAX_MASK_SEED=[0-9]*" "$OUT/test_mask_mods.log" | head -1

timeout 900 $PY -m pytest -q -p no:cacheprovider tests/cpu/test_mask_bits_path.py tests/cpu/test_mask_tiles.py \
  > "$OUT/test_mask_cpu.log" 2>&1
record test_mask_cpu "rc $?: $(tail -1 "$OUT/test_mask_cpu.log")"

DRIVER=${SANITIZE_DRIVER:-$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)}
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -z "$DRIVER" ] || [ ! -x "$DRIVER" ]; then
  record sanitize "FAILED: no flashjax_sanitize binary (run tools/device_check.sh build, or set SANITIZE_DRIVER)"
else
  only=$("$DRIVER" --list | grep "mask bits" | sed -E 's/^\[([0-9]+)\].*/--only \1/' | tr '\n' ' ')
  echo "sanitize: $DRIVER $only"
  for tool in memcheck racecheck; do
    for mode in default sm80; do
      disabled=""; [ "$mode" = sm80 ] && disabled=sm90
      FLASHJAX_DISABLE_FAMILIES="$disabled" timeout 900 "$SANITIZER" --tool "$tool" --kernel-name kns=flashjax \
        --print-limit 20 "$DRIVER" $only > "$OUT/${tool}_$mode.log" 2>&1
      rc=$?
      s=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/${tool}_$mode.log" | tail -1 | sed 's/^=* *//')
      record "${tool}_$mode" "${s:-no summary} (rc $rc, $(grep -c ': ok$' "$OUT/${tool}_$mode.log") configs ok)"
      [ $rc -eq 0 ] || { grep -E "FAILED" "$OUT/${tool}_$mode.log" | head -5; tail -5 "$OUT/${tool}_$mode.log"; }
    done
  done
fi

timeout 900 $PY lab/device/mask_kernels_bench.py > "$OUT/bench.log" 2>&1
rc=$?
cat "$OUT/bench.log" | tail -8
record bench "rc $rc (table above, $OUT/bench.log)"

echo "== mask-kernels summary"
printf '%s\n' "${summary[@]}"
