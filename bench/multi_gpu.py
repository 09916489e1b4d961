"""flashjax on every device of the host: batch/head-sharded calls and ring attention, checked and timed (issue 42).

    python bench/multi_gpu.py --json out/multi_gpu.json                    # every GPU of the host
    python bench/multi_gpu.py --parts b --sizes b=32768,65536 --trace out/trace
    python bench/multi_gpu.py --smoke --cpu-devices 8 --json /tmp/m.json    # seconds, 8 virtual CPU devices

(a) "sharded": flash_attn under jax.jit on inputs split by NamedSharding over a Mesh of all n devices (the batch, the
    heads, or both on a 2-D mesh), forward + backward in one jitted call (jax.vjp: out, dq, dk, dv). Checked against
    the same call on one device (the whole problem); timed against one device running its share (weak scaling:
    efficiency = t(share) / t(sharded)) and the whole problem (strong scaling: t(whole) / (n * t(sharded))). Each
    device's share is --tokens tokens of --heads heads, so the global problem grows with n.
(b) "ring": ring_attention over the sequence axis (a Mesh ("seq",) of all n devices, jax.shard_map), D 128, causal
    with the zigzag layout and non-causal contiguous, forward + backward, at S = 32k..256k total tokens. Checked
    against the reference on a small case (Sq != Sk, GQA, on the same mesh); timed: TFLOP/s per device and the
    fraction of the single-device kernel rate at the per-device shard size (flash_attn on one device, q and k of
    S / n tokens, the same mask) it keeps, the goal being >= 0.85 where S / n >= 64k. Overlap: the same ring timed
    with every ppermute replaced by a local scale of the block (the "nocomm" timing probe: no transfer, its outputs
    are not attention), the compiled schedule's asynchronous transfers and how many have a kernel call (or a branch
    that holds one) inside their start..done window, and with --trace a jax.profiler trace of each ring.

Timing is bench.py's (docs/design.md §6): jitted callables rotated over --input-sets input sets, calls per trial
calibrated to >= 20 ms, the trials of every variant of a row interleaved, medians reported; FLOPs are bench.Row's
(causal Sq*Sk/2 pairs, forward + backward = 3.5x the forward: bench.py's "step"). Exit status 1 if any check fails
(or a row raises). --cpu-devices N sets XLA_FLAGS for N virtual CPU devices before jax is imported, and only where
no GPU is visible (/dev/nvidia*, unless JAX_PLATFORMS=cpu): there the GPUs are the devices and the flag is reported
as unused.
"""
import argparse
import contextlib
import functools
import glob
import itertools
import json
import math
import os
import re
import statistics
import sys
import time

SMOKE_DEFAULTS = dict(dtype="float32", tokens=128, heads=2, head_dim=32, ring_heads=2, ring_batch=1,
                      trials=1, reps=1, input_sets=2, warm_up=0.0)
FULL_DEFAULTS = dict(dtype="bfloat16", tokens=16384, heads=16, head_dim=128, ring_heads=16, ring_batch=1,
                     trials=7, reps=3, input_sets=3, warm_up=2.0)
