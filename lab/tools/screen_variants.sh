#!/usr/bin/env bash
# Screens many codegen variants in one device call (lab/log/v25.md): each variant's cycles on one row under ncu
# (clocks locked at base), then the TOP fastest against main on a second ncu row and in bench.py's trials.
# For register-allocation samples of one source (lab/tools/codegen_variant.sh), whose differences are 1-3% (v22).
#   VARIANTS="a b c" lab/tools/screen_variants.sh
# Knobs: MAIN (default .devcarry/main/libflashjax.so.xz), SCREEN_ROW (default d128-s4096-causal), SCREEN_METRIC (the
# ncu metric ranked, default sm__cycles_active.avg; sm__cycles_elapsed.max for a change of balance), CONFIRM_ROW
# (default d128-s4096-full), TOP (default 2), BENCH_ROWS / ROUNDS for the bench stage (lab/tools/ab_device.sh's),
# CHECK / CHECK_S: a correctness check of the TOP variants only (as lab/tools/ab_device.sh's).
set -u
cd "$(dirname "$0")/../.." || exit 1
MAIN=${MAIN:-.devcarry/main/libflashjax.so.xz}
SCREEN_ROW=${SCREEN_ROW:-d128-s4096-causal}
METRIC=${SCREEN_METRIC:-sm__cycles_active.avg}
log=$(mktemp)
echo "== screen: ncu $METRIC on $SCREEN_ROW"
MAIN=$MAIN VARIANTS="${VARIANTS:-}" CHECK='' BENCH_ROWS='' SUSTAINED_ROWS='' NCU_ROWS=$SCREEN_ROW NCU_CLOCK=base \
  lab/tools/ab_device.sh | tee "$log"
cycles() { sed -nE "s/^$SCREEN_ROW +$1 .*${METRIC//./\\.}=([0-9.,]+).*/\1/p" "$log" | tr -d , | head -1; }
base=$(cycles main)
ranked=$(for v in ${VARIANTS:-}; do c=$(cycles "$v"); [[ -n $c ]] && echo "$c $v"; done | sort -n)
echo "== ranked (cycles, % against main's ${base:-(no data)})"
awk -v b="$base" '{ if (b > 0) printf "%-12s %12.0f %+6.2f%%\n", $2, $1, ($1 / b - 1) * 100;
                    else printf "%-12s %12.0f\n", $2, $1 }' <<< "$ranked"
top=$(head -n "${TOP:-2}" <<< "$ranked" | awk '{print $2}' | tr '\n' ' ')
[[ -n $top ]] || exit 0
echo "== confirm: $top"
MAIN=$MAIN VARIANTS="$top" SUSTAINED_ROWS='' NCU_ROWS="${CONFIRM_ROW-d128-s4096-full}" NCU_CLOCK=base \
  BENCH_ROWS="${BENCH_ROWS-^d128-s4096-(causal|full)$}" ROUNDS=${ROUNDS:-2} lab/tools/ab_device.sh
