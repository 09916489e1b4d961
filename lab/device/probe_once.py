"""One launch each of the kernels a profiler should see for issue 37's pack64 forward row and issue 38's document
mask and sliding window (python lab/device/probe_once.py {varlen|bits|maskfwd|window}; run under ncu from
lab/device/probe.sh)."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench  # noqa: E402
import varlen  # noqa: E402

import flashjax  # noqa: E402
from flashjax import mask_bits  # noqa: E402


def run_varlen():
    row = varlen.varlen_rows()[0]  # pack64-1..1024
    (q, k, v, _), = varlen.packed_inputs(row, 1, 0)
    fn = jax.jit(varlen.flashjax_varlen(row))
    dense = varlen.dense_equal(row)
    dfn = jax.jit(bench.attention_fn("flashjax", dense, "auto"))
    dargs = bench.make_inputs(dense, 1, 0)[0]
    for _ in range(2):
        jax.block_until_ready(fn(q, k, v))
    for _ in range(2):
        jax.block_until_ready(dfn(*dargs[:3]))


def run_bits():
    B, S, docs = 4, 4096, 16
    ids = jnp.asarray(np.repeat(np.arange(docs, dtype=np.int32), S // docs)[None].repeat(B, 0))
    mod = flashjax.document_mask(ids)
    fn = jax.jit(lambda m: mask_bits.mask_bits(m, batch=B, heads=16, seqlen_q=S, seqlen_k=S))
    for _ in range(3):
        jax.block_until_ready(fn(mod))


def run_maskfwd():
    B, S, H, D, docs = 4, 4096, 16, 128, 16
    ids = jnp.asarray(np.repeat(np.arange(docs, dtype=np.int32), S // docs)[None].repeat(B, 0))
    mod = flashjax.document_mask(ids)
    q, k, v = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
    fn = jax.jit(lambda q, k, v, m: flashjax.flash_attn(q, k, v, causal=True, mask_mod=m))
    for _ in range(2):
        jax.block_until_ready(fn(q, k, v, mod))


def run_window():
    # The S 16k sliding-window mod against the native window, forward and pullback (its backward's 0.4 ms excess).
    S, H, D = 16384, 16, 128
    mod = flashjax.sliding_window_mask(1024, 0)
    q, k, v, do = (jax.random.normal(key, (1, S, H, D), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 4))
    calls = (lambda q, k, v: flashjax.flash_attn(q, k, v, mask_mod=mod, backend="kernel"),
             lambda q, k, v: flashjax.flash_attn(q, k, v, window_size=(1024, 0), backend="kernel"))
    for fn in calls:
        step = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
        for _ in range(2):
            jax.block_until_ready(step(q, k, v, do))


{"varlen": run_varlen, "bits": run_bits, "maskfwd": run_maskfwd, "window": run_window}[sys.argv[1]]()
