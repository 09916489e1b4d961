#!/usr/bin/env bash
# A/B of kernel variants in one device call (lab/log/v11.md, v12.md): an optional correctness check of each
# variant, then main and the variants in bench.py's trials, at the board's power limit (bench/sustained.py), and
# in cycles and L2 bytes under ncu with the clocks locked at base (per-cycle cost, free of the power limit).
#   VARIANTS="v12b v12c" lab/tools/ab_device.sh
# Builds: $MAIN (default .devcarry/full/libflashjax.so.xz) and .devcarry/variants/NAME.so.xz for each variant (carry
# them); MAIN_PY=DIR runs main with DIR's flashjax package (a variant that changes the Python side as well).
# Knobs, each stage skipped when its rows are empty:
#   CHECK         python script run per variant with FLASHJAX_LIBRARY set (e.g. "lab/tools/bench_set_check.py 20");
#                 it should print one "ok ..." / "FAIL ..." line per case. CHECK_S: its time limit (default 150 s).
#   BENCH_ROWS    bench.py --rows regex (default the D 128 S 4k / 8k causal and S 4k full rows); BENCH_S per run.
#   SUSTAINED_ROWS  sustained.py rows (default d128-s4096-causal); SUSTAINED_S per run.
#   NCU_ROWS      bench.py row names for ncu (default none; ~25 s per build and row); NCU_S per run; NCU_CLOCK
#                 ncu --clock-control (default base). sm__cycles_active min / avg / max against elapsed: the balance.
#   ROUNDS        alternating rounds of the bench and sustained stages (default 2).
# Every step has a time limit: a hung variant must not take the call's whole budget.
set -u
cd "$(dirname "$0")/../.." || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
L=$(mktemp -d)
xz -dc "${MAIN:-.devcarry/full/libflashjax.so.xz}" > "$L/main.so" || exit 1
builds=("main=$L/main.so${MAIN_PY:+@$MAIN_PY}")  # MAIN_PY: main's Python tree too (compare_builds.sh's @PYDIR)
for v in ${VARIANTS:-}; do
  xz -dc ".devcarry/variants/$v.so.xz" > "$L/$v.so" || exit 1
  builds+=("$v=$L/$v.so")
done

if [[ -n ${CHECK:-} ]]; then
  read -ra check <<< "$CHECK"  # the script and its arguments
  for v in ${VARIANTS:-}; do
    FLASHJAX_LIBRARY=$L/$v.so timeout "${CHECK_S:-150}" python3 "${check[@]}" > "$L/check_$v.log" 2>&1
    rc=$?
    echo "== check $v: rc $rc, $(grep -c '^ok' "$L/check_$v.log") ok, $(grep -c '^FAIL' "$L/check_$v.log") failed"
    grep '^FAIL' "$L/check_$v.log" | cut -c1-300
  done
fi

BENCH_ROWS=${BENCH_ROWS-'^d128-s(4096|8192)-causal$|^d128-s4096-full$'}
if [[ -n $BENCH_ROWS ]]; then
  echo "== bench"
  OUT=$(mktemp -d) ROUNDS=${ROUNDS:-2} ROWS=$BENCH_ROWS PYTHON="timeout ${BENCH_S:-120} python3" \
    lab/tools/compare_builds.sh "${builds[@]}" 2>&1 | sed -n '/bench failed/p; /^flashjax TFLOP/,$p'
fi

SUSTAINED_ROWS=${SUSTAINED_ROWS-'^d128-s4096-causal$'}
if [[ -n $SUSTAINED_ROWS ]]; then
  echo "== sustained"
  OUT=$(mktemp -d) SUSTAINED=1 ROUNDS=${ROUNDS:-2} ROWS=$SUSTAINED_ROWS PYTHON="timeout ${SUSTAINED_S:-60} python3" \
    lab/tools/compare_builds.sh "${builds[@]}" 2>&1 | sed -n '/bench failed/p; /^flashjax TFLOP/,$p'
fi

if [[ -n ${NCU_ROWS:-} ]]; then
  echo "== ncu, --clock-control ${NCU_CLOCK:-base}: one launch of the forward kernel"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  metrics=gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_active.avg,sm__cycles_active.min
  metrics+=,sm__cycles_active.max,lts__t_bytes.sum,dram__bytes_read.sum
  for row in $NCU_ROWS; do
    for build in "${builds[@]}"; do
      name=${build%%=*} lib=${build#*=} pydir=""
      if [[ $lib == *@* ]]; then pydir=$(cd "${lib#*@}" && pwd); lib=${lib%@*}; fi
      # Twice at most: on a freshly started machine the first profiles have come back empty (v25).
      for attempt in 1 2; do
        PYTHONPATH="${pydir:+$pydir:}$PYTHONPATH" FLASHJAX_LIBRARY=$lib \
          timeout "${NCU_S:-90}" "$NCU" --clock-control "${NCU_CLOCK:-base}" \
          --metrics "$metrics" --kernel-name regex:fwd_kernel_sm --launch-skip 2 --launch-count 1 --csv --page raw \
          python3 bench/bench.py --rows "^$row\$" --dirs fwd --impls flashjax --trials 1 --reps 3 > "$L/ncu.csv" 2>&1
        [[ $(grep -c '^"' "$L/ncu.csv") -ge 3 ]] && break
        echo "$row $name: no ncu data (attempt $attempt): $(grep -v '^"' "$L/ncu.csv" | grep -iE 'error|==ERR|warn' | head -2 | cut -c1-200)"
      done
      python3 - "$L/ncu.csv" "$row" "$name" "$metrics" <<'EOF'
import csv, sys
path, row, name, metrics = sys.argv[1:]
table = list(csv.reader(line for line in open(path) if line.startswith('"')))
if len(table) < 3:  # header, units, one kernel
    print(f"{row:24s} {name:10s} no ncu data")
else:
    values = dict(zip(table[0], table[-1]))
    print(f"{row:24s} {name:10s}", " ".join(f"{m}={values.get(m, '?')}" for m in metrics.split(",")))
EOF
    done
  done
fi
