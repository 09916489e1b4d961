"""How long the GPU stream sits idle between two calls (diagnostic; lab/log/v28.md).

bench.py times back-to-back calls of one jitted function; between two of them the stream runs nothing for a few
microseconds (v27: ~4.6 us between the last CTA's exit and the next kernel's first CTA). This script traces such
calls with jax.profiler and reports, per case, the median idle time on the stream between two consecutive device
events, for our kernel and for controls, so that the part owed to the XLA execution boundary and the part owed to
the kernel's own launch (parameter block, shared-memory size, grid) can be told apart:
  xla:      an elementwise fusion, one XLA kernel a call (the boundary with a plain launch);
  flashjax: bench.py's row through flashjax (the same row chained twice in one jitted function too: no boundary
            between the pair);
  cudnn:    the same row through cuDNN.
  python lab/tools/launch_gap.py OUT [--rows ROW] [--reps N]
Run it once with FLASHJAX_SM90_PDL=0 too (read once per process) to see what programmatic dependent launch changes.
"""
import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time


def device_events(trace_dir):
    """[(name, start_us, end_us)] per device stream line of the trace under trace_dir, sorted by start."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no trace under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process_names = {e["pid"]: e["args"].get("name", "") for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in process_names.items() if "/device:GPU" in name}
    if not device_pids:
        raise RuntimeError(f"no GPU device in the trace's processes: {sorted(process_names.values())[:8]}")
    lines = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            start = float(e["ts"])
            lines.setdefault((e["pid"], e["tid"]), []).append((e["name"], start, start + float(e["dur"])))
    return {key: sorted(v, key=lambda x: x[1]) for key, v in lines.items()}


def gaps(lines, pattern):
    """Idle time before each event whose name matches pattern, on the busiest stream line: (gaps, names seen)."""
    if not lines:
        return [], []
    line = max(lines.values(), key=len)
    names = sorted({n[:60] for n, _, _ in line})
    out = []
    for (_, _, prev_end), (name, start, _) in zip(line, line[1:]):
        if re.search(pattern, name):
            out.append(start - prev_end)
    return out, names


def trace_calls(fn, sets, reps, trace_dir, perfetto=False):
    """A jax.profiler trace under trace_dir of reps back-to-back calls of fn, rotating through sets, after two warm
    passes and a short idle (lab/tools/stream_trace.py's traces too)."""
    import jax
    for _ in range(2):
        for s in sets:
            jax.block_until_ready(fn(*s))
    time.sleep(0.2)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=perfetto)
    out = None
    for r in range(reps):
        out = fn(*sets[r % len(sets)])
    jax.block_until_ready(out)
    jax.profiler.stop_trace()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="^d128-s(512|4096)-causal$")
    p.add_argument("--reps", type=int, default=24)
    args = p.parse_args()
    # JAX and bench.py only here: the trace parsing above is importable without them (tests/cpu).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import jax
    import jax.numpy as jnp

    import bench
    pdl = os.environ.get("FLASHJAX_SM90_PDL", "1")
    cases = []
    # Long enough (~250 us) that the host keeps ahead of the stream, as it does for the attention rows.
    x = [jax.random.normal(jax.random.PRNGKey(i), (16384, 16384), jnp.bfloat16) for i in range(3)]
    xs = [(a,) for a in x]
    cases.append(("xla elementwise (512 MB in, 512 MB out)", jax.jit(lambda a: a * 2 + 1), xs, "."))
    # The barrier keeps the two halves in two fusions: two kernels in one execution.
    two = jax.jit(lambda a: jax.lax.optimization_barrier(a * 2 + 1) * 3 - 1)
    cases.append(("xla elementwise chained x2", two, xs, "."))
    rows = bench.select_rows(bench.parse_args(["--rows", args.rows]))  # of bench.py's default grid
    for row in rows:
        sets = [s[:3] for s in bench.make_inputs(row, 3, 0)]
        attn = bench.attention_fn("flashjax", row, "kernel")
        cases.append((f"{row.name} flashjax", jax.jit(attn), sets, "fwd_kernel_sm90"))
        cases.append((f"{row.name} cudnn", jax.jit(bench.attention_fn("cudnn", row, "kernel")), sets, "."))
        chained = jax.jit(lambda q, k, v, attn=attn: attn(attn(q, k, v), k, v))  # this row's attn, bound now
        cases.append((f"{row.name} flashjax chained x2", chained, sets, "fwd_kernel_sm90"))
    print(f"FLASHJAX_SM90_PDL={pdl}; idle stream time before each matching event, us (median, min, max; n)")
    for i, (name, fn, sets, pattern) in enumerate(cases):
        trace_dir = os.path.join(args.out, f"pdl{pdl}-case{i}")
        trace_calls(fn, sets, args.reps, trace_dir)
        g, names = gaps(device_events(trace_dir), pattern)
        if not g:
            print(f"{name:46s} no events matched; stream events seen: {names[:8]}")
            continue
        print(f"{name:46s} {statistics.median(g):7.2f} {min(g):7.2f} {max(g):7.2f}  n={len(g)}  "
              f"events: {len(names)} kinds {', '.join(names[:3])}")
        if "chained" in name:  # alternate gaps: inside one execution, and across the boundary
            print(f"{'':46s} alternate: {statistics.median(g[0::2]):7.2f} / {statistics.median(g[1::2]):7.2f}")


if __name__ == "__main__":
    main()
