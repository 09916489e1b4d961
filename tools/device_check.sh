#!/usr/bin/env bash
# Build-check-test-bench on a GPU machine in one call, a short summary table last.
#   tools/device_check.sh [stage ...]   stages: build info fingerprint newcomer wheel tests tests_capped tests_packed
#                                        tests_split tests80 tests_smem99 tests_jax_newest sanitize bench
#                                        bench_features ncu
#                                        (default: all but build, fingerprint, newcomer, wheel, tests_jax_newest,
#                                        bench_features and ncu)
# The library is expected at python/flashjax/libflashjax.so (built elsewhere with tools/build.sh and carried);
# the "build" stage builds it here instead. Logs and JSON go to $OUT (or bench/out). Environment knobs:
#   FLASHJAX_SWEEP_N (sweep size; CAPPED_SWEEP_N, PACKED_SWEEP_N, SPLIT_SWEEP_N for those stages; SPLIT_PARTS),
#   FLASHJAX_TEST_JOBS (pytest-xdist workers), BENCH_ARGS (extra bench.py flags),
#   SANITIZE_TOOLS (default "memcheck racecheck synccheck"), SANITIZE_MODES (default "default sm80"),
#   SANITIZE_ARGS (flashjax_sanitize flags, e.g. "--only 3"), SANITIZE_DRIVER (the driver binary; default: the one
#   the build stage made, else one built in the newcomer stage's build), SANITIZE_PARALLEL=1 (the tools at once),
#   WHEEL_FILE (a wheel built elsewhere for the wheel stage to install instead of building one) and WHEEL_TESTS (an
#   archive of the tests/gpu of that wheel's commit), SANITIZE_TIMEOUT (seconds per sanitizer run, default 300), NCU_IMPL / NCU_KERNEL / NCU_DIRS
#   (the bench.py implementation, kernel-name regex and directions the ncu stage profiles; default flashjax's
#   forward; e.g. NCU_KERNEL=bwd_kernel_sm90 NCU_DIRS=bwd for the sm90 backward).
# Peers for bench.py that the machine lacks (e.g. flash_attn3_jax and einops, for --impls fa3) travel as wheels in
# .devcarry/peers; they are unpacked into a temporary folder on PYTHONPATH (no network there: no pip resolution).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PEERS=""
if compgen -G ".devcarry/peers/*.whl" > /dev/null; then
  PEERS=$(mktemp -d)
  for wheel in .devcarry/peers/*.whl; do ${PYTHON:-python3} -m zipfile -e "$wheel" "$PEERS"; done
fi
export PYTHONPATH="$PWD/python:$PWD/tests/gpu${PEERS:+:$PEERS}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
STAGES=${*:-info tests tests_capped tests_packed tests_split tests80 tests_smem99 sanitize bench}
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
      -DFLASHJAX_BUILD_SANITIZE_DRIVER=ON \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" &&
    ninja -C "$BUILD" -j "$(nproc)" && cp "$BUILD/libflashjax.so" python/flashjax/ && cp "$BUILD/libflashjax.so" "$OUT/"
  } > "$OUT/build.log" 2>&1 && record build ok || { record build FAILED; grep -E "error|Error" "$OUT/build.log" | head -30; }
fi
if stage info; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
  $PY -m flashjax 2>&1 > "$OUT/info.log" 2>&1 && head -60 "$OUT/info.log" && record info ok || record info FAILED
fi
if stage fingerprint; then
  # Whether the D 128 forward kept its recorded hot loop (lab/hot_loop_fingerprint.txt; its register allocation is
  # worth 1.3-3% of that kernel's cycles and moves with any kernel edit): a note for the summary, never a failure.
  LIB=$(ls -t build/device-*/libflashjax.so python/flashjax/libflashjax.so 2>/dev/null | head -1)
  $PY lab/tools/hot_loop_diff.py "$LIB" --fingerprint --expect lab/hot_loop_fingerprint.txt > "$OUT/fingerprint.log" 2>&1
  record fingerprint "rc $?: $(tail -1 "$OUT/fingerprint.log" | cut -c1-160)"
fi
# Modes: "default" lets dispatch pick (on Hopper: the sm90 families where they have the head dim); "sm80" disables them
# so the portable family runs everywhere.
disabled_for() { [ "$1" = sm80 ] && echo sm90 || true; }

