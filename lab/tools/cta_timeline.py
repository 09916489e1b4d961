"""Per-CTA timelines of the sm90 forward kernel (diagnostic; lab/log/v27.md).

Runs bench.py's d128-s4096-causal row with a library built with -DFLASHJAX_PROBE (csrc/kernels/sm90/fwd_probe.cuh,
via lab/tools/codegen_variant.sh) in two regimes, and saves the raw records as .npy under OUT:
  bench:    reps calls back to back, rotating through three input sets (bench.py's trials);
  isolated: each call alone, the GPU idle before it.
Each record is one (launch, CTA): smid, globaltimer at entry / after griddepcontrol.wait / first block done / exit,
clock64 at entry and exit, and per tile its end time and (m_block, blocks, head).
  FLASHJAX_LIBRARY=probe.so python lab/tools/cta_timeline.py OUT [--rows ROW] [--chain]
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np

LAUNCHES, CTAS, SLOTS = 64, 160, 64  # fwd_probe.cuh's kLaunches, kCtas, kSlots
# A record's slots (fwd_probe.cuh's Slot): then per tile, from TILE_BASE, its end time and (m_block | blocks << 16 |
# head << 32).
SMID, ENTRY, AFTER_WAIT, FIRST_BLOCK_DONE, EXIT, TILES, CLOCK_ENTRY, CLOCK_EXIT, TILE_BASE = range(9)


def tile_ends(record):
    """The end times of a record's tiles, in the CTA's order."""
    return record[TILE_BASE:TILE_BASE + 2 * int(record[TILES]):2]


def tile_blocks(record):
    """The KV block counts of a record's tiles, in the CTA's order."""
    return (record[TILE_BASE + 1:TILE_BASE + 1 + 2 * int(record[TILES]):2] >> 16) & 0xffff


def read(lib, reset=True):
    buf = np.zeros((LAUNCHES, CTAS, SLOTS), np.uint64)
    err = lib.flashjax_probe_read(buf.ctypes.data_as(ctypes.c_void_p), int(reset))
    assert err == 0, f"flashjax_probe_read: cuda error {err}"
    return buf


def summary(name, rec):
    used = rec[:, :, EXIT] > 0  # exit recorded
    launches = [l for l in range(LAUNCHES) if used[l].any()]
    print(f"== {name}: {len(launches)} launches, {used[launches[0]].sum()} CTAs")
    prev_exit = None
    rows, clocks, cycles, entry_after = [], [], [], []
    for l in launches:
        r = rec[l][used[l]].astype(np.int64)
        start = r[:, AFTER_WAIT].min()
        ends = r[:, EXIT] - start
        first = r[:, FIRST_BLOCK_DONE] - r[:, AFTER_WAIT]
        span = ends.max()
        rows.append((l, span, ends.mean(), ends.min(), np.median(first), first.max(),
                     start - prev_exit if prev_exit is not None else 0, r[:, AFTER_WAIT].max() - start))
        # Balance: each CTA's clock (clock64 over globaltimer) and its busy cycles, and where this launch entered.
        clocks.append((r[:, CLOCK_EXIT] - r[:, CLOCK_ENTRY]) / (r[:, EXIT] - r[:, ENTRY]))
        cycles.append(r[:, CLOCK_EXIT] - r[:, CLOCK_ENTRY])
        if prev_exit is not None:
            entry_after.append(r[:, ENTRY].min() - prev_exit)
        prev_exit = r[:, EXIT].max()
    a = np.array(rows, np.float64)
    print("launch span_us end_mean/min (of span) first_block_us median/max gap_from_prev_us wait_spread_us")
    for row in a[:6].tolist() + a[-3:].tolist():
        print(f"{int(row[0]):3d} {row[1]/1e3:8.1f} {row[2]/row[1]:.4f} {row[3]/row[1]:.4f} "
              f"{row[4]/1e3:7.2f} {row[5]/1e3:7.2f} {row[6]/1e3:8.2f} {row[7]/1e3:7.2f}")
    clocks, cycles = np.array(clocks), np.array(cycles, np.float64)
    print(f"CTA clocks {np.median(clocks.min(1)):.3f}-{np.median(clocks.max(1)):.3f} GHz; busy cycles max / mean "
          f"{np.median(cycles.max(1) / cycles.mean(1)):.4f}, min / mean {np.median(cycles.min(1) / cycles.mean(1)):.4f}; "
          f"first entry after the previous launch's last exit {np.median(entry_after) / 1e3:.2f} us")
    med = np.median(a[1:], axis=0)
    print(f"median: span {med[1]/1e3:.1f} us, end mean {med[2]/med[1]:.4f} min {med[3]/med[1]:.4f} of span, "
          f"first block {med[4]/1e3:.2f} us (max {med[5]/1e3:.2f}), gap {med[6]/1e3:.2f} us, "
          f"wait spread {med[7]/1e3:.2f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="^d128-s4096-causal$")
    p.add_argument("--reps", type=int, default=48)
    p.add_argument("--chain", action="store_true", help="two calls per jitted function (one XLA executable)")
    args = p.parse_args()
    # JAX and bench.py only here: the record layout and summary() serve offline readers too (v27_plan_sim.py).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import jax
    import bench
    from flashjax import _ffi
    lib = _ffi.library()
    lib.flashjax_probe_read.restype = ctypes.c_int
    lib.flashjax_probe_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
    rows = bench.select_rows(bench.parse_args(["--rows", args.rows]))  # of bench.py's default grid
    for row in rows:
        one = bench.attention_fn("flashjax", row, "kernel")
        sets = [s[:3] for s in bench.make_inputs(row, 3, 0)]
        if args.chain:  # each execution: this set's call, then the next set's
            pairs = [sets[i] + sets[(i + 1) % 3] for i in range(3)]
            fn = jax.jit(lambda q, k, v, q2, k2, v2: (one(q, k, v), one(q2, k2, v2)))
            sets = pairs
        else:
            fn = jax.jit(one)
        for s in sets:
            jax.block_until_ready(fn(*s))
        time.sleep(0.5)
        for s in sets:  # warm, as bench.py's calibration
            jax.block_until_ready(fn(*s))
        read(lib, reset=True)
        out = None
        reps = args.reps // 2 if args.chain else args.reps
        for r in range(reps):
            out = fn(*sets[r % 3])
        jax.block_until_ready(out)
        rec_bench = read(lib)
        for r in range(6 if args.chain else 12):
            time.sleep(0.05)
            jax.block_until_ready(fn(*sets[r % 3]))
        rec_iso = read(lib)
        tag = row.name + ("-chain" if args.chain else "")
        np.save(os.path.join(args.out, f"{tag}-bench.npy"), rec_bench)
        np.save(os.path.join(args.out, f"{tag}-isolated.npy"), rec_iso)
        summary(f"{row.name} bench", rec_bench)
        summary(f"{row.name} isolated", rec_iso)


if __name__ == "__main__":
    main()
