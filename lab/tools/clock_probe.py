"""Cycles per kernel in back-to-back calls: the SM clock nvidia-smi reports, times the time per kernel (diagnostic).

    python lab/tools/clock_probe.py [--row d128-s4096-causal] [--impls flashjax,cudnn] [--seconds 2] [--bursts 10]

ncu times one launch in isolation: at any clock from 1.33 to 1.64 GHz the D 128 forward takes the same cycles
(lab/log/v23.md). This asks whether back-to-back calls, as bench.py and a training step make them, take those
cycles too, at the clock the board reports. For each implementation and bench.py row it runs:
  - sustained: calls back to back for --seconds (as bench/sustained.py);
  - bursts: --bursts runs of ~20 ms (one bench.py trial) after 0.5 s idle, the clock sampled within them only;
  - each of the two also with the call chained twice in one jitted function (out = attn(attn(q, k, v), k, v)): one
    XLA execution per two kernels, so a gap between executions shows as a longer time per kernel when unchained.
nvidia-smi samples the SM clock every 5 ms; cycles per kernel = time per kernel x the median sampled clock.
"""
import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench  # noqa: E402  (bench/ is not a package)


class ClockSampler:
    """nvidia-smi's SM clock every `ms` milliseconds, with the wall time of each sample."""

    def __init__(self, ms=5):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", str(ms)], stdout=subprocess.PIPE, text=True)

    def stop(self):
        """[(unix time, MHz, W)]; lines nvidia-smi could not fill are skipped."""
        self.proc.terminate()
        samples = []
        for line in self.proc.communicate()[0].splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((when, float(fields[1]), float(fields[2])))
            except (IndexError, ValueError):
                continue
        return samples


def sustained(fn, calls, seconds):
    """(seconds per call, [(start, end)] window) of back-to-back calls synced every ~0.2 s."""
    reps = bench.calibrate_reps(fn, calls, min_reps=len(calls), min_trial_s=0.2)
    start, n = time.time(), 0
    while time.time() - start < seconds:
        bench.trial_seconds(fn, calls, reps)
        n += reps
    end = time.time()
    # The first half second is the clock settling under the power cap; keep the rest.
    return (end - start) / n, [(start + 0.5, end)]


def bursts(fn, calls, count):
    """(seconds per call, windows) of `count` ~20 ms bursts, each after 0.5 s idle (bench.py's trial length)."""
    reps = bench.calibrate_reps(fn, calls, min_reps=len(calls), min_trial_s=0.02)
    windows, total = [], 0.0
    for _ in range(count):
        time.sleep(0.5)
        start = time.time()
        bench.trial_seconds(fn, calls, reps)
        end = time.time()
        windows.append((start, end))
        total += end - start
    return total / (reps * count), windows


def clock_in(samples, windows):
    inside = [mhz for when, mhz, _ in samples if any(a <= when <= b for a, b in windows)]
    watts = [w for when, _, w in samples if any(a <= when <= b for a, b in windows)]
    return (statistics.median(inside) if inside else float("nan"),
            statistics.median(watts) if watts else float("nan"), len(inside))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="d128-s4096-causal", help="a bench.py row name")
    p.add_argument("--impls", default="flashjax,cudnn")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--bursts", type=int, default=10)
    args = p.parse_args(argv)
    rows = bench.select_rows(bench.parse_args(["--rows", f"^{args.row}$"]))
    if not rows:
        raise SystemExit(f"no bench.py row named {args.row!r}")
    row = rows[0]
    calls = [s[:3] for s in bench.make_inputs(row, 3, seed=0)]
    print(f"{'impl':<9} {'regime':<10} {'chain':>5} {'us/kernel':>10} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} "
          f"{'samples':>7} {'Mcycles/kernel':>14}")
    for impl in args.impls.split(","):
        attn = bench.attention_fn(impl, row, "auto")
        for chain in (1, 2):
            fn = jax.jit(attn) if chain == 1 else jax.jit(lambda q, k, v: attn(attn(q, k, v), k, v))
            bench.trial_seconds(fn, calls, len(calls))  # compile and warm up
            for regime in ("sustained", "bursts"):
                sampler = ClockSampler()
                time.sleep(0.2)
                if regime == "sustained":
                    per_call, windows = sustained(fn, calls, args.seconds)
                else:
                    per_call, windows = bursts(fn, calls, args.bursts)
                mhz, watts, n = clock_in(sampler.stop(), windows)
                per_kernel = per_call / chain
                tflops = row.flops("fwd") / per_kernel / 1e12
                print(f"{impl:<9} {regime:<10} {chain:>5} {per_kernel * 1e6:10.1f} {tflops:8.1f} {mhz:6.0f} "
                      f"{watts:5.0f} {n:7d} {per_kernel * mhz:14.3f}", flush=True)


if __name__ == "__main__":
    main()
