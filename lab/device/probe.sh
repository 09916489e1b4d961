#!/usr/bin/env bash
# Profiles for issue 37's pack64 forward row and issue 38's document-mask forward and sliding-window forward and
# backward: Nsight Compute durations and memory / occupancy metrics of every kernel the calls launch
# (lab/device/probe_once.py), summarized as text.
#   lab/device/probe.sh [varlen] [bits] [maskfwd] [window]   (on a GPU, after tools/device_check.sh build)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python:$PWD/tests/gpu" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
METRICS=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,launch__registers_per_thread,launch__grid_size,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active
for what in ${*:-varlen bits maskfwd}; do
  timeout 240 "$NCU" --clock-control none --metrics "$METRICS" --kernel-name "regex:${NCU_KERNELS:-fwd_kernel|bwd_|mask_}" --csv --print-units base \
    $PY lab/device/probe_once.py "$what" > "$OUT/probe_$what.csv" 2> "$OUT/probe_$what.err"
  echo "== $what rc $?"
  $PY - "$OUT/probe_$what.csv" <<'PYEOF'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
ix = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
by = collections.OrderedDict()
for r in body:
    by.setdefault((r[ix["ID"]], r[ix["Kernel Name"]][:90]), {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for (i, name), m in by.items():
    print(f"-- launch {i}: {name}")
    print("   " + "  ".join(f"{k.split('__')[-1][:40]}={v}" for k, v in sorted(m.items())))
PYEOF
done
