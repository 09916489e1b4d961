"""Issue 38's timings on one GPU, same process per case: forward and backward (the pullback alone) of a mask mod on
the kernels against the call whose cost it should match. Interleaved trials, median of 7, each trial >= 20 ms
(docs/design.md §6's method, in small). Cases (--cases, default all):
  docs4k    B 4, S 4096, H 16, D 128, causal, a document mask of 16 equal documents, against flash_attn_varlen over
            the same documents (the cost the visible tokens imply; bar <= 1.15x both ways) and the causal call
  docs16k   the same at B 1, S 16384 (16 documents of 1024 tokens)
  prefix    B 4, S 4096, prefix_lm_mask(1024) (causal after a 1024-token prefix every query sees) against the native
            causal call (bar: mod >= 0.9x native's speed, time ratio <= 1.11; the prefix adds 1024^2 / 2 pairs, 6% of
            causal's 4096^2 / 2)
  window    B 1, S 16384, sliding_window_mask(1024) against the native window_size=(1024, 0) band (bar as prefix)
Prints one table per case and, for docs4k, the mask-bits kernel alone."""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

H, D = 16, 128


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


def inputs(B, S, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(4))


def document_calls(B, S, docs):
    ids = jnp.asarray(np.repeat(np.arange(docs, dtype=np.int32), S // docs)[None].repeat(B, 0))
    mod = flashjax.document_mask(ids)
    cu = jnp.arange(0, B * S + 1, S // docs, dtype=jnp.int32)  # the same documents, packed

    def varlen(q, k, v):
        out = flashjax.flash_attn_varlen(q.reshape(B * S, H, D), k.reshape(B * S, H, D), v.reshape(B * S, H, D), cu,
                                         cu, max_seqlen_q=S // docs, max_seqlen_k=S // docs, causal=True,
                                         backend="kernel")
        return out.reshape(B, S, H, D)

    calls = {"document mask mod": lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, mask_mod=mod,
                                                                      backend="kernel"),
             "causal, no mask": lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel"),
             "varlen (same docs)": varlen}
    return calls, "varlen (same docs)", mod, ids


def run_case(name, B, S, calls, baseline, mod, same_mask=True):
    q, k, v, do = inputs(B, S)
    print(f"\n=== {name}: B {B}, S {S}, H {H}, D {D}")
    print(flashjax.explain(q, k, v, causal=True, mask_mod=mod))
    first = next(iter(calls))
    if same_mask:  # the two calls see the same pairs: their outputs agree to rounding
        ref = calls[baseline](q, k, v).astype(jnp.float32)
        got = calls[first](q, k, v).astype(jnp.float32)
        print(f"{first} vs {baseline}: max |diff| {float(jnp.max(jnp.abs(got - ref))):.3g}")
    fwd, bwd = {}, {}
    for label, fn in calls.items():
        fwd[label] = jax.jit(fn)
        pullback = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1])(q, k, v)
        bwd[label] = (jax.jit(lambda pb, do: pb(do)), pullback)
    times = {(n, d): [] for n in calls for d in ("fwd", "bwd")}
    for _ in range(7):  # interleaved: clock drift lands in every median, not in the ratios
        for label in calls:
            times[(label, "fwd")].append(timed(fwd[label], (q, k, v)))
            apply, pullback = bwd[label]
            times[(label, "bwd")].append(timed(apply, (pullback, do)))
    med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    print(f"{'call':28s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd / base':>11s} {'bwd / base':>11s}   (base: {baseline})")
    for label in calls:
        print(f"{label:28s} {med[(label, 'fwd')]:8.3f} {med[(label, 'bwd')]:8.3f} "
              f"{med[(label, 'fwd')] / med[(baseline, 'fwd')]:11.2f} "
              f"{med[(label, 'bwd')] / med[(baseline, 'bwd')]:11.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="docs4k,docs16k,prefix,window")
    cases = parser.parse_args().cases.split(",")
    if "docs4k" in cases:
        B, S = 4, 4096
        calls, base, mod, ids = document_calls(B, S, 16)
        from flashjax import mask_bits

        def bits_only(ids):
            return mask_bits.mask_bits(flashjax.document_mask(ids), batch=B, heads=H, seqlen_q=S, seqlen_k=S)

        run_case("docs4k", B, S, calls, base, mod)
        bits_ms = statistics.median(timed(jax.jit(bits_only), (ids,)) for _ in range(7)) * 1e3
        print(f"flashjax.mask_bits alone: {bits_ms:.3f} ms (inside the mask mod's forward)")
    if "docs16k" in cases:
        calls, base, mod, _ = document_calls(1, 16384, 16)
        run_case("docs16k", 1, 16384, calls, base, mod)
    if "prefix" in cases:
        mod = flashjax.prefix_lm_mask(jnp.full((4,), 1024, jnp.int32))
        calls = {"prefix-LM mod": lambda q, k, v: flashjax.flash_attn(q, k, v, mask_mod=mod, backend="kernel"),
                 "native causal": lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel")}
        run_case("prefix", 4, 4096, calls, "native causal", mod, same_mask=False)
    if "window" in cases:
        mod = flashjax.sliding_window_mask(1024, 0)
        calls = {"sliding-window mod": lambda q, k, v: flashjax.flash_attn(q, k, v, mask_mod=mod, backend="kernel"),
                 "native window (1024, 0)": lambda q, k, v: flashjax.flash_attn(q, k, v, window_size=(1024, 0),
                                                                                 backend="kernel")}
        run_case("window", 1, 16384, calls, "native window (1024, 0)", mod)
    print("\nissue 38's bars: document mod <= 1.15x varlen both ways; prefix-LM and window mods >= 0.9x native")


if __name__ == "__main__":
    main()