DEFAULT_SIZES = {"a": [4096, 16384], "b": [32768, 65536, 131072, 262144]}
SMOKE_SIZES = {"a": [64], "b_per_device": 32}  # (b): total tokens = 32 per device
# Relative error by norm, per dtype: out (and lse) and gradients, as docs/design.md §5's kernel-against-reference
# rule (f32: the sharded and ring tests' agreement, with headroom for the longer sums of the larger cases).
LIMITS = {"bfloat16": (1e-2, 2e-2), "float16": (2e-3, 4e-3), "float32": (1e-4, 2e-4)}
RING_GOAL = 0.85          # fraction of the single-device kernel rate a ring should keep ...
RING_GOAL_SHARD = 65536   # ... where each device holds at least this many tokens (issue 42)
OUTPUTS = ("out", "dq", "dk", "dv")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, float32, one trial: seconds on CPU devices")
    p.add_argument("--parts", default="a,b", help="a (batch/head sharding), b (ring attention), or a,b")
    p.add_argument("--sizes", action="append", default=[], metavar="PART=S,S,...",
                   help="a=4096,16384: (a)'s sequence lengths; b=32768,65536: (b)'s total tokens (repeatable)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="make N virtual CPU devices (XLA_FLAGS, set before jax is imported); unused where GPUs exist")
    p.add_argument("--dtype", choices=sorted(LIMITS), default=None)
    p.add_argument("--backend", choices=("auto", "kernel", "reference"), default=None,
                   help="flash_attn's and ring_attention's backend (default: auto; reference for float32)")
    p.add_argument("--tokens", type=int, default=None, help="(a): tokens per device (batch per device = tokens / S)")
    p.add_argument("--heads", type=int, default=None, help="(a): heads per device")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--ring-heads", type=int, default=None, help="(b): heads (every device holds all of them)")
    p.add_argument("--ring-batch", type=int, default=None, help="(b): batch")
    p.add_argument("--trials", type=int, default=None, help="timed trials per variant; the median is reported")
    p.add_argument("--reps", type=int, default=None, help="minimum calls per trial (raised for short calls)")
    p.add_argument("--input-sets", type=int, default=None, help="input sets rotated between calls")
    p.add_argument("--warm-up", type=float, default=None, help="seconds of matmuls per GPU before the first row")
    p.add_argument("--trace", default=None, metavar="DIR", help="(b): a jax.profiler trace of each timed ring here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend is None:
        args.backend = "reference" if args.dtype == "float32" else "auto"  # the kernels take bf16 and fp16
    args.parts = [x for x in args.parts.split(",") if x]
    if not args.parts or any(x not in ("a", "b") for x in args.parts):
        p.error(f"--parts: expected a comma-separated subset of a,b, got {','.join(args.parts)!r}")
    args.size_lists = {}
    for item in args.sizes:
        part, _, values = item.partition("=")
        try:
            sizes = [int(x) for x in values.split(",") if x]
        except ValueError:
            sizes = []
        if part not in ("a", "b") or not sizes or min(sizes) < 1:
            p.error(f"--sizes: expected PART=S,S,... with PART a or b and positive ints, got {item!r}")
        args.size_lists[part] = sizes
    if args.cpu_devices is not None and args.cpu_devices < 1:
        p.error(f"--cpu-devices: expected a positive int, got {args.cpu_devices}")
    return args


def gpus_visible():
    """NVIDIA device nodes, unless JAX is pinned to the CPU: checked before jax is imported (importing it would
    start its clients)."""
    return os.environ.get("JAX_PLATFORMS", "") != "cpu" and bool(glob.glob("/dev/nvidia[0-9]*"))


def force_cpu_devices(count):
    """XLA reads this when JAX makes its CPU client, so it must be set before jax is imported; an earlier count in
    XLA_FLAGS (e.g. a test runner's) is replaced."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# Everything below runs after jax is imported (main() imports it once the flags are parsed).
jax = jnp = np = bench = flashjax = ring = P = NamedSharding = AxisType = None


def import_jax():
    global jax, jnp, np, bench, flashjax, ring, P, NamedSharding, AxisType
    import jax as _jax
    import jax.numpy as _jnp
    import numpy as _np
    from jax.sharding import AxisType as _AxisType, NamedSharding as _NamedSharding, PartitionSpec as _P

    import bench as _bench  # bench/bench.py: this script's folder is on sys.path
    import flashjax as _flashjax
    from flashjax import ring as _ring
    jax, jnp, np, bench, flashjax, ring = _jax, _jnp, _np, _bench, _flashjax, _ring
    P, NamedSharding, AxisType = _P, _NamedSharding, _AxisType


# ------------------------------------------------------------------------------------------------ shared pieces
@functools.lru_cache(maxsize=None)
def _normal(shape, dtype, sharding):
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype), out_shardings=sharding)


def random_inputs(shapes, dtype, sharding, seed):
    """Fresh normal arrays made where they will live (a sharded global array never passes through one device)."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple(_normal(tuple(s), jnp.dtype(dtype), sharding)(key) for key, s in zip(keys, shapes))


def step_of(attend):
    """One jitted forward + backward: (q, k, v, d_out) -> (out, dq, dk, dv). bench.py's "step" (its FLOPs: 3.5x the
    forward), with out returned too so that it is checked."""
    def step(q, k, v, d_out):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out,) + tuple(pullback(d_out.astype(out.dtype)))
    return jax.jit(step)


@functools.lru_cache(maxsize=None)
def flash_step(causal, backend):
    """flash_attn's step, one jitted object per mask and backend, so that equal shapes and shardings compile once."""
    return step_of(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=causal, backend=backend))


