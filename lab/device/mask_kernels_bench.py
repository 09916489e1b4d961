"""Issue 38's timing on one GPU, same process: B 4, S 4096, H 16, D 128, causal, a document mask of 16 equal
documents, forward and backward (the pullback alone), on the kernels with the mask mod, against the same call
without the mask and against flash_attn_varlen over the same documents (the cost the visible tokens imply).
Interleaved trials, median of 7, each trial >= 20 ms (docs/design.md §6's method, in small). Prints one table."""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

B, S, H, D, DOCS = 4, 4096, 16, 128, 16


def timed(fn, args, min_seconds=0.02):
    jax.block_until_ready(fn(*args))
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls
        calls *= 2


def main():
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(4))
    ids = jnp.asarray(np.repeat(np.arange(DOCS, dtype=np.int32), S // DOCS)[None].repeat(B, 0))
    mod = flashjax.document_mask(ids)
    cu = jnp.arange(0, B * S + 1, S // DOCS, dtype=jnp.int32)  # 16 documents per sequence, packed

    def masked(q, k, v):
        return flashjax.flash_attn(q, k, v, causal=True, mask_mod=mod, backend="kernel")

    def dense(q, k, v):
        return flashjax.flash_attn(q, k, v, causal=True, backend="kernel")

    def varlen(q, k, v):
        out = flashjax.flash_attn_varlen(q.reshape(B * S, H, D), k.reshape(B * S, H, D), v.reshape(B * S, H, D), cu,
                                         cu, max_seqlen_q=S // DOCS, max_seqlen_k=S // DOCS, causal=True,
                                         backend="kernel")
        return out.reshape(B, S, H, D)

    from flashjax import mask_bits, primitives

    def bits_only(ids):
        return mask_bits.mask_bits(flashjax.document_mask(ids), batch=B, heads=H, seqlen_q=S, seqlen_k=S)

    bits = jax.jit(bits_only)(ids)

    def kernel_only(q, k, v):  # the attention kernels on precomputed bits: what the mask costs the kernels alone
        return primitives.forward(q, k, v, jnp.zeros((H,), jnp.float32), bits, softmax_scale=D ** -0.5, softcap=0.0,
                                  window_left=-1, window_right=0, has_sinks=False, has_mask_bits=True)[0]

    calls = {"mask mod": masked, "mask mod, bits given": kernel_only, "causal, no mask": dense,
             "varlen (same docs)": varlen}
    print(flashjax.explain(q, k, v, causal=True, mask_mod=mod))
    ref = calls["varlen (same docs)"](q, k, v).astype(jnp.float32)
    got = calls["mask mod"](q, k, v).astype(jnp.float32)
    print(f"mask mod vs varlen: max |diff| {float(jnp.max(jnp.abs(got - ref))):.3g}")
    fwd, bwd = {}, {}
    for name, fn in calls.items():
        fwd[name] = jax.jit(fn)
        pullback = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1])(q, k, v)
        bwd[name] = (jax.jit(lambda pb, do: pb(do)), pullback)
    times = {(n, d): [] for n in calls for d in ("fwd", "bwd")}
    for _ in range(7):  # interleaved: clock drift lands in every median, not in the ratios
        for name in calls:
            times[(name, "fwd")].append(timed(fwd[name], (q, k, v)))
            apply, pullback = bwd[name]
            times[(name, "bwd")].append(timed(apply, (pullback, do)))
    bits_ms = statistics.median(timed(jax.jit(bits_only), (ids,)) for _ in range(7)) * 1e3
    print(f"flashjax.mask_bits alone ({mask_bits.mask_bits.__name__}): {bits_ms:.3f} ms (inside the 'mask mod' forward)")
    print(f"{'call':24s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd / varlen':>13s} {'bwd / varlen':>13s}")
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    for name in calls:
        print(f"{name:24s} {med[(name, 'fwd')]:8.3f} {med[(name, 'bwd')]:8.3f} "
              f"{med[(name, 'fwd')] / med[('varlen (same docs)', 'fwd')]:13.2f} "
              f"{med[(name, 'bwd')] / med[('varlen (same docs)', 'bwd')]:13.2f}")
    print("issue 38's target: mask mod within 1.15x of varlen, forward and backward")


if __name__ == "__main__":
    main()
