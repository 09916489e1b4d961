"""A short kernel run through JAX for compute-sanitizer's memcheck: fixed ragged configs, forward and backward, the
tangent (jax.jvp) of each, varlen forwards and backwards with well-formed and malformed offsets, and mask-mod forwards
and backwards with per-head bits (through the flashjax_*_mask_mod targets and their tile-class / block-list workspace).

Run as: compute-sanitizer --tool memcheck --kernel-name kns=flashjax python tests/gpu/sanitize.py
racecheck crashes on a JAX process; it and synccheck (and memcheck again) run on tests/sanitize's C++ driver,
which launches the same kernels with no Python or XLA (tools/device_check.sh sanitize runs both).
XLA_PYTHON_CLIENT_ALLOCATOR=platform makes every buffer its own allocation, so an out-of-bounds access is not
hidden inside a pooled block.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No autotuning and no CUDA-graph command buffers: the sanitizer should see plain launches of our kernels only.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import sweep  # noqa: E402

CONFIGS = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=77, seqlen_k=133, heads_q=4, heads_k=2, head_dim=64,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=200, seqlen_k=65, heads_q=2, heads_k=1, head_dim=128,
                 window_size=(16, 3), softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=300, heads_q=8, heads_k=1, head_dim=256, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=150, seqlen_k=0, heads_q=2, heads_k=2, head_dim=96, causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=129, seqlen_k=129, heads_q=4, heads_k=4, head_dim=192,
                 causal=True, window_size=(0, 0), sinks=True),
    # The sm90 backward's D 96 (128-key CTAs, dQ N = 48) and D 256 (64-key CTAs, one Q / dO stage, dQ in two slices).
    sweep.Config(dtype="float16", batch=1, seqlen_q=200, seqlen_k=77, heads_q=2, heads_k=2, head_dim=96,
                 window_size=(32, 7)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=130, seqlen_k=200, heads_q=4, heads_k=2, head_dim=256,
                 causal=True, softcap=5.0),
]

# Varlen forward + backward (issue 37): (cu_seqlens_q, cu_seqlens_k, seqused or None, Tq, Tk, head_dim, causal).
# Well-formed packings (empty and tiny sequences, q and k packed differently, decode, sequences over several KV
# blocks, padding tokens) and malformed offsets that the kernels clamp (decreasing, negative, past the end, not from
# zero, 2^31 - 1), run under jit where nothing checks them; the backward with sinks and an lse cotangent.
VARLEN = [
    ([0, 0, 3, 130, 131], [0, 5, 5, 300, 301], None, 140, 310, 64, True),
    ([0, 1, 2, 3], [0, 700, 1000, 2900], [1, 0, 1], 3, 3000, 128, False),
    ([0, 40, 20, 90], [90, 20, 40, 0], None, 90, 120, 256, True),
    ([-50, 10, -3, 90], [17, 40, 5000, 80], [2**31 - 1, -5, 7], 90, 120, 96, False),
    ([0, 2**31 - 1, 2**31 - 1, 2**31 - 1], [0, 2**31 - 1, 2**31 - 1, 2**31 - 1], None, 90, 120, 192, True),
    ([0, 300, 301, 700], [0, 260, 900, 901], [250, 1, 399], 750, 950, 128, True),
    ([17, 40, 60, 80], [0, 2**31 - 1, -7, 120], [3, 2**31 - 1, 0], 90, 120, 64, False),
]


def run_varlen():
    import jax
    import jax.numpy as jnp

    import flashjax

    failures = 0
    for i, (cu_q, cu_k, used, tq, tk, d, causal) in enumerate(VARLEN):
        rng = np.random.default_rng(100 + i)
        q = jnp.asarray(rng.standard_normal((tq, 4, d)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((tk, 2, d)), jnp.bfloat16) for _ in range(2))
        used = None if used is None else jnp.asarray(used, jnp.int32)
        d_out = jnp.asarray(rng.standard_normal((tq, 4, d)), jnp.bfloat16)
        sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)

        @jax.jit
        def call(q, k, v, sinks, a, b, u):
            fn = lambda q, k, v, s: flashjax.flash_attn_varlen(
                q, k, v, a, b, seqused_q=u, seqused_k=u, sinks=s, causal=causal, return_lse=True, backend="kernel")
            (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
            return out, lse, vjp((d_out, jnp.where(jnp.isfinite(lse), 0.5, 0.0)))

        out, lse, grads = call(q, k, v, sinks, jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32), used)
        finite = bool(np.all(np.isfinite(np.asarray(out, np.float32)))) and not np.any(np.isnan(np.asarray(lse)))
        finite = finite and all(bool(np.all(np.isfinite(np.asarray(g, np.float32)))) for g in grads)
        print(f"varlen {cu_q} / {cu_k} used {used} D{d}: {'ok' if finite else 'non-finite output or gradient'}")
        failures += not finite
    return failures


def run_tangents():
    """jax.jvp on the tangent kernel (issue 39) for each config, random tangents for q, k, v and sinks."""
    failures = 0
    for i, cfg in enumerate(CONFIGS):
        rng = np.random.default_rng(200 + i)
        primals, tangents = sweep.make_tangent_inputs(cfg, rng)
        bad = sweep.jvp_errors(cfg, sweep.run_jvp(cfg, primals, tangents, "kernel"),
                               sweep.run_jvp(cfg, primals, tangents, "reference"))
        print(f"jvp {cfg}: {'ok' if not bad else bad}")
        failures += bool(bad)
    return failures


# Mask mods (issue 38): (B, Sq, Sk, Hq, Hk, D, causal). Per-head bits under GQA, so that the sm90 backward's CTAs
# walk different query-block lists per head (some empty: head 0 sees no key), at both of its CTA shapes.
MASK_MODS = [
    (2, 300, 517, 8, 2, 64, True),
    (1, 517, 300, 4, 2, 256, False),
    (2, 1, 700, 6, 3, 128, False),
]


def run_mask_mods():
    import dataclasses

    import jax
    import jax.numpy as jnp

    import flashjax
    from flashjax.masks import MaskMod

    @dataclasses.dataclass(frozen=True)
    class HeadWindows(MaskMod):
        """Head 0 sees no key; head h > 0 the keys within 50 h of the query position."""

        def __call__(self, b, h, q_idx, kv_idx):
            return (h > 0) & (kv_idx <= q_idx + 50 * h) & (kv_idx + 50 * h >= q_idx)

    failures = 0
    for i, (b, sq, sk, hq, hk, d, causal) in enumerate(MASK_MODS):
        rng = np.random.default_rng(300 + i)
        q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, sk, hk, d)), jnp.bfloat16) for _ in range(2))
        d_out = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.bfloat16)

        def call(backend, q, k, v):
            fn = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=causal, mask_mod=HeadWindows(), backend=backend)
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(d_out.astype(out.dtype)))

        kernel = jax.jit(lambda q, k, v: call("kernel", q, k, v))(q, k, v)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        reference = jax.jit(lambda q, k, v: call("reference", q, k, v))(*f32)
        finite = all(bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in kernel)
        errors = [sweep.rel_err(a, r) for a, r in zip(kernel, reference)]
        ok = finite and max(errors) < 2e-2
        print(f"mask mod B{b} Sq{sq} Sk{sk} H{hq}/{hk} D{d} causal={causal}: "
              f"{'ok' if ok else f'finite {finite}, errors {errors}'}")
        failures += not ok
    return failures


def main():
    failures = run_varlen() + run_tangents() + run_mask_mods()
    for i, cfg in enumerate(CONFIGS):
        rng = np.random.default_rng(i)
        inputs = sweep.make_inputs(cfg, rng)
        kernel = sweep.run(cfg, inputs, "kernel")
        bad = sweep.check(cfg, sweep.compare(cfg, kernel, sweep.run(cfg, inputs, "reference")))
        print(f"{cfg}: {'ok' if not bad else bad}")
        failures += bool(bad)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