run_gpu_tests() {  # $1: mode, $2: tag for the log and summary (default: the mode), then extra pytest arguments
  local mode=$1 tag=${2:-$1}
  shift $(( $# < 2 ? $# : 2 ))
  FLASHJAX_DISABLE_FAMILIES="$(disabled_for "$mode")" timeout "${TEST_TIMEOUT:-1800}" $PY -m pytest -q -n "${FLASHJAX_TEST_JOBS:-8}" tests/gpu -p no:cacheprovider \
    -rf --durations=8 ${PYTEST_ARGS:-} "$@" > "$OUT/gpu_tests_$tag.log" 2>&1
  local rc=$?
  grep -E "^FAILED|s call " "$OUT/gpu_tests_$tag.log" | cut -c1-400 | head -20
  record "tests_$tag" "$(tail -1 "$OUT/gpu_tests_$tag.log") (rc $rc)"
}
if stage tests; then run_gpu_tests default; fi
if stage tests_capped; then
  # The sm90 forward with its persistent grid capped at CAPPED_CTAS (default 3) CTAs, so that every CTA runs many
  # tiles (the carry-over from one tile to the next, empty tiles between tiles with work) even on the sweep's
  # small problems. The same cap applies to the sanitize stage when FLASHJAX_SM90_MAX_CTAS is set for it.
  FLASHJAX_SM90_MAX_CTAS=${CAPPED_CTAS:-3} FLASHJAX_SWEEP_N=${CAPPED_SWEEP_N:-40} \
    run_gpu_tests default capped -k "sweep or tile or several or past_the_last_row"
fi
if stage tests_packed; then
  # Every GQA call of the sweep through the sm90 forward's packed-GQA tiles (FLASHJAX_SM90_PACK_GQA=1), also where
  # the rule would not pack (long sequences, 192-row tiles, planned tails); the default stage packs only short ones.
  FLASHJAX_SM90_PACK_GQA=1 FLASHJAX_SWEEP_N=${PACKED_SWEEP_N:-60} \
    run_gpu_tests default packed -k "sweep or tile or several or past_the_last_row or packed_gqa"
fi
if stage tests_split; then
  # Every uncapped sm90 forward of the sweep with its keys split into SPLIT_PARTS parts (FLASHJAX_SM90_SPLIT_KV; the
  # split kernel packs every GQA call), also where the rule would not split: long sequences, windows, empty rows.
  FLASHJAX_SM90_SPLIT_KV=${SPLIT_PARTS:-5} FLASHJAX_SWEEP_N=${SPLIT_SWEEP_N:-60} \
    run_gpu_tests default split -k "sweep or tile or several or past_the_last_row or split_keys"
fi
if stage tests80; then run_gpu_tests sm80; fi
# The portable family as a 99 KB part (RTX 4090, L40, RTX 5090) runs it: dispatch assumes 99 KB per block
# (FLASHJAX_SMEM_LIMIT_KB), so the sm80 rows with smaller tiles run wherever the 163 KB ones do not fit.
if stage tests_smem99; then FLASHJAX_SMEM_LIMIT_KB=99 run_gpu_tests sm80 smem99; fi
if stage sanitize; then
  # compute-sanitizer runs tests/sanitize's flashjax_sanitize (built by the build stage): our kernels launched from
  # C++ on short ragged configs, forward then backward, with no Python or XLA in the process (racecheck on a JAX
  # process crashed the tool itself, rc 139). Each tool runs once per mode: "default" is the sm90 forward on
  # Hopper, "sm80" the portable one; the sm80 backward runs in both. Only kernels named flashjax* are checked.
  DRIVER=${SANITIZE_DRIVER:-build/device-${FLASHJAX_CUDA_ARCHS:-90a-real}/tests/sanitize/flashjax_sanitize}
  [ -x "$DRIVER" ] || DRIVER=$(ls -t build/*/tests/sanitize/flashjax_sanitize 2>/dev/null | head -1)
  NEWCOMER_BUILD=$(cat /tmp/flashjax_newcomer_build 2>/dev/null)
  if [ ! -x "$DRIVER" ] && [ -d "$NEWCOMER_BUILD" ]; then  # the newcomer's kernels, with the driver linked to them
    { cmake "$NEWCOMER_BUILD" -DFLASHJAX_BUILD_SANITIZE_DRIVER=ON && ninja -C "$NEWCOMER_BUILD" flashjax_sanitize
    } > "$OUT/sanitize_build.log" 2>&1
    DRIVER=$NEWCOMER_BUILD/tests/sanitize/flashjax_sanitize
  fi
  SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -z "$DRIVER" ] || [ ! -x "$DRIVER" ]; then
    record sanitize "FAILED: no flashjax_sanitize binary (run the build stage, or set SANITIZE_DRIVER)"
  else
    echo "sanitize: $DRIVER"
    sanitize_run() {  # $1 tool, $2 mode: the log and its rc file
      FLASHJAX_DISABLE_FAMILIES="$(disabled_for $2)" timeout "${SANITIZE_TIMEOUT:-300}" \
        "$SANITIZER" --tool "$1" --kernel-name kns=flashjax --print-limit 20 \
        "$DRIVER" ${SANITIZE_ARGS:-} > "$OUT/${1}_$2.log" 2>&1
      echo $? > "$OUT/${1}_$2.rc"
    }
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      for mode in ${SANITIZE_MODES:-default sm80}; do
        if [ "${SANITIZE_PARALLEL:-0}" = 1 ]; then sanitize_run "$tool" "$mode" & else sanitize_run "$tool" "$mode"; fi
      done
    done
    wait
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      for mode in ${SANITIZE_MODES:-default sm80}; do
        log="$OUT/${tool}_$mode.log"
        rc=$(cat "$OUT/${tool}_$mode.rc"); rm -f "$OUT/${tool}_$mode.rc"
        summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
        record "${tool}_$mode" "${summary:-no summary} (rc $rc, $(grep -c ': ok$' "$log") configs ok)"
        [ "$rc" -eq 0 ] || { grep -E "FAILED" "$log" | head -5; tail -5 "$log"; }
      done
    done
  fi
  # The JAX path under memcheck once more (default mode only): the same kernels, reached through the FFI handlers
  # with XLA's buffers (tests/gpu/sanitize.py). It adds little over the driver (same layouts and workspace sizes)
  # but is the one check of the handlers' buffer plumbing under the sanitizer; SANITIZE_JAX=0 skips it.
  if [ "${SANITIZE_JAX:-1}" != 0 ]; then
    timeout "${SANITIZE_TIMEOUT:-300}" "$SANITIZER" --tool memcheck --kernel-name kns=flashjax --print-limit 20 \
      $PY tests/gpu/sanitize.py > "$OUT/memcheck_jax.log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY" "$OUT/memcheck_jax.log" | tail -1 | sed 's/^=* *//')
    record memcheck_jax "${summary:-no summary} (rc $rc, $(grep -c ': ok$' "$OUT/memcheck_jax.log") configs ok)"
    [ $rc -eq 0 ] || tail -5 "$OUT/memcheck_jax.log"
  fi
fi
# The install as a newcomer meets it, on this machine, which has no network: a copy of the tree without build
# outputs, the README's two commands with a venv over python3's packages (jax and its CUDA plugin are there) and the
# wheels it lacks from WHEELHOUSE (default .devcarry/wheelhouse: nvidia-cutlass; auditwheel and pyelftools for the
# wheel stage, whose glibc 2.28 link directory, made where there is network, is GLIBC228_DIR, default
# .devcarry/glibc228).
WHEELHOUSE=$(realpath -m "${WHEELHOUSE:-.devcarry/wheelhouse}")
fresh_copy() {  # a copy of the tree as a clone would have it (no builds, venvs or carried files), printed path
  local dir; dir=$(mktemp -d)/flashjax; mkdir -p "$dir"
  tar --exclude=./build --exclude='./.venv*' --exclude=./.devcarry --exclude='*.so' --exclude=./bench/out -cf - . |
    tar -xf - -C "$dir"
  echo "$dir"
}
if stage newcomer; then
  NEWCOMER=$(fresh_copy)
  (cd "$NEWCOMER" && env -u PYTHONPATH FLASHJAX_SYSTEM_SITE_PACKAGES=1 FLASHJAX_WHEELHOUSE="$WHEELHOUSE" \
     tools/demo.sh) > "$OUT/newcomer_demo.log" 2>&1
  record newcomer_demo "rc $?"
  grep -E "error|TFLOP|cuDNN|kernel" "$OUT/newcomer_demo.log" | head -20
  (cd "$NEWCOMER" && env -u PYTHONPATH FLASHJAX_SYSTEM_SITE_PACKAGES=1 FLASHJAX_WHEELHOUSE="$WHEELHOUSE" \
     timeout "${TEST_TIMEOUT:-1800}" tools/test.sh -p no:cacheprovider) > "$OUT/newcomer_tests.log" 2>&1
  rc=$?
  # Later stages (tests_jax_newest) test the library the newcomer built; sanitize can link its driver to its kernels.
  [ -f "$NEWCOMER/python/flashjax/libflashjax.so" ] && cp "$NEWCOMER/python/flashjax/libflashjax.so" python/flashjax/
  [ -f "$NEWCOMER/build/last" ] && echo "$NEWCOMER/$(cat "$NEWCOMER/build/last")" > /tmp/flashjax_newcomer_build
  record newcomer_tests "$(grep -E '^[0-9]+ (passed|failed)|tests passed' "$OUT/newcomer_tests.log" | tr '\n' ' ')(rc $rc)"
fi
# The release wheel (tools/wheel.sh: every kernel, the release architectures), its size by architecture, then the
# wheel installed with --no-index in a fresh venv over python3's jax and the GPU tests run against it from outside
# the checkout. WHEEL_ARCHS overrides the architectures (e.g. "90a-real" for a quicker check of the install alone).
if stage wheel && [ -n "${WHEEL_FILE:-}" ]; then
  mkdir -p "$OUT/dist" && cp "$WHEEL_FILE" "$OUT/dist/" && record wheel "carried: $(basename "$WHEEL_FILE")"
  (cd "$(mktemp -d)" && python3 -m zipfile -e "$WHEEL_FILE" . && command -v cuobjdump >/dev/null &&
     for kind in sm_80 sm_90 sm_100 sm_120; do
       echo "$kind: $(cuobjdump --list-elf flashjax/libflashjax.so | grep -c "\.$kind") cubins"
     done; cuobjdump --list-ptx flashjax/libflashjax.so | sed 's/.*\.\(sm_[0-9a-z]*\)\.ptx/PTX \1/' | sort | uniq -c
  ) | tee "$OUT/wheel_sizes.txt"
elif stage wheel; then
  WHEEL_SRC=$(fresh_copy)
  GLIBC228_DIR=$(realpath -m "${GLIBC228_DIR:-.devcarry/glibc228}")
  (cd "$WHEEL_SRC" && env -u PYTHONPATH FLASHJAX_SYSTEM_SITE_PACKAGES=1 FLASHJAX_WHEELHOUSE="$WHEELHOUSE" \
     FLASHJAX_CUDA_ARCHS="${WHEEL_ARCHS:-release}" FLASHJAX_WHEEL_BUILD_DIR=build/wheel \
     FLASHJAX_GLIBC228_DIR="$GLIBC228_DIR" tools/wheel.sh "$OUT/dist") \
    > "$OUT/wheel.log" 2>&1
  record wheel "rc $?, $(grep -o 'flashjax_cu.*MB)' "$OUT/wheel.log")"
  LIB=$WHEEL_SRC/build/wheel/libflashjax.so
  if [ -f "$LIB" ] && command -v cuobjdump >/dev/null; then
    # Machine code and PTX by architecture: what the wheel's size is made of.
    (cd "$(mktemp -d)" && cuobjdump -xelf all "$LIB" >/dev/null 2>&1; cuobjdump -xptx all "$LIB" >/dev/null 2>&1
     for kind in sm_80 sm_90a sm_100 sm_120 ptx; do
       files=$(ls | grep -E "\.${kind#ptx}" 2>/dev/null); [ $kind = ptx ] && files=$(ls *.ptx 2>/dev/null)
       [ -n "$files" ] && echo "$kind: $(cat $files | wc -c | awk '{printf "%.1f MB", $1/1e6}') uncompressed in $(wc -w <<<"$files") files"
     done) | tee "$OUT/wheel_sizes.txt"
  fi
  WHEEL_FILE=$(ls "$OUT"/dist/*.whl 2>/dev/null | head -1)
fi
if stage wheel; then
  WV=$(mktemp -d)/venv  # a venv over python3's packages, made as the README's commands make theirs
  if [ -n "$WHEEL_FILE" ] && ! env -u PYTHONPATH FLASHJAX_VENV="$WV" FLASHJAX_SYSTEM_SITE_PACKAGES=1 \
       FLASHJAX_WHEELHOUSE="$WHEELHOUSE" tools/env.sh > "$OUT/wheel_venv.log" 2>&1; then
    record wheel_install "FAILED: tools/env.sh (wheel_venv.log)"
  elif [ -n "$WHEEL_FILE" ]; then
    # With its dependencies resolved offline against python3's packages; where pip cannot (jax[cuda13]'s extras
    # pin CUDA wheels this machine may hold in other versions), without them, and the log says which.
    if "$WV/bin/python" -m pip install --no-index --find-links "$WHEELHOUSE" "$WHEEL_FILE" > "$OUT/wheel_install.log" 2>&1; then
      record wheel_install "ok, dependencies resolved offline"
    else
      "$WV/bin/python" -m pip install -q --no-index --no-deps "$WHEEL_FILE" >> "$OUT/wheel_install.log" 2>&1
      record wheel_install "rc $? with --no-deps; with deps: $(grep -m1 -E 'ERROR' "$OUT/wheel_install.log" | cut -c1-160)"
    fi
    TESTS=$(mktemp -d)
    if [ -n "${WHEEL_TESTS:-}" ]; then tar -xzf "$WHEEL_TESTS" -C "$TESTS" --strip-components=1; else cp -r tests/gpu "$TESTS/gpu"; fi
    (cd "$TESTS" && env -u PYTHONPATH -u FLASHJAX_LIBRARY "$WV/bin/python" -m flashjax) > "$OUT/wheel_info.log" 2>&1
    grep -E "^library|CUDA" "$OUT/wheel_info.log"
    (cd "$TESTS" && env -u PYTHONPATH -u FLASHJAX_LIBRARY timeout "${TEST_TIMEOUT:-1800}" "$WV/bin/python" -m pytest -q \
       -n "${FLASHJAX_TEST_JOBS:-8}" -p no:cacheprovider gpu) > "$OUT/wheel_tests.log" 2>&1
    rc=$?
    record wheel_tests "$(tail -1 "$OUT/wheel_tests.log") (rc $rc)"
    rm -f "$OUT"/dist/*.whl  # over the size the device tool returns
  fi
fi
# The GPU tests under another jax than the machine's (the newest of pyproject.toml's range), unpacked from an
# xz'd tar of its wheels' contents (jax, jaxlib, the CUDA plugin and PJRT) that travels split into parts:
# JAX_NEWEST_PARTS (default .devcarry/j12*/part, concatenated in name order).
if stage tests_jax_newest; then
  SITE=$(mktemp -d)
  cat ${JAX_NEWEST_PARTS:-.devcarry/j12*/part} | xz -dc | tar -xf - -C "$SITE"
  version=$(PYTHONPATH="$SITE" $PY -c 'import jax; print(jax.__version__, jax.default_backend())' 2>&1 | tail -1)
  echo "jax under test: $version"
  PYTHONPATH="$SITE:$PYTHONPATH" run_gpu_tests default jax_newest
  RESULT[tests_jax_newest]="jax $version: ${RESULT[tests_jax_newest]}"
fi
if stage bench; then
  for mode in default sm80; do
    FLASHJAX_DISABLE_FAMILIES="$(disabled_for $mode)" $PY bench/bench.py ${BENCH_ARGS:---quick --impls cudnn,flashjax} \
      --json "$OUT/bench_$mode.json" > "$OUT/bench_$mode.log" 2>&1
    record "bench_$mode" "rc $?"
  done
fi

if stage bench_features; then
  # The open issues' feature rows, default mode: varlen against the dense call and cuDNN padded (issue 37), jvp
  # against the forward (issue 39), mask mods against varlen and the native band (issue 38). Each bounded by
  # FEATURE_TIMEOUT seconds (default 240).
  timeout "${FEATURE_TIMEOUT:-240}" $PY bench/varlen.py > "$OUT/bench_varlen.log" 2>&1
  record bench_varlen "rc $?: $(grep -cE 'cost|speedup|of copy' "$OUT/bench_varlen.log") rows"
  timeout "${FEATURE_TIMEOUT:-240}" $PY bench/bench.py --impls flashjax --dirs fwd,jvp \
    --rows "${JVP_ROWS:-^d(64|128|256)-s4096-(causal|full)\$}" --json "$OUT/bench_jvp.json" > "$OUT/bench_jvp.log" 2>&1
  record bench_jvp "rc $?"
  timeout "${FEATURE_TIMEOUT:-240}" $PY lab/device/mask_kernels_bench.py --cases "${MASK_CASES:-docs4k,prefix,window}" \
    > "$OUT/bench_mask.log" 2>&1
  record bench_mask "rc $?"
fi

if stage ncu; then
  # Nsight Compute on one launch of flashjax's forward kernel per spec "mode:row" (mode as for the tests; row a
  # bench.py row name), e.g. NCU_SPECS="default:d128-s4096-full sm80:d64-s512-causal". Full section set; the
  # details page, lab/tools/ncu_summary.py's stall summary and lab/tools/ncu_regions.py's time by kernel stage land in
  # $OUT/ncu_*.txt, the report and the per-SASS-line source page in $OUT/ncu_*.tgz. The clocks are left as found
  # (--clock-control none, METHOD.md);
  # NCU_CLOCK_CONTROL=base locks them at base as ncu does by default (cycle counts of earlier notes were taken so).
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for spec in ${NCU_SPECS:-default:d128-s4096-full}; do
    mode=${spec%%:*}; row=${spec#*:}; tag="ncu_${NCU_IMPL:-flashjax}_${mode}_${row//[^A-Za-z0-9]/_}"
    FLASHJAX_DISABLE_FAMILIES="$(disabled_for "$mode")" timeout "${NCU_TIMEOUT:-300}" "$NCU" --set full \
      --clock-control "${NCU_CLOCK_CONTROL:-none}" --import-source no --kernel-name-base demangled \
      --kernel-name "regex:${NCU_KERNEL:-fwd_kernel_sm}" \
      --launch-skip 2 --launch-count 1 -f -o "$OUT/$tag" \
      $PY bench/bench.py --rows "^$row\$" --dirs "${NCU_DIRS:-fwd}" --impls "${NCU_IMPL:-flashjax}" --trials 1 --reps 3 > "$OUT/$tag.log" 2>&1
    rc=$?
    "$NCU" -i "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/$tag.source.csv" 2>&1
    { "$NCU" -i "$OUT/$tag.ncu-rep" --page details
      PATH="$(dirname "$NCU"):$PATH" $PY lab/tools/ncu_summary.py "$OUT/$tag.ncu-rep" \
        --source-csv "$OUT/$tag.source.csv"
      echo "== time by stage (lab/tools/ncu_regions.py)"
      $PY lab/tools/ncu_regions.py "$OUT/$tag.source.csv"  # the sm90 forward's stages; says so where it finds none
    } > "$OUT/$tag.txt" 2>&1
    # The device tool returns at most 8 files: one archive per spec.
    tar -C "$OUT" -czf "$OUT/$tag.tgz" "$tag.ncu-rep" "$tag.source.csv" "$tag.log" && rm -f "$OUT/$tag.ncu-rep" "$OUT/$tag.source.csv" "$OUT/$tag.log"
    record "$tag" "rc $rc, $(grep -E '^ +Duration' "$OUT/$tag.txt" | head -1 | tr -s ' ')"
  done
fi

echo
echo "================ summary ================"
for key in build info fingerprint newcomer_demo newcomer_tests wheel wheel_install wheel_tests tests_jax_newest tests_default tests_capped tests_packed tests_split tests_sm80 tests_smem99 sanitize memcheck_default memcheck_sm80 \
           racecheck_default racecheck_sm80 synccheck_default synccheck_sm80 memcheck_jax bench_default bench_sm80 \
           bench_varlen bench_jvp bench_mask \
           $(printf '%s\n' "${!RESULT[@]}" | grep '^ncu_' | sort); do
  [ -n "${RESULT[$key]:-}" ] && printf '%-17s %s\n' "$key" "${RESULT[$key]}"
done
if stage bench_features; then
  echo "---- varlen (cost <= 1.1, speedup over cuDNN padded > 1.63, of copy >= 0.9) ----"
  grep -E "cost|speedup|of copy" "$OUT/bench_varlen.log" | cut -c1-150
  echo "---- jvp (jvp / fwd time = 3.5 x fwd rate / jvp rate; bar 3) ----"
  grep -E "^(row|d[0-9])" "$OUT/bench_jvp.log" | cut -c1-150
  echo "---- mask mods (fwd / base, bwd / base) ----"
  grep -E "^===|/ base|^[a-z].* [0-9]+\.[0-9]+ +[0-9]+\.[0-9]+ " "$OUT/bench_mask.log" | cut -c1-150
fi
for mode in default sm80; do
  if stage bench && [ -f "$OUT/bench_$mode.log" ]; then
    echo "---- bench, forward family: $mode ----"
    grep -E "^(row|d[0-9]|gqa|swa|decode)" "$OUT/bench_$mode.log"
  fi
done
