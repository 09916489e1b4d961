#!/usr/bin/env bash
# Benchmarks several builds of libflashjax.so against cuDNN on the same GPU in one call, so that kernel variants
# are compared on one machine (machine-to-machine spread of the flashjax/cuDNN ratio is ~2-3%: lab/log/v22.md).
#   lab/tools/compare_builds.sh NAME=LIB[.xz][@PYDIR] ...
#   e.g. main=.devcarry/variants/main.so.xz split=.devcarry/variants/split.so.xz
# @PYDIR runs that build with PYDIR (a directory holding a flashjax package) ahead of the checkout's python/, for
# builds whose Python side differs too (e.g. main's tree from `git archive`).
# Each build runs bench.py (cuDNN and flashjax, interleaved trials) in its own process through $FLASHJAX_LIBRARY;
# the builds take turns ROUNDS times (default 1) to spread clock drift over all of them. Knobs: ROWS (bench.py
# --rows regex, default the D 64 / D 128 grid rows), BENCH_ARGS (extra bench.py flags). JSON per build and round
# land in $OUT (or bench/out); a table of flashjax/cuDNN ratios per row and build is printed last.
# SUSTAINED=1 runs bench/sustained.py instead (flashjax alone, SUSTAINED_SECONDS back to back per row, default 3):
# throughput at the board's power limit, with the SM clock; its rounds agree to ~0.5% (lab/log/v11.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
LIBDIR=$(mktemp -d)
names=()
declare -A pydir
for spec in "$@"; do
  name=${spec%%=*}; lib=${spec#*=}
  if [[ $lib == *@* ]]; then pydir[$name]=$(cd "${lib#*@}" && pwd); lib=${lib%@*}; fi
  if [[ $lib == *.xz ]]; then xz -dc "$lib" > "$LIBDIR/$name.so"; else cp "$lib" "$LIBDIR/$name.so"; fi
  names+=("$name")
done
if [[ ${SUSTAINED:-0} == 1 ]]; then
  run=(bench/sustained.py --impls flashjax --rounds 1 --seconds "${SUSTAINED_SECONDS:-3}")
else
  run=(bench/bench.py --dirs fwd --impls cudnn,flashjax ${BENCH_ARGS:-})
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for name in "${names[@]}"; do
    PYTHONPATH="${pydir[$name]:+${pydir[$name]}:}$PYTHONPATH" FLASHJAX_LIBRARY="$LIBDIR/$name.so" \
      $PY "${run[@]}" --rows "${ROWS:-^d(64|128)-}" \
      --json "$OUT/compare_${name}_$round.json" > "$OUT/compare_${name}_$round.log" 2>&1 \
      || { echo "$name round $round: bench failed"; tail -5 "$OUT/compare_${name}_$round.log"; }
  done
done
$PY - "$OUT" "${ROUNDS:-1}" "${names[@]}" <<'EOF'
import json, os, statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
table = {}  # row -> name -> [(flashjax, cudnn, flag)], or [(flashjax, SM MHz, "")] from bench/sustained.py
sustained = False
for name in names:
    # This call's rounds only: a glob would also take files an earlier call left in $OUT, or another build's
    # whose name starts with this one's and an underscore.
    for path in (f"{out}/compare_{name}_{r}.json" for r in range(1, rounds + 1)):
        if not os.path.exists(path):  # its bench run failed (reported above)
            continue
        report = json.load(open(path))
        if isinstance(report, list):  # bench/sustained.py: flashjax alone; the cell's second number is its clock
            sustained = True
            for run in report:
                table.setdefault(run["row"], {}).setdefault(name, []).append((run["tflops"], run["mhz"], ""))
            continue
        for row in report["rows"]:
            res = row["results"].get("fwd", {})
            fj, cd = res.get("flashjax", {}), res.get("cudnn", {})
            if "tflops" in fj and "tflops" in cd:
                flag = " WRONG" if fj.get("wrong") else ""
                table.setdefault(row["row"]["name"], {}).setdefault(name, []).append((fj["tflops"], cd["tflops"], flag))
print("flashjax TFLOP/s (SM MHz), sustained, median over rounds" if sustained else
      "flashjax TFLOP/s (flashjax / cuDNN of the same process), median over rounds")
print(f"{'row':28s}" + "".join(f"{n:>22s}" for n in names))
for row, by_name in table.items():
    cells = []
    for n in names:
        runs = by_name.get(n, [])
        if not runs:
            cells.append(f"{'-':>22s}")
            continue
        fj = statistics.median(r[0] for r in runs)
        if sustained:
            cells.append(f"{fj:9.1f} ({statistics.median(r[1] for r in runs):5.0f}){'':>6s}")
            continue
        ratio = statistics.median(r[0] / r[1] for r in runs)
        cells.append(f"{fj:9.1f} ({ratio:5.3f}){''.join(r[2] for r in runs)[:6]:>6s}")
    print(f"{row:28s}" + "".join(cells))
EOF