@functools.lru_cache(maxsize=None)
def _measure():
    return jax.jit(lambda g, w: (jnp.linalg.norm(g - w), jnp.linalg.norm(w), jnp.max(jnp.abs(g - w), initial=0.0)))


def errors_against(got, want, dtype):
    """Per output: relative error by norm and max abs error (f32, on the reference's device), and pass/fail against
    LIMITS[dtype]. A NaN, an inf or a shape mismatch fails."""
    limit_out, limit_grad = LIMITS[dtype]
    device = next(iter(want[0].devices()))
    measure = _measure()
    report, passed = {}, True
    for name, g, w in zip(OUTPUTS, got, want):
        if g.shape != w.shape:
            report[name] = {"rel": math.inf, "max_abs": math.inf, "limit": None}
            passed = False
            continue
        diff, norm, max_abs = (float(x) for x in measure(jax.device_put(g, device).astype(jnp.float32),
                                                          w.astype(jnp.float32)))
        rel = diff / max(norm, 1e-30)
        rel = rel if math.isfinite(rel) else math.inf
        limit = limit_out if name == "out" else limit_grad
        report[name] = {"rel": rel, "max_abs": max_abs if math.isfinite(max_abs) else math.inf, "limit": limit}
        passed &= rel <= limit
    report["passed"] = bool(passed)
    return report


def time_interleaved(variants, args):
    """{name: median seconds} of (callable, argument sets) variants, bench.py's way: calibrated, then the trials
    interleaved across variants."""
    calibrated = {name: (fn, sets, bench.calibrate_reps(fn, sets, args.reps)) for name, (fn, sets) in variants.items()}
    samples = {name: [] for name in variants}
    for _ in range(args.trials):
        for name, (fn, sets, reps) in calibrated.items():
            samples[name].append(bench.trial_seconds(fn, sets, reps))
    return {name: statistics.median(times) for name, times in samples.items()}


def row_flops(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal):
    return bench.Row("", batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal).flops("step")


def failed_row(entry, error):
    entry.update(check={"passed": False}, error=bench.failure_reason(error))
    print(f"  {entry['name']}: FAILED with {entry['error']}", flush=True)
    return entry


