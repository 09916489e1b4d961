"""Side-by-side attention benchmark: flashjax against cuDNN, XLA and Pallas on the same inputs (docs/design.md §6).

    python bench/bench.py --quick --json out/bench.json --png out/bench.png
    python bench/bench.py --rows 'd128-.*-causal' --dirs fwd --reps 50
    python bench/bench.py --floors          # roofline floors of the grid, as a markdown table (docs/performance.md)

Every peer is optional: an implementation that cannot be imported, traced, compiled or run records
"n/a: <reason>" for that row instead of stopping the run. Each measured output is checked against cuDNN
(or XLA where cuDNN is n/a) so that a fast but wrong kernel is flagged rather than celebrated.
"""
import argparse
import json
import math
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("cudnn", "xla", "pallas", "fa3", "fa3kv", "flashjax")
REFERENCE_IMPLS = ("cudnn", "xla")  # correctness is judged against the first of these that ran
REL_ERR_LIMIT = 2e-2  # bf16 kernels agree to ~5e-3; anything past this is a bug, not rounding
XLA_MAX_SCORES = 4096 * 4096  # per (batch, head): XLA materializes Sq x Sk scores and probabilities
H200_MATMUL_FLOPS = 790e12  # measured bf16 dense matmul on the H200 we bench on
H200_COPY_BYTES_PER_S = 4.3e12  # measured device-to-device copy
QUICK_ROWS = ("d128-s4096-full", "d128-s4096-causal", "d64-s1024-causal", "d256-s2048-causal",
              "gqa32:8-d128-s4096-causal", "swa1024-d128-s16384", "decode-d128-sk8192")


@dataclass(frozen=True)
class Row:
    """One benchmarked problem, in flashjax's layout q [B, Sq, Hq, D], k/v [B, Sk, Hk, D]."""
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    causal: bool
    window: tuple = (-1, -1)  # (left, right) as in flash_attn's window_size; -1 = unbounded
    softcap: float = 0.0  # c * tanh(scores / c) where > 0 (Gemma 2, Grok); cuDNN, Pallas and this FA3 wheel have none

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.head_dim)

    def visible_pairs(self):
        """(query, key) pairs that attend, per (batch, head), with docs/design.md §2.3's bottom-right band.

        Plain causal uses the field's convention Sq*Sk/2 (not the exact S(S+1)/2) so our numbers compare
        with published ones; windows count exactly, since halving would credit work a kernel must skip.
        """
        if self.window == (-1, -1):
            return self.seqlen_q * self.seqlen_k / (2 if self.causal else 1)
        left, right = self.window
        right = 0 if self.causal else right
        i = np.arange(self.seqlen_q)
        offset = self.seqlen_k - self.seqlen_q
        hi = np.minimum(self.seqlen_k - 1, i + offset + right) if right >= 0 else np.full_like(i, self.seqlen_k - 1)
        lo = np.maximum(0, i + offset - left) if left >= 0 else np.zeros_like(i)
        return float(np.maximum(hi - lo + 1, 0).sum())

    def flops(self, direction):
        """Matmul FLOPs: QK^T and PV, 2 each per pair and channel; backward does 5 matmuls to forward's 2, and so
        does the tangent (S, tS = tQ K^T + Q tK^T, then (P tS) V and P tV): jvp, primal + tangent, is 3.5x fwd."""
        fwd = 4.0 * self.batch * self.heads_q * self.visible_pairs() * self.head_dim
        return {"fwd": fwd, "bwd": 2.5 * fwd, "step": 3.5 * fwd, "jvp": 3.5 * fwd}[direction]

    def min_bytes(self, direction):
        """HBM traffic floor: q,k,v read and o written once (bwd: q,k,v,o,do read, dq,dk,dv written; jvp: the
        forward's, then q,k,v,o and their tangents read, t_out written), bf16.

        The f32 lse (4 bytes per row, under 3% of q at D=64) is left out.
        """
        q = self.batch * self.seqlen_q * self.heads_q * self.head_dim
        kv = self.batch * self.seqlen_k * self.heads_k * self.head_dim
        elements = {"fwd": 2 * q + 2 * kv, "jvp": 6 * q + 6 * kv}.get(direction, 6 * q + 4 * kv)  # o, do, dq: q-sized
        return 2.0 * elements


