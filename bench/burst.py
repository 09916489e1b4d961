"""Forward throughput in short bursts from an idle GPU: the clock regime of published one-shot numbers.

    python bench/burst.py --rows '^d128-s4096-(full|causal)$' --impls cudnn,fa3,flashjax

bench.py's trials (>= 20 ms each, back to back, implementations interleaved) keep the H200 at its software power
cap for most of a row, and bench/sustained.py holds it there for seconds. Harnesses that time a few milliseconds of
calls at a time run mostly before the cap engages (100-300 ms into a load on the H200), and read every
implementation higher. (Not at the top clock, though: the SMs slow within a fraction of a millisecond under these
kernels, while nvidia-smi still shows 1980 MHz. The D 128 forward runs at ~1.6 GHz in such bursts:
docs/performance.md.)
docs/design.md §6's cuDNN ~630 TFLOP/s at d128-s4096-full fits that regime (here 617; bench.py 568).
This script times that regime, to tell which one a quoted number belongs to: each burst is --burst-ms of
back-to-back calls after --idle seconds without work; the median burst is reported, implementations interleaved.
Rows, implementations and grid flags (--tokens, --hidden, --hdims, --seqlens) are bench.py's.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (bench/ is not a package)


def burst_seconds(fn, calls, reps, idle):
    """Mean time per call of one burst of `reps` calls, started after `idle` seconds without GPU work."""
    time.sleep(idle)
    return bench.trial_seconds(fn, calls, reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="^d128-s4096-(full|causal)$", help="regex over bench.py's row names")
    p.add_argument("--impls", default="cudnn,flashjax")
    p.add_argument("--burst-ms", type=float, default=8.0, help="length of one burst of calls")
    p.add_argument("--idle", type=float, default=0.4, help="seconds without GPU work before each burst")
    p.add_argument("--bursts", type=int, default=9, help="bursts per implementation; the median is reported")
    # Any other flag is bench.py's and shapes its grid (--tokens, --hidden, --hdims, --seqlens).
    args, grid_argv = p.parse_known_args(argv)
    rows = bench.select_rows(bench.parse_args(["--rows", args.rows, *grid_argv]))
    impls = args.impls.split(",")
    print(f"{'row':<28} " + " ".join(f"{impl:>9}" for impl in impls) + "   TFLOP/s, median burst", flush=True)
    for row in rows:
        sets = bench.make_inputs(row, 3, seed=0)
        timed = {}
        for impl in impls:
            try:
                fn, calls, _ = bench.prepare_direction(bench.attention_fn(impl, row, "auto"), "fwd", sets)
                timed[impl] = (fn, calls, bench.calibrate_reps(fn, calls, 3, min_trial_s=args.burst_ms / 1e3))
            except Exception as err:  # a peer without this row, as bench.py records it
                print(f"{row.name:<28} {impl}: n/a: {bench.failure_reason(err)}", flush=True)
        samples = {impl: [] for impl in timed}
        for _ in range(args.bursts):
            for impl, (fn, calls, reps) in timed.items():
                samples[impl].append(burst_seconds(fn, calls, reps, args.idle))
        cells = [f"{row.flops('fwd') / statistics.median(samples[i]) / 1e12:9.4g}" if i in samples
                 else f"{'-':>9}" for i in impls]
        print(f"{row.name:<28} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