# ------------------------------------------------------------------------------------------------ (a) sharded
def mesh_splits(n):
    """(name, mesh shape, axis names, q's PartitionSpec) for the batch, the heads, and both where n factors."""
    splits = [("batch", (n,), ("batch",), P("batch")), ("heads", (n,), ("heads",), P(None, None, "heads"))]
    if n >= 4 and n % 2 == 0:
        splits.append(("batch+heads", (2, n // 2), ("batch", "heads"), P("batch", None, "heads")))
    return splits


def sharded_case(split, args, seqlen_q, seqlen_k, heads_kv_per_shard, group, causal, timed):
    """One problem for a split: per-device share b x S x (heads_kv_per_shard * group) query heads, the global one
    that times the mesh's batch and head shards."""
    name, mesh_shape, axes, _ = split
    batch_shards = mesh_shape[axes.index("batch")] if "batch" in axes else 1
    head_shards = mesh_shape[axes.index("heads")] if "heads" in axes else 1
    batch = max(1, args.tokens // seqlen_q) if timed else 2
    heads_k = heads_kv_per_shard
    return dict(split=name, causal=causal, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=args.head_dim,
                batch=batch * batch_shards, heads_q=heads_k * group * head_shards, heads_k=heads_k * head_shards,
                share=dict(batch=batch, heads_q=heads_k * group, heads_k=heads_k), mesh=list(mesh_shape))


def run_sharded_case(case, split, devices, args, timed, seed):
    _, mesh_shape, axes, spec = split
    mesh = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
    one = NamedSharding(jax.make_mesh((1,), ("one",), axis_types=(AxisType.Auto,), devices=devices[:1]), P())
    dtype = jnp.dtype(args.dtype)
    step = flash_step(case["causal"], args.backend)

    def shapes(batch, heads_q, heads_k):
        q = (batch, case["seqlen_q"], heads_q, case["head_dim"])
        kv = (batch, case["seqlen_k"], heads_k, case["head_dim"])
        return q, kv, kv, q

    whole = shapes(case["batch"], case["heads_q"], case["heads_k"])
    sets = [random_inputs(whole, dtype, one, seed + i) for i in range(args.input_sets if timed else 1)]
    sharded_sets = [tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in s) for s in sets]
    got = step(*sharded_sets[0])
    want = step(*sets[0])
    check = errors_against(got, want, args.dtype)
    if not timed:
        return check, None
    share = case["share"]
    share_sets = [random_inputs(shapes(share["batch"], share["heads_q"], share["heads_k"]), dtype, one,
                                seed + 100 + i) for i in range(args.input_sets)]
    jax.block_until_ready(step(*share_sets[0]))
    seconds = time_interleaved({"sharded": (step, sharded_sets), "share": (step, share_sets),
                                "whole": (step, sets)}, args)
    n = len(devices)
    flops = row_flops(case["batch"], case["seqlen_q"], case["seqlen_k"], case["heads_q"], case["heads_k"],
                      case["head_dim"], case["causal"])
    timing = {"ms_sharded": seconds["sharded"] * 1e3, "ms_share": seconds["share"] * 1e3,
              "ms_whole": seconds["whole"] * 1e3, "flops": flops,
              "tflops_per_device": flops / n / seconds["sharded"] / 1e12,
              "tflops_share": flops / n / seconds["share"] / 1e12,
              "tflops_whole": flops / seconds["whole"] / 1e12,
              "efficiency_vs_share": seconds["share"] / seconds["sharded"],
              "efficiency_vs_whole": seconds["whole"] / (n * seconds["sharded"])}
    return check, timing


def part_sharded(devices, args):
    rows, n = [], len(devices)
    seed = args.seed
    sizes = args.size_lists.get("a", (SMOKE_SIZES if args.smoke else DEFAULT_SIZES)["a"])
    for split in mesh_splits(n):
        cases = [(sharded_case(split, args, 300, 200, 2, 2, True, False), False)]  # ragged GQA, empty rows
        cases += [(sharded_case(split, args, s, s, args.heads, 1, causal, True), True)
                  for s in sizes for causal in (False, True)]
        for case, timed in cases:
            seed += 1000
            kind = "causal" if case["causal"] else "full"
            name = f"{split[0]}-d{case['head_dim']}-sq{case['seqlen_q']}-sk{case['seqlen_k']}-{kind}"
            entry = {"name": name, "kind": "timed" if timed else "check", "config": case}
            start = time.perf_counter()
            try:
                entry["check"], entry["timing"] = run_sharded_case(case, split, devices, args, timed, seed)
            except Exception as error:  # OOM, a compile failure: recorded, and the run fails
                rows.append(failed_row(entry, error))
                continue
            rows.append(entry)
            print(f"[{time.perf_counter() - start:6.1f}s] sharded {name}: check "
                  f"{'ok' if entry['check']['passed'] else 'FAILED'}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ (b) ring
RING_CONFIGS = (("zigzag", True), ("contiguous", False))


def ring_step(mesh, layout, causal, backend):
    spec = P(None, "seq")
    attend = jax.shard_map(lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq", causal=causal,
                                                                   layout=layout, backend=backend),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return step_of(attend), NamedSharding(mesh, spec)


@contextlib.contextmanager
def blocks_stay_local():
    """The "nocomm" timing probe: while a ring is traced, every ppermute (K/V forward and backward, dK/dV) is
    replaced by a local scale of the block, so each step computes on this device's own data with the same calls and
    no transfer. The scale differs per step so that XLA cannot merge steps whose calls would otherwise be identical
    (same operands, same window), which would time less compute, not less communication. Its outputs are not
    attention: a probe, not a result."""
    real, count = ring._shift, itertools.count(1)

    def stay(x, axis_name, ring_size):
        factor = 1.0 + next(count) / 128.0  # exact in bf16 for the few dozen shifts of a ring
        return jax.tree.map(lambda a: a * jnp.asarray(factor, a.dtype), x)

    ring._shift = stay
    try:
        yield
    finally:
        ring._shift = real


def schedule_overlap(compiled_text):
    """(asynchronous K/V transfers, those with a kernel call or a conditional/call, which may hold the kernels, in
    their start..done window) in a compiled module's text; CPU collectives are synchronous: (0, 0) there."""
    lines = compiled_text.splitlines()
    starts = [(m.group(1), i) for i, line in enumerate(lines)
              if (m := re.search(r"(%\S+) = .*collective-permute-start\(", line))]
    overlapped = 0
    for name, i in starts:
        done = next((j for j in range(i + 1, len(lines)) if "collective-permute-done(" in lines[j]
                     and re.search(rf"{re.escape(name)}\b", lines[j])), None)
        if done is not None:
            overlapped += any(re.search(r"custom_call_target=\"flashjax_|conditional\(| call\(", lines[j])
                              for j in range(i + 1, done))
    return len(starts), overlapped


def run_ring_check(mesh, layout, causal, args, seed):
    """The small case against the reference on one device: GQA (4 query heads on 2 KV heads) and Sq != Sk (causal:
    Sq > Sk, so the first rows see no key), the ring on the same mesh, the sequences through to_zigzag/from_zigzag."""
    n = mesh.shape["seq"]
    len_q, len_k = (48, 32) if causal else (40, 56)
    shapes = ((2, n * len_q, 4, args.head_dim), (2, n * len_k, 2, args.head_dim), (2, n * len_k, 2, args.head_dim),
              (2, n * len_q, 4, args.head_dim))
    one = NamedSharding(jax.make_mesh((1,), ("one",), axis_types=(AxisType.Auto,), devices=mesh.devices.flat[:1]),
                        P())
    inputs = random_inputs(shapes, jnp.dtype(args.dtype), one, seed)
    step, seq_sharding = ring_step(mesh, layout, causal, args.backend)
    order = (lambda x: flashjax.to_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
    back = (lambda x: flashjax.from_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
    got = [back(jax.device_put(x, one)) for x in step(*(jax.device_put(order(x), seq_sharding) for x in inputs))]
    reference = flash_step(causal, "reference")
    want = reference(*(x.astype(jnp.float32) for x in inputs))
    check = errors_against(got, want, args.dtype)
    config = dict(layout=layout, causal=causal, batch=2, seqlen_q=n * len_q, seqlen_k=n * len_k, heads_q=4,
                  heads_k=2, head_dim=args.head_dim, shard_q=len_q, shard_k=len_k)
    return config, check


def run_ring_timed(mesh, layout, causal, seqlen, args, seed):
    n = mesh.shape["seq"]
    batch, heads, dim = args.ring_batch, args.ring_heads, args.head_dim
    shard = seqlen // n
    dtype = jnp.dtype(args.dtype)
    step, seq_sharding = ring_step(mesh, layout, causal, args.backend)
    # Random data is random in either order: the timed inputs are made in place, already split over the ring.
    shape = (batch, seqlen, heads, dim)
    sets = [random_inputs((shape,) * 4, dtype, seq_sharding, seed + i) for i in range(args.input_sets)]
    compiled = step.lower(*sets[0]).compile()
    outputs = compiled(*sets[0])
    finite = bool(all(jnp.isfinite(x).all() for x in outputs))  # every row sees its diagonal: no row is empty
    async_transfers, overlapped = schedule_overlap(compiled.as_text())
    with blocks_stay_local():
        nocomm = ring_step(mesh, layout, causal, args.backend)[0].lower(*sets[0]).compile()
    if "collective-permute" in nocomm.as_text():  # e.g. a cached trace of the real ring: the probe would lie
        raise RuntimeError("the nocomm probe's compiled ring still holds a collective-permute")
    jax.block_until_ready(nocomm(*sets[0]))
    one = NamedSharding(jax.make_mesh((1,), ("one",), axis_types=(AxisType.Auto,), devices=mesh.devices.flat[:1]),
                        P())
    single = flash_step(causal, args.backend)
    single_sets = [random_inputs(((batch, shard, heads, dim),) * 4, dtype, one, seed + 50 + i)
                   for i in range(args.input_sets)]
    jax.block_until_ready(single(*single_sets[0]))
    seconds = time_interleaved({"ring": (compiled, sets), "nocomm": (nocomm, sets), "single": (single, single_sets)},
                               args)
    trace = None
    if args.trace:
        trace = os.path.join(args.trace, f"ring-{layout}-s{seqlen}")
        with jax.profiler.trace(trace):
            jax.block_until_ready(compiled(*sets[0]))
            jax.block_until_ready(nocomm(*sets[0]))
    flops = row_flops(batch, seqlen, seqlen, heads, heads, dim, causal)
    single_flops = row_flops(batch, shard, shard, heads, heads, dim, causal)
    per_device = flops / n / seconds["ring"] / 1e12
    single_rate = single_flops / seconds["single"] / 1e12
    fraction = per_device / single_rate
    timing = {"ms": seconds["ring"] * 1e3, "flops": flops, "tflops_per_device": per_device,
              "ms_single": seconds["single"] * 1e3, "tflops_single": single_rate, "fraction_of_single": fraction,
              "goal": RING_GOAL, "meets_goal": (fraction >= RING_GOAL) if shard >= RING_GOAL_SHARD else None,
              "ms_nocomm_probe": seconds["nocomm"] * 1e3,
              "tflops_per_device_nocomm_probe": flops / n / seconds["nocomm"] / 1e12,
              "ring_over_nocomm": seconds["ring"] / seconds["nocomm"],
              "async_transfers": async_transfers, "transfers_overlapping_compute": overlapped, "trace": trace}
    config = dict(layout=layout, causal=causal, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=heads,
                  heads_k=heads, head_dim=dim, shard_q=shard, shard_k=shard)
    return config, {"finite": finite, "passed": finite}, timing


def part_ring(devices, args):
    n = len(devices)
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=devices)
    sizes = args.size_lists.get("b", [SMOKE_SIZES["b_per_device"] * n] if args.smoke else DEFAULT_SIZES["b"])
    rows, seed = [], args.seed + 7
    for layout, causal in RING_CONFIGS:
        kind = "causal" if causal else "full"
        jobs = [("check", None)] + [("timed", s) for s in sizes]
        for what, seqlen in jobs:
            seed += 1000
            name = f"ring-{layout}-{kind}-" + ("check" if seqlen is None else f"s{seqlen}")
            entry = {"name": name, "kind": what}
            start = time.perf_counter()
            try:
                if seqlen is not None and seqlen % (2 * n if layout == "zigzag" else n):
                    raise ValueError(f"S = {seqlen} total tokens: expected a multiple of "
                                     f"{2 * n if layout == 'zigzag' else n} for a {layout} ring of {n}")
                if seqlen is None:
                    entry["config"], entry["check"] = run_ring_check(mesh, layout, causal, args, seed)
                    entry["timing"] = None
                else:
                    entry["config"], entry["check"], entry["timing"] = run_ring_timed(mesh, layout, causal, seqlen,
                                                                                      args, seed)
            except Exception as error:
                rows.append(failed_row(entry, error))
                continue
            rows.append(entry)
            print(f"[{time.perf_counter() - start:6.1f}s] {name}: check "
                  f"{'ok' if entry['check']['passed'] else 'FAILED'}", flush=True)
            if entry["timing"] and entry["timing"]["trace"]:
                print(f"  profile: {entry['timing']['trace']}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ report
def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def _table(header, lines):
    widths = [max(len(str(row[c])) for row in [header] + lines) for c in range(len(header))]
    return "\n".join("  ".join(str(cell).rjust(w) if c else str(cell).ljust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))) for row in [header] + lines)


def worst_error(check):
    return max((check[k]["rel"] for k in OUTPUTS if k in check), default=None)


def format_report(report):
    text = [f"{report['devices']} x {report['device_kind']} ({report['platform']}), jax {report['jax']}, "
            f"{report['dtype']}"]
    if "sharded" in report:
        lines = []
        for r in report["sharded"]:
            t, c = r.get("timing") or {}, r["check"]
            lines.append([r["name"], "ok" if c["passed"] else "FAIL", _fmt(worst_error(c), ".2e"),
                          _fmt(t.get("ms_sharded")), _fmt(t.get("tflops_per_device")), _fmt(t.get("tflops_share")),
                          _fmt(t.get("efficiency_vs_share"), ".2f"), _fmt(t.get("efficiency_vs_whole"), ".2f")])
        text += ["", "(a) flash_attn, batch/head sharded, fwd+bwd (one jitted vjp) against one device",
                 _table(["row", "check", "rel err", "ms", "TF/s/dev", "TF/s 1dev share", "eff share",
                         "eff whole"], lines)]
    if "ring" in report:
        lines = []
        for r in report["ring"]:
            t, c = r.get("timing") or {}, r["check"]
            goal = t.get("meets_goal")
            lines.append([r["name"], "ok" if c["passed"] else "FAIL", _fmt(worst_error(c), ".2e"), _fmt(t.get("ms")),
                          _fmt(t.get("tflops_per_device")), _fmt(t.get("tflops_single")),
                          _fmt(t.get("fraction_of_single"), ".2f"), "-" if goal is None else ("yes" if goal else "NO"),
                          _fmt(t.get("ring_over_nocomm"), ".2f"),
                          "-" if not t else f"{t['transfers_overlapping_compute']}/{t['async_transfers']}"])
        text += ["", "(b) ring_attention over the sequence, fwd+bwd; 1dev = flash_attn at the shard size",
                 _table(["row", "check", "rel err", "ms", "TF/s/dev", "TF/s 1dev", "fraction",
                         f">={RING_GOAL:g}", "ring/nocomm", "overlap"], lines)]
    text += ["", "TF/s: bench.py's FLOPs (causal Sq*Sk/2 pairs; fwd+bwd 3.5x fwd) / median time; per device: / n.",
             "eff share = t(1 device, its share) / t(sharded); eff whole = t(1 device, whole) / (n * t(sharded)).",
             f"fraction = ring TF/s per device / 1dev TF/s; goal >= {RING_GOAL:g} where S/n >= {RING_GOAL_SHARD}.",
             "ring/nocomm: time over the nocomm timing probe's (ppermutes replaced by local scaling: not attention).",
             "overlap: async K/V transfers whose start..done window holds a kernel call or branch / all async ones.",
             f"checks: {'all passed' if report['checks_passed'] else 'FAILED'}"]
    return "\n".join(text)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cpu_devices is not None and not gpus_visible():  # never virtual devices where GPUs exist
        force_cpu_devices(args.cpu_devices)
    import_jax()
    devices = jax.devices()
    platform = devices[0].platform
    note = None
    if args.cpu_devices is not None and platform != "cpu":
        note = f"--cpu-devices {args.cpu_devices} unused: JAX found {len(devices)} {platform} device(s)"
        print(f"note: {note}", flush=True)
    report = {"script": "bench/multi_gpu.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "devices": len(devices), "platform": platform, "device_kind": devices[0].device_kind,
              "jax": jax.__version__, "flashjax": getattr(flashjax, "__version__", "unknown"),
              "dtype": args.dtype, "backend": args.backend, "smoke": args.smoke, "trials": args.trials, "reps": args.reps,
              "input_sets": args.input_sets, "limits": {k: list(v) for k, v in LIMITS.items()},
              "ring_goal": {"fraction": RING_GOAL, "min_shard": RING_GOAL_SHARD}, "note": note}
    if platform == "gpu" and args.warm_up > 0:
        for device in devices:  # every board ramps its clocks before the first row (bench.warm_up's reason)
            with jax.default_device(device):
                bench.warm_up(args.warm_up / len(devices))
    if "a" in args.parts:
        report["sharded"] = part_sharded(devices, args)
    if "b" in args.parts:
        report["ring"] = part_ring(devices, args)
    rows = report.get("sharded", []) + report.get("ring", [])
    report["checks_passed"] = bool(rows) and all(r["check"]["passed"] for r in rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, allow_nan=True)
    print("\n" + format_report(report))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
