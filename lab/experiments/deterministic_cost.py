"""The cost of deterministic=True on the sm90 backward: jax.grad of one flash_attn call, ordered against unordered,
same process and inputs, median of timed trials (bf16, 16k tokens, 16 heads of 128 / 32 of 64, like bench.py's grid).

    python lab/experiments/deterministic_cost.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax


def timed(fn, *args, reps=20, trials=5):
    jax.block_until_ready(fn(*args))
    medians = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        medians.append((time.perf_counter() - start) / reps)
    return float(np.median(medians))


def main():
    rng = np.random.default_rng(0)
    print("row                     unordered ms  deterministic ms  cost")
    for d, s, causal in ((128, 4096, False), (128, 4096, True), (64, 1024, True), (128, 16384, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
        times = []
        for deterministic in (False, True):
            loss = lambda q, k, v: jnp.sum(flashjax.flash_attn(q, k, v, causal=causal, deterministic=deterministic,
                                                               backend="kernel").astype(jnp.float32))
            times.append(timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v))
        name = f"d{d}-s{s}-{'causal' if causal else 'full'}"
        print(f"{name:24s}{times[0] * 1e3:12.3f}{times[1] * 1e3:18.3f}  {times[1] / times[0] - 1:+.1%}")


if __name__ == "__main__":
    main()
