"""Packed sequences (issue 37's speed rows): flashjax's varlen call against what its tokens cost elsewhere.

    python bench/varlen.py                       # every row, forward and backward
    python bench/varlen.py --rows '^pad' --dirs fwd

Three kinds of rows, each timed side by side in one process with bench.py's method (interleaved trials, median,
L2-flushing input sets):
  pack<N>-<lo>..<hi>   N causal sequences of random lengths in [lo, hi], D 128, 16 heads. flashjax varlen against
                       flashjax's dense call over equal-length sequences (length sqrt(mean len^2), so the same
                       FLOPs up to rounding): the column `cost` is varlen seconds per FLOP over dense seconds per
                       FLOP (the bar: <= 1.1).
  pad<N>-<lo>..<hi>    the same packing, and cuDNN on it padded to the longest sequence with per-sequence lengths
                       (what a cuDNN user runs instead). `speedup` is cuDNN's time over flashjax's; both do the
                       packing's FLOPs, so it is the ratio of rates on real tokens.
  decode<N>-<lo>..<hi> one query per sequence against caches of random lengths, GQA 32:8, D 128, forward only:
                       K/V bytes read per second (`GB/s`) against the HBM traffic rate of a copy measured here
                       (bytes read + written per second of a 2 GiB copy): `of copy`.
FLOPs count causal pairs as L^2/2 per sequence, the field's convention (bench.py's Row.visible_pairs).
"""
import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (bench/ is not a package)

HEADS, HEAD_DIM = 16, 128


@dataclass(frozen=True)
class VarlenRow:
    name: str
    kind: str  # "pack", "pad" or "decode"
    lengths: tuple  # key lengths per sequence (= query lengths except for decode: one query each)
    heads_q: int = HEADS
    heads_k: int = HEADS
    head_dim: int = HEAD_DIM

    @property
    def queries(self):
        return tuple(1 for _ in self.lengths) if self.kind == "decode" else self.lengths

    def flops(self, direction):
        pairs = sum(q * k for q, k in zip(self.queries, self.lengths)) / (1 if self.kind == "decode" else 2)
        fwd = 4.0 * self.heads_q * self.head_dim * pairs
        return {"fwd": fwd, "bwd": 2.5 * fwd}[direction]

    def kv_bytes(self):
        return 2 * 2.0 * sum(self.lengths) * self.heads_k * self.head_dim  # K and V, bf16


def varlen_rows(seed=0, scale=1):
    """The rows; `scale` divides every length and count (a quick CPU run keeps the rows' shape)."""
    rng = np.random.default_rng(seed)

    def lengths(n, lo, hi):
        n, lo, hi = max(1, n // scale), lo // scale, max(1, hi // scale)
        return tuple(int(x) for x in rng.integers(lo, hi + 1, n))

    return [VarlenRow("pack64-1..1024", "pack", lengths(64, 1, 1024)),
            VarlenRow("pack1000-0..512", "pack", lengths(1000, 0, 512)),
            VarlenRow("pad64-1..512", "pad", lengths(64, 1, 512)),
            VarlenRow("decode64-1k..32k-gqa32:8", "decode", lengths(64, 1024, 32768), heads_q=32, heads_k=8)]


def offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def packed_inputs(row, n_sets, seed):
    """(q, k, v, d_out) sets in the packed layout [T, H, D]."""
    tq, tk = sum(row.queries), sum(row.lengths)
    shapes = ((tq, row.heads_q, row.head_dim), (tk, row.heads_k, row.head_dim), (tk, row.heads_k, row.head_dim),
              (tq, row.heads_q, row.head_dim))
    sets = []
    for key in jax.random.split(jax.random.key(seed), n_sets):
        sets.append(tuple(jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(jax.random.split(key, 4), shapes)))
    return sets


def flashjax_varlen(row, backend="auto"):
    import flashjax
    cu_q, cu_k = offsets(row.queries), offsets(row.lengths)
    causal = row.kind != "decode"
    return lambda q, k, v: flashjax.flash_attn_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q=max(row.queries), max_seqlen_k=max(row.lengths), causal=causal,
        backend=backend)


def padded(row):
    """(pad, unpad, lengths): packed [T, H, D] <-> [N, max_len, H, D] with zeros past each sequence."""
    n, width = len(row.lengths), max(row.lengths)
    starts = np.concatenate([[0], np.cumsum(row.lengths)[:-1]])
    slot = np.full((n, width), sum(row.lengths), np.int32)  # index T: the zero row appended below
    for b, (start, length) in enumerate(zip(starts, row.lengths)):
        slot[b, :length] = start + np.arange(length)
    slot = jnp.asarray(slot)
    valid = np.concatenate([b * width + np.arange(length) for b, length in enumerate(row.lengths)])
    valid = jnp.asarray(valid, jnp.int32)

    def pad(x):
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[slot]

    def unpad(x):
        return x.reshape((n * width,) + x.shape[2:])[valid]

    return pad, unpad, jnp.asarray(row.lengths, jnp.int32)


