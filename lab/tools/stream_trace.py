"""What the GPU stream runs between two calls (diagnostic; lab/log/v27.md): a jax.profiler trace of bench.py's
back-to-back calls of one row, per implementation, saved as a Perfetto trace under OUT/<impl>/.
  python lab/tools/stream_trace.py OUT [--rows ROW] [--impls cudnn,flashjax] [--reps N]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import jax  # noqa: E402

import bench  # noqa: E402
from launch_gap import trace_calls  # noqa: E402  (lab/tools/ is this script's directory)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="^d128-s4096-causal$")
    p.add_argument("--impls", default="cudnn,flashjax")
    p.add_argument("--reps", type=int, default=24)
    args = p.parse_args()
    rows = bench.select_rows(bench.parse_args(["--rows", args.rows]))  # of bench.py's default grid
    for row in rows:
        sets = [s[:3] for s in bench.make_inputs(row, 3, 0)]
        for impl in args.impls.split(","):
            d = os.path.join(args.out, f"{row.name}-{impl}")
            trace_calls(jax.jit(bench.attention_fn(impl, row, "kernel")), sets, args.reps, d, perfetto=True)
            print("traced", row.name, impl, "->", d)


if __name__ == "__main__":
    main()