def grid_rows(tokens, hidden, head_dims, seqlens):
    """The §6 grid (batch = tokens / S, heads = hidden / D, causal and not) and its extra rows.

    The extra rows scale with `tokens` so a tiny CPU run keeps their shape; at 16k tokens they are
    exactly GQA 32:8 at S 4k, a 1024-wide causal sliding window at S 16k, decode against 8k keys (MHA and
    GQA 32:8, and GQA with 16 queries per sequence) and decode of one sequence against 32k keys.
    """
    rows = []
    for d in head_dims:
        for s in seqlens:
            if s > tokens or hidden % d:
                continue
            for causal in (False, True):
                kind = "causal" if causal else "full"
                rows.append(Row(f"d{d}-s{s}-{kind}", tokens // s, s, s, hidden // d, hidden // d, d, causal))
    s = min(4096, tokens)
    for causal in (False, True):
        kind = "causal" if causal else "full"
        rows.append(Row(f"gqa32:8-d128-s{s}-{kind}", tokens // s, s, s, 32, 8, 128, causal))
    rows.append(Row(f"swa{tokens // 16}-d128-s{tokens}", 1, tokens, tokens, 16, 16, 128, True, (tokens // 16, 0)))
    rows.append(Row(f"decode-d128-sk{tokens // 2}", 64, 1, tokens // 2, 16, 16, 128, False))
    # Short query lengths under GQA (decode, and a 16-token speculative step), where the sm90 forward packs the
    # query heads of a KV head into one tile.
    rows.append(Row(f"decode-gqa32:8-d128-sk{tokens // 2}", 64, 1, tokens // 2, 32, 8, 128, False))
    rows.append(Row(f"spec16-gqa32:8-d128-sk{tokens // 2}", 64, 16, tokens // 2, 32, 8, 128, False))
    # Decode of one sequence against a long cache: a tile per KV head (8 of them, or 16 under MHA), far fewer than
    # the SMs, unless the keys are split across CTAs.
    rows.append(Row(f"decode-b1-gqa32:8-d128-sk{2 * tokens}", 1, 1, 2 * tokens, 32, 8, 128, False))
    rows.append(Row(f"decode-b1-d128-sk{2 * tokens}", 1, 1, 2 * tokens, 16, 16, 128, False))
    # The same GQA decode with scores soft-capped at 30: only flashjax and the reference ("xla" column) run it.
    rows.append(Row(f"decode-b1-gqa32:8-d128-sk{2 * tokens}-cap30", 1, 1, 2 * tokens, 32, 8, 128, False,
                    softcap=30.0))
    return rows


class Unsupported(Exception):
    """The implementation does not cover this row (a known limitation, not a failure)."""


def attention_fn(impl, row, flashjax_backend):
    """(q, k, v) -> out for `impl`, or raise. Peers use top-left alignment for is_causal and windows, which
    equals ours because every causal or windowed row has Sq == Sk (decode rows are full attention)."""
    window = None if row.window == (-1, -1) else row.window
    if row.softcap > 0 and impl in ("cudnn", "pallas", "fa3", "fa3kv"):
        raise Unsupported("no softcap")
    if impl in ("cudnn", "xla"):
        if impl == "xla" and row.seqlen_q * row.seqlen_k > XLA_MAX_SCORES:
            raise Unsupported("Sq*Sk above 4096^2: XLA materializes the score matrix")
        if row.softcap > 0:  # jax.nn.dot_product_attention has no softcap: flashjax's pure-JAX reference, on XLA
            import flashjax
            return lambda q, k, v: flashjax.flash_attn(
                q, k, v, causal=row.causal, window_size=row.window, softmax_scale=row.scale, softcap=row.softcap,
                backend="reference")
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=row.scale, is_causal=row.causal, local_window_size=window, implementation=impl)
    if impl == "pallas":
        with warnings.catch_warnings():  # the module warns that it moved to tokamax; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.attention import mha
        if row.heads_q != row.heads_k:
            raise Unsupported("Pallas mha needs Hq == Hk")
        if window:
            raise Unsupported("Pallas mha has no local window")
        return lambda q, k, v: mha(q, k, v, None, sm_scale=row.scale, causal=row.causal)
    if impl == "fa3":  # FlashAttention-3's own kernels through the flash_attn3_jax wheel (sm90 only)
        from flash_attn3_jax import flash_mha
        return lambda q, k, v: flash_mha(
            q, k, v, softmax_scale=float(row.scale), is_causal=row.causal, window_size=tuple(row.window))
    if impl == "fa3kv":  # the wheel's KV-cache entry: FA3's own split-keys path (forward only)
        from flash_attn3_jax import flash_mha_with_kvcache
        from flashjax import primitives
        # As many parts as flashjax's rule gives the call (the entry does not choose: its default is 1).
        parts = primitives.fwd_num_splits(jax.ShapeDtypeStruct((row.batch, row.seqlen_q, row.heads_q, row.head_dim),
                                                               jnp.bfloat16),
                                          jax.ShapeDtypeStruct((row.batch, row.seqlen_k, row.heads_k, row.head_dim),
                                                               jnp.bfloat16),
                                          window_left=row.window[0], softcap=row.softcap)
        return lambda q, k, v: flash_mha_with_kvcache(
            q, k, v, softmax_scale=float(row.scale), is_causal=row.causal, window_size=tuple(row.window),
            num_splits=parts)
    if impl == "flashjax":
        import flashjax
        return lambda q, k, v: flashjax.flash_attn(
            q, k, v, causal=row.causal, window_size=row.window, softmax_scale=row.scale, softcap=row.softcap,
            backend=flashjax_backend)
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def make_inputs(row, n_sets, seed):
    """`n_sets` independent (q, k, v, d_out) tuples; timing rotates through them so that a small problem
    cannot sit in L2 between calls and look faster than it runs in a model."""
    q_shape = (row.batch, row.seqlen_q, row.heads_q, row.head_dim)
    kv_shape = (row.batch, row.seqlen_k, row.heads_k, row.head_dim)
    sets = []
    for key in jax.random.split(jax.random.key(seed), n_sets):
        kq, kk, kv, kd = jax.random.split(key, 4)
        sets.append(tuple(jax.random.normal(k, s, jnp.bfloat16)
                          for k, s in ((kq, q_shape), (kk, kv_shape), (kv, kv_shape), (kd, q_shape))))
    return sets


def calibrate_reps(fn, arg_sets, min_reps, min_trial_s=0.02):
    """Calls per trial: enough that a trial lasts `min_trial_s`, so short kernels are not timed at timer noise."""
    start = time.perf_counter()
    for args in arg_sets:
        out = fn(*args)
    jax.block_until_ready(out)
    per_call = (time.perf_counter() - start) / len(arg_sets)
    return max(min_reps, min(1000, math.ceil(min_trial_s / max(per_call, 1e-6))))


def trial_seconds(fn, arg_sets, reps):
    """Mean time per call over `reps` calls rotating through `arg_sets`.

    Dispatch is asynchronous and calls run in order on one stream, so blocking on the last output times
    them all.
    """
    start = time.perf_counter()
    for r in range(reps):
        out = fn(*arg_sets[r % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def prepare_direction(fn, direction, sets):
    """Compile one direction: (timed function, its argument sets, outputs on the first set).

    bwd times only the pullback: a separately jitted jax.vjp returns the pullback (a pytree whose leaves
    are the residual arrays), and the timed function applies it to d_out. So bwd excludes the forward and
    whatever residuals it saves, which is what jax.grad adds on top of the forward in a training step.
    Timing jax.grad and subtracting the forward would instead mix two noisy numbers.

    step times what a training step runs: one jitted jax.grad of <out, d_out> in q, k, v (the forward, its
    residuals and the backward in one executable), at the forward's plus the backward's FLOPs.

    jvp times one jitted jax.jvp of the call (forward mode: the primal and its tangent, both returned), the
    tangents being the inputs themselves (any direction costs the same), at 3.5x the forward's FLOPs (Row.flops).
    """
    if direction == "fwd":
        fwd = jax.jit(fn)
        calls = [s[:3] for s in sets]
        return fwd, calls, (jax.block_until_ready(fwd(*calls[0])),)
    if direction == "jvp":
        jvp = jax.jit(lambda q, k, v: jax.jvp(fn, (q, k, v), (q, k, v)))
        calls = [s[:3] for s in sets]
        return jvp, calls, tuple(jax.block_until_ready(jvp(*calls[0])))
    if direction == "step":
        step = jax.jit(jax.grad(lambda q, k, v, d_out: jnp.vdot(fn(q, k, v).astype(jnp.float32),
                                                                d_out.astype(jnp.float32)), argnums=(0, 1, 2)))
        return step, sets, tuple(jax.block_until_ready(step(*sets[0])))
    make_pullback = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1])
    apply_pullback = jax.jit(lambda pullback, d_out: pullback(d_out))
    calls = [(make_pullback(*s[:3]), s[3]) for s in sets]
    return apply_pullback, calls, tuple(jax.block_until_ready(apply_pullback(*calls[0])))


def failure_reason(err):
    lines = str(err).strip().splitlines() or [""]
    return f"{type(err).__name__}: {lines[0]}"[:160]


def relative_error(got, want):
    """Largest ||got - want|| / ||want|| over the outputs (f32); NaN/inf or a shape mismatch gives inf."""
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return math.inf
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        err = float(jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


def bench_row(row, args):
    """{direction: {impl: {ms, tflops[, rel_err, ref, wrong]} | {na: reason}}} for one row.

    Per direction, every implementation is compiled and calibrated first, then the timed trials interleave
    (cudnn, flashjax, cudnn, flashjax, ...): GPU clocks drift by several percent within a run, and interleaving
    puts the same drift into every implementation's median instead of into the ratio between them.
    """
    sets = make_inputs(row, args.input_sets, args.seed)
    results = {d: {} for d in args.dirs}
    outputs = {d: {} for d in args.dirs}
    fns = {}
    for impl in args.impls:
        try:
            fns[impl] = attention_fn(impl, row, args.flashjax_backend)
        except Exception as err:  # ImportError, Unsupported, or anything a missing piece raises
            for d in args.dirs:
                results[d][impl] = {"na": failure_reason(err)}
    for d in args.dirs:
        timed = {}
        for impl, fn in fns.items():
            try:
                timed_fn, calls, outputs[d][impl] = prepare_direction(fn, d, sets)
                timed[impl] = (timed_fn, calls, calibrate_reps(timed_fn, calls, args.reps))
            except Exception as err:  # trace/compile/runtime failure, OOM: record and go on
                results[d][impl] = {"na": failure_reason(err)}
        samples = {impl: [] for impl in timed}
        for _ in range(args.trials):
            for impl, (timed_fn, calls, reps) in timed.items():
                samples[impl].append(trial_seconds(timed_fn, calls, reps))
        for impl, times in samples.items():
            seconds = statistics.median(times)
            results[d][impl] = {"ms": seconds * 1e3, "tflops": row.flops(d) / seconds / 1e12}
        ref = next((i for i in REFERENCE_IMPLS if i in outputs[d]), None)
        for impl, out in outputs[d].items():
            if ref is not None and impl != ref:
                err = relative_error(out, outputs[d][ref])
                results[d][impl].update(rel_err=err, ref=ref, wrong=err > REL_ERR_LIMIT)
    return results


def format_table(report):
    """Compact text table: TFLOP/s per implementation and flashjax / cuDNN, per direction, then a legend."""
    impls, dirs = report["impls"], report["dirs"]
    header = ["row"]
    for d in dirs:
        header += [f"{d}:{i}" for i in impls] + [f"{d}:fj/cudnn"]
    lines, reasons = [header], {}
    for entry in report["rows"]:
        cells = [entry["row"]["name"]]
        for d in dirs:
            res = entry["results"][d]
            for impl in impls:
                r = res.get(impl, {"na": "not run"})
                if "na" in r:
                    reasons.setdefault((impl, r["na"]), []).append(entry["row"]["name"])
                    cells.append("-")
                else:
                    cells.append(f"{r['tflops']:.4g}" + ("!" if r.get("wrong") else ""))
            fj, cu = res.get("flashjax", {}), res.get("cudnn", {})
            cells.append(f"{fj['tflops'] / cu['tflops']:.2f}" if "tflops" in fj and "tflops" in cu else "-")
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text += ["",
             "TFLOP/s = model FLOPs / median time; fwd FLOPs 4*B*Hq*pairs*D (causal: Sq*Sk/2 pairs, windows:",
             "  exact count), bwd 2.5x fwd. bwd times the jax.vjp pullback call alone: no forward in it;",
             "  step (3.5x fwd) times one jitted jax.grad: forward and backward in one executable;",
             "  jvp (3.5x fwd: the forward and its 2.5x tangent) times one jitted jax.jvp, primal and tangent.",
             f"! = output (bwd: worst of dq, dk, dv) off cuDNN's (else XLA's) by relative norm > {REL_ERR_LIMIT:g}."]
    if reasons:
        text.append("- = n/a:")
    for (impl, reason), names in reasons.items():
        text.append(f"  {impl}: {reason}  [{len(names)} cells, e.g. {names[0]}]")
    return "\n".join(text)


def floors_table(rows):
    """Markdown roofline floors on the H200: time >= max(FLOPs / matmul peak, bytes / copy bandwidth);
    "best" is the TFLOP/s a kernel running exactly at its floor would report."""
    columns = ["GFLOP", "MB", "floor us", "bound", "best"]
    out = ["| row | " + " | ".join(f"{d} {c}" for d in ("fwd", "bwd") for c in columns) + " |",
           "|---|" + "---:|---:|---:|---|---:|" * 2]
    for row in rows:
        cells = [row.name]
        for d in ("fwd", "bwd"):
            t_math, t_mem = row.flops(d) / H200_MATMUL_FLOPS, row.min_bytes(d) / H200_COPY_BYTES_PER_S
            floor = max(t_math, t_mem)
            cells += [f"{row.flops(d) / 1e9:.1f}", f"{row.min_bytes(d) / 1e6:.0f}", f"{floor * 1e6:.0f}",
                      "math" if t_math >= t_mem else "memory", f"{row.flops(d) / floor / 1e12:.0f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def warm_up(seconds):
    """Dense bf16 matmuls for `seconds` before the first row. A GPU that idled before the run ramps its clocks while
    the first row is timed: on the H200 that row read 4-12% low against the same row later in the run (the first
    row of every process: d64-s512-full 0.96 and 0.88 of cuDNN, the same kernels >= 1.0 elsewhere;
    docs/performance.md)."""
    if seconds <= 0:
        return
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    step = jax.jit(lambda a: (a @ a) * (1.0 / 8192))
    step(x).block_until_ready()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = step(x)
        x.block_until_ready()


def parse_args(argv):
    csv = lambda s: [x for x in s.split(",") if x]
    ints = lambda s: [int(x) for x in csv(s)]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only the rows {', '.join(QUICK_ROWS)}")
    p.add_argument("--rows", default=None, help="regex; keep rows whose name it matches (re.search)")
    p.add_argument("--dirs", type=csv, default=["fwd", "bwd"],
                   help="fwd,bwd,step,jvp (step: one jitted jax.grad; jvp: one jitted jax.jvp)")
    p.add_argument("--impls", type=csv, default=list(IMPLS), help=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=10, help="minimum calls per trial (raised for short calls)")
    p.add_argument("--trials", type=int, default=7, help="timed trials; the median is reported")
    p.add_argument("--input-sets", type=int, default=3, help="input sets rotated between calls (L2 flushing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up", type=float, default=2.0, help="seconds of matmuls before the first row (GPU only)")
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--png", default=None, help="write the plot here (needs matplotlib)")
    p.add_argument("--floors", action="store_true", help="print roofline floors for the rows and exit")
    p.add_argument("--flashjax-backend", default="kernel", help='flash_attn(backend=...); "kernel" by default')
    p.add_argument("--tokens", type=int, default=16384, help="tokens per row (batch = tokens / S)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head dim for the grid rows")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    args = p.parse_args(argv)
    bad = [d for d in args.dirs if d not in ("fwd", "bwd", "step", "jvp")] + [i for i in args.impls if i not in IMPLS]
    if bad:
        p.error(f"unknown --dirs/--impls entries {bad}")
    return args


def select_rows(args):
    rows = grid_rows(args.tokens, args.hidden, args.hdims, args.seqlens)
    if args.quick:
        rows = [r for r in rows if r.name in QUICK_ROWS]
    if args.rows:
        rows = [r for r in rows if re.search(args.rows, r.name)]
    return rows


def main(argv=None):
    args = parse_args(argv)
    rows = select_rows(args)
    if args.floors:
        print(floors_table(rows))
        return None
    device = jax.devices()[0]
    try:
        import flashjax
        flashjax_version = getattr(flashjax, "__version__", "unknown")
    except ImportError as err:
        flashjax_version = f"n/a: {failure_reason(err)}"
    report = {"device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
              "flashjax": flashjax_version,
              "impls": args.impls, "dirs": args.dirs, "reps": args.reps, "trials": args.trials,
              "rel_err_limit": REL_ERR_LIMIT, "rows": []}
    if device.platform == "gpu":
        warm_up(args.warm_up)
    for row in rows:
        start = time.perf_counter()
        results = bench_row(row, args)
        entry = {"row": asdict(row), "flops": {d: row.flops(d) for d in args.dirs},
                 "min_bytes": {d: row.min_bytes(d) for d in args.dirs}, "results": results}
        report["rows"].append(entry)
        print(f"[{time.perf_counter() - start:6.1f}s] {row.name}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png:
        from plot import write_plot  # bench/plot.py: the script's folder is on sys.path
        try:
            write_plot(report, args.png)
        except ModuleNotFoundError as err:
            if err.name != "matplotlib":
                raise
            print("no plot: matplotlib is not installed", file=sys.stderr)
    print(f"\n{report['device']}, jax {report['jax']}\n{format_table(report)}")
    return report


if __name__ == "__main__":
    main()
