"""What the GPU stream runs between two calls (diagnostic; bench/NOTES.md v27): a jax.profiler trace of bench.py's
back-to-back calls of one row, per implementation, saved as a Perfetto trace under OUT/<impl>/.
  python tools/stream_trace.py OUT [--rows ROW] [--impls cudnn,flashjax] [--reps N]
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import jax  # noqa: E402

import bench  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="^d128-s4096-causal$")
    p.add_argument("--impls", default="cudnn,flashjax")
    p.add_argument("--reps", type=int, default=24)
    args = p.parse_args()
    rows = [r for r in bench.grid_rows(16384, 2048, (64, 128, 256), (512, 1024, 2048, 4096, 8192, 16384))
            if re.search(args.rows, r.name)]
    for row in rows:
        sets = [s[:3] for s in bench.make_inputs(row, 3, 0)]
        for impl in args.impls.split(","):
            fn = jax.jit(bench.attention_fn(impl, row, "kernel"))
            for _ in range(2):
                for s in sets:
                    jax.block_until_ready(fn(*s))
            time.sleep(0.2)
            d = os.path.join(args.out, f"{row.name}-{impl}")
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            out = None
            for r in range(args.reps):
                out = fn(*sets[r % 3])
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            print("traced", row.name, impl, "->", d)


if __name__ == "__main__":
    main()
