"""flashjax demo: GQA causal attention with sinks, forward and backward, checked against the reference.

On an NVIDIA GPU the kernel runs and is timed against jax.nn.dot_product_attention(implementation="cudnn");
elsewhere the reference runs (the kernels need an NVIDIA GPU) on a smaller problem.
"""
from __future__ import annotations

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import flashjax


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_ms(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=None)
    args = parser.parse_args()
    on_gpu = jax.devices()[0].platform == "gpu"
    batch, heads_q, heads_k, head_dim = (4, 32, 8, 128) if on_gpu else (1, 8, 2, 64)
    seqlen = args.seqlen or (4096 if on_gpu else 256)
    print(f"flashjax {flashjax.__version__} on {jax.devices()[0].device_kind}")
    if not on_gpu:
        print("No NVIDIA GPU: the flashjax kernels need one; running the pure-JAX reference (backend='reference').")
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((batch, seqlen, heads_q, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, seqlen, heads_k, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, seqlen, heads_k, head_dim)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(heads_q), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    backend = "kernel" if on_gpu else "reference"
    print(f"problem: B={batch} S={seqlen} Hq={heads_q} Hk={heads_k} D={head_dim} bf16, causal, sinks")
    print(flashjax.explain(q, k, v, causal=True, sinks=sinks, backend=backend))

    def fwd_bwd(backend):
        def f(q, k, v, sinks):
            return flashjax.flash_attn(q, k, v, causal=True, sinks=sinks, backend=backend)

        @jax.jit
        def run(q, k, v, sinks, d_out):
            out, vjp = jax.vjp(f, q, k, v, sinks)
            return out, vjp(d_out.astype(out.dtype))
        return run

    got = fwd_bwd(backend)(q, k, v, sinks, d_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want = fwd_bwd("reference")(*f32, sinks, d_out)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    errs = [rel_err(a, b) for a, b in zip([got[0], *got[1]], [want[0], *want[1]])]
    print("relative error vs the f32 reference: " + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errs)))
    ok = all(e < 2e-2 for e in errs)
    print("check: " + ("PASS" if ok else "FAIL"))
    if on_gpu:
        flops = 4 * batch * heads_q * seqlen * seqlen * head_dim / 2  # causal: half the score matrix
        fwd = jax.jit(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel"))
        kv_rep = heads_q // heads_k
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="cudnn"))
        t_fj = time_ms(fwd, q, k, v)
        print(f"forward: flashjax {flops / t_fj / 1e9:.0f} TFLOP/s ({t_fj:.3f} ms)", end="")
        try:
            t_cd = time_ms(cudnn, q, k, v)
            print(f", cudnn {flops / t_cd / 1e9:.0f} TFLOP/s ({t_cd:.3f} ms), ratio {t_cd / t_fj:.2f}x")
        except Exception as e:  # cuDNN may be missing or refuse the shape
            print(f", cudnn n/a ({type(e).__name__}: {str(e)[:80]}) [GQA {kv_rep}:1]")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
