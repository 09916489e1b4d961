#!/usr/bin/env bash
# The GPU checks and timings of issues 37 / 38 in one device call, each step bounded by what is left of the call
# (DEADLINE: epoch seconds; a step runs only with 20 s or more left), most wanted first. After a build on the same
# machine (tools/device_check.sh build), or with a library built here and carried (python/flashjax/libflashjax.so):
#   DEADLINE=$(( $(date +%s) + 560 )) lab/device/deadline_checks.sh
# Steps (STEPS; default: tests det mask_bench bits_time probe_window ncu_maskbwd): the mask GPU tests, the
# deterministic ones, the mask bench, the bits kernel's time, the ncu durations of the window mod's kernels, the full
# ncu report of its backward kernel beside the native one's (the SASS lines that stall most); also varlen (the pack64
# row), probe (ncu of the varlen forward) and sanitize_det (the sanitizers on the deterministic mask-mod config).
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/python:$PWD/tests/gpu" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
O=${OUT:-bench/out}; mkdir -p "$O"
left() { echo $(( ${DEADLINE:?} - $(date +%s) )); }
step() {  # step NAME SECONDS CMD...: runs CMD under min(SECONDS, time left - 5), if at least 20 s are left
  local name=$1 want=$2; shift 2; local l=$(( $(left) - 5 )); (( l < 20 )) && { echo "== $name skipped"; return; }
  (( want < l )) && l=$want; timeout $l "$@" > "$O/$name.log" 2>&1; echo "== $name rc $? ($l s allowed)"; }
for s in ${STEPS:-tests det mask_bench bits_time probe_window ncu_maskbwd}; do case $s in
  mask_bench) step mask_bench 150 python lab/device/mask_kernels_bench.py
     grep -E "===|^[a-z].* [0-9]+\.[0-9]{3} |diff|alone" "$O/mask_bench.log" | head -30 ;;
  bits_time) step bits_time 70 python lab/tools/mask_bits_time.py; tail -12 "$O/bits_time.log" ;;
  varlen) step varlen 60 python bench/varlen.py --rows '^pack64' --dirs fwd; grep -E "cost|pack" "$O/varlen.log" | tail -3 ;;
  tests) step tests ${T_TESTS:-200} python -m pytest -q -n 12 -p no:cacheprovider -rf ${TEST_FILES:-tests/gpu/test_mask_mods.py tests/gpu/test_mask_bits.py tests/gpu/test_mask_mod_jvp.py}
     tail -1 "$O/tests.log"; grep -E "^FAILED|^ERROR" "$O/tests.log" | cut -c1-200 | head -25 ;;
  det) step det 90 python -m pytest -q -n 6 -p no:cacheprovider -rf "tests/gpu/test_kernels.py::test_deterministic_backward_matches_and_repeats_bit_for_bit"
     tail -1 "$O/det.log"; grep -E "^FAILED" "$O/det.log" | cut -c1-200 ;;
  probe) NCU_KERNELS="fwd_kernel|fill" step probe 120 lab/device/probe.sh varlen; cut -c1-700 "$O/probe.log" | head -24 ;;
  probe_window) step probe_window 150 lab/device/probe.sh window; grep -E "^-- launch|time_duration" "$O/probe_window.log" | cut -c1-240 | head -40 ;;
  ncu_maskbwd)  # the window mod's backward kernel against the native window's, full sections and per-SASS-line stalls
     NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu); R="$O/ncu_maskbwd"
     step ncu_maskbwd 240 "$NCU" --set full --clock-control none --import-source no --kernel-name-base demangled \
       --kernel-name "regex:bwd_kernel_sm90" --launch-skip 1 --launch-count 2 -f -o "$R" python lab/device/probe_once.py window
     "$NCU" -i "$R.ncu-rep" --page source --csv --print-source sass > "$R.source.csv" 2>&1
     PATH="$(dirname "$NCU"):$PATH" python lab/tools/ncu_summary.py "$R.ncu-rep" --source-csv "$R.source.csv" > "$R.txt" 2>&1
     tar -C "$O" -czf "$R.tgz" ncu_maskbwd.ncu-rep ncu_maskbwd.source.csv && rm -f "$R.ncu-rep" "$R.source.csv"
     head -60 "$R.txt" ;;
  sanitize_det)  # the sanitizer driver's deterministic mask-mod config (memcheck, racecheck, synccheck), SANITIZE_DRIVER
     D=${SANITIZE_DRIVER:-$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)}
     N=$("$D" --list | grep "deterministic, mask bits per head" | sed -E 's/^\[([0-9]+)\].*/\1/')
     for tool in memcheck racecheck synccheck; do
       step "sanitize_det_$tool" 120 "$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)" --tool $tool --kernel-name kns=flashjax --print-limit 20 "$D" --only "$N"
       grep -E "SUMMARY|FAILED|: ok$" "$O/sanitize_det_$tool.log" | tail -3; done ;;
esac; done