def cudnn_padded(row):
    """cuDNN over the padding, told each sequence's length; packed in, packed out (the pads are part of its cost)."""
    pad, unpad, lengths = padded(row)
    scale = 1.0 / math.sqrt(row.head_dim)
    return lambda q, k, v: unpad(jax.nn.dot_product_attention(
        pad(q), pad(k), pad(v), scale=scale, is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths, implementation="cudnn"))


def dense_equal(row):
    """bench.py's row for flashjax's dense call over equal-length causal sequences with (nearly) the packing's
    FLOPs: length sqrt(mean len^2), as many sequences as make up the sum of len^2."""
    length = max(1, round(math.sqrt(np.mean(np.square(row.lengths)))))
    batch = max(1, round(sum(x * x for x in row.lengths) / (length * length)))
    return bench.Row(f"dense-b{batch}-s{length}", batch, length, length, row.heads_q, row.heads_k, row.head_dim, True)


def time_impls(fns, dirs, args):
    """{direction: {impl: seconds or 'n/a: reason'}} and first-set outputs for {impl: (fn, input sets)}, trials
    interleaved as bench.py's."""
    seconds, outputs = {}, {}
    for d in dirs:
        timed, seconds[d], outputs[d] = {}, {}, {}
        for impl, (fn, sets) in fns.items():
            try:
                timed_fn, calls, outputs[d][impl] = bench.prepare_direction(fn, d, sets)
                timed[impl] = (timed_fn, calls, bench.calibrate_reps(timed_fn, calls, args.reps))
            except Exception as err:  # a peer without this row: recorded, the run goes on
                seconds[d][impl] = "n/a: " + bench.failure_reason(err)
        samples = {impl: [] for impl in timed}
        for _ in range(args.trials):
            for impl, (timed_fn, calls, reps) in timed.items():
                samples[impl].append(bench.trial_seconds(timed_fn, calls, reps))
        for impl, times in samples.items():
            seconds[d][impl] = statistics.median(times)
    return seconds, outputs


def copy_traffic_rate(elements=1 << 30):
    """HBM bytes (read + written) per second of a copy (2 GiB of bf16 by default), timed like the rows."""
    x = jnp.ones((elements,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    reps = bench.calibrate_reps(copy, [(x,)], 5)
    seconds = statistics.median(bench.trial_seconds(copy, [(x,)], reps) for _ in range(5))
    return 2 * x.nbytes / seconds


def bench_row(row, args, copy_rate):
    dirs = ["fwd"] if row.kind == "decode" else args.dirs
    sets = packed_inputs(row, args.input_sets, args.seed)
    fns = {"flashjax": (flashjax_varlen(row), sets)}
    if row.kind == "pad":
        fns["cudnn"] = (cudnn_padded(row), sets)
    if row.kind == "pack":
        dense = dense_equal(row)
        fns["dense"] = (bench.attention_fn("flashjax", dense, "auto"), bench.make_inputs(dense, args.input_sets,
                                                                                           args.seed))
    seconds, outputs = time_impls(fns, dirs, args)
    lines = []
    for d in dirs:
        ours = seconds[d]["flashjax"]
        if isinstance(ours, str):
            lines.append(f"{row.name:<26} {d:<4} flashjax {ours}")
            continue
        cells = [f"{row.name:<26} {d:<4} flashjax {row.flops(d) / ours / 1e12:7.1f} TFLOP/s {ours * 1e3:8.3f} ms"]
        if row.kind == "pack":
            theirs = seconds[d].get("dense", "n/a")
            cost = "n/a" if isinstance(theirs, str) else f"{(ours / row.flops(d)) / (theirs / dense.flops(d)):.3f}"
            cells.append(f"{dense.name} {'' if isinstance(theirs, str) else f'{dense.flops(d) / theirs / 1e12:.1f}'}"
                         f" TFLOP/s  cost {cost}")
        elif row.kind == "pad":
            theirs = seconds[d].get("cudnn")
            if isinstance(theirs, str):
                cells.append(f"cudnn {theirs}")
            else:
                err = bench.relative_error(outputs[d]["flashjax"], outputs[d]["cudnn"])
                cells.append(f"cudnn {row.flops(d) / theirs / 1e12:.1f} TFLOP/s  speedup {theirs / ours:.2f}"
                             f"  rel_err {err:.1e}")
        else:
            rate = row.kv_bytes() / ours
            cells.append(f"{rate / 1e9:7.0f} GB/s  of copy {rate / copy_rate:.2f}")
        lines.append("  ".join(cells))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=".", help="regex over the row names")
    p.add_argument("--dirs", default="fwd,bwd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=1, help="divide every length and sequence count by this")
    args = p.parse_args(argv)
    args.dirs = args.dirs.split(",")
    rows = [r for r in varlen_rows(args.seed, args.scale) if re.search(args.rows, r.name)]
    copy_rate = copy_traffic_rate(max(1 << 20, (1 << 30) // args.scale ** 2)) if any(r.kind == "decode" for r in rows) else None
    if copy_rate:
        print(f"copy: {copy_rate / 1e9:.0f} GB/s of HBM traffic (read + write)", flush=True)
    for row in rows:
        for line in bench_row(row, args, copy_rate):
            print(line, flush=True)


if __name__ == "__main__":
    main()
