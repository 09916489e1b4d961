"""Sustained forward throughput under the GPU's power limit, with the SM clock and board power it ran at.

    python bench/sustained.py --rows 'd128-s4096-causal|d128-s16384-full' --impls cudnn,flashjax --seconds 4

bench.py times short interleaved trials, during which the H200 starts near its top clock and its software power
cap engages only part of the time. Here each (row, implementation) runs back to back for --seconds while
nvidia-smi samples the SM clock, the board power and the clock-limit reasons every 50 ms, so the number is the
steady state of a long job: what the kernel does per joule, not per cycle (docs/performance.md). The MHz column is
the clock nvidia-smi reports; the SMs run slower under these kernels (measured on the H200: ~1.40 GHz effective for
the D 128 forward where it reports 1530, lab/tools/clock_probe.py). Implementations take turns --rounds times. Rows
and implementations are bench.py's.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (bench/ is not a package)

SMI_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


def run_sustained(fn, calls, seconds):
    """(calls per second, nvidia-smi samples [(MHz, W, reasons)]) over `seconds` of back-to-back calls."""
    # Enough calls between host syncs (~0.2 s) that the GPU never waits for the host.
    reps = bench.calibrate_reps(fn, calls, min_reps=len(calls), min_trial_s=0.2)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for r in range(reps):
            out = fn(*calls[r % len(calls)])
        n += reps
        jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()[2:-1]  # the first and last samples straddle the run
    return n / elapsed, parse_samples(lines)


def parse_samples(lines):
    """nvidia-smi CSV lines of SMI_FIELDS -> [(SM MHz, board W, clock-limit reasons)]; lines it could not measure
    ("[N/A]", a cut-off last line) are skipped."""
    samples = []
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1]), fields[2]))
        except (IndexError, ValueError):
            continue
    return samples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="^d128-s4096-causal$", help="regex over bench.py's row names")
    p.add_argument("--impls", default="cudnn,flashjax")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="also write the runs here: [{row, impl, tflops, mhz, watts, reasons}]")
    args = p.parse_args(argv)
    records = []
    rows = bench.select_rows(bench.parse_args(["--rows", args.rows]))  # of bench.py's default grid
    impls = args.impls.split(",")
    print(f"{'row':<28} {'impl':<9} {'TFLOP/s':>8} {'MHz':>6} {'W':>5}  clock-limit reasons")
    for row in rows:
        sets = bench.make_inputs(row, 2, seed=0)
        fns = {}
        for impl in impls:
            try:
                fns[impl] = bench.prepare_direction(bench.attention_fn(impl, row, "auto"), "fwd", sets)[:2]
            except Exception as err:  # a peer without this row (FA3's wheel: D <= 128), as bench.py records it
                print(f"{row.name:<28} {impl:<9} n/a: {bench.failure_reason(err)}", flush=True)
        for _ in range(args.rounds):
            for impl, (fn, calls) in fns.items():
                rate, samples = run_sustained(fn, calls, args.seconds)
                if not samples:
                    raise SystemExit("nvidia-smi gave no samples: run longer (--seconds)")
                mhz = statistics.median(s[0] for s in samples)
                watts = statistics.median(s[1] for s in samples)
                reasons = sorted({s[2] for s in samples})
                tflops = rate * row.flops("fwd") / 1e12
                print(f"{row.name:<28} {impl:<9} {tflops:8.1f} {mhz:6.0f} {watts:5.0f}  {' '.join(reasons)}",
                      flush=True)
                records.append(dict(row=row.name, impl=impl, tflops=tflops, mhz=mhz, watts=watts, reasons=reasons))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
