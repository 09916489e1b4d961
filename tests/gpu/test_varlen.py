"""Varlen (packed sequences) on the kernels against the reference: the sm80 forward (issue 37).

Random packings (N 1..64, lengths 0..2000 with many empty and tiny ones, q and k packed differently, seqused, GQA,
causal / windows, sinks, softcap, bf16 / fp16, odd head dims) from a fresh seed each run (FLASHJAX_VARLEN_SEED
fixes it); relative error by norm as tests/gpu/sweep.py measures it. Gradients run through the kernel path's VJP
(the reference's until a backward kernel takes varlen), dlse and dsinks included. Malformed offsets run under jit
(no Python check) and must give finite outputs and no crash.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import sweep

SEED = int(os.environ.get("FLASHJAX_VARLEN_SEED", np.random.SeedSequence().entropy % 2**31))
CASES = int(os.environ.get("FLASHJAX_VARLEN_N", 48))
print(f"test_varlen: seed {SEED} (FLASHJAX_VARLEN_SEED={SEED} repeats this run)")


def _lengths(rng, n):
    """Many empty and tiny sequences, some long ones (up to 2000)."""
    kind = rng.integers(0, 4, n)
    return np.where(kind == 0, 0, np.where(kind == 1, rng.integers(1, 9, n), rng.integers(1, 2001, n)))


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def random_varlen_config(rng):
    n = int(rng.integers(1, 65))
    # Bound the tokens so that the reference stays quick: at most ~16k per side.
    lengths_q = np.minimum(_lengths(rng, n), 16384 // n)
    decode = rng.random() < 0.2
    if decode:  # one query per sequence against long caches
        lengths_q = np.ones(n, np.int64)
    lengths_k = lengths_q.copy() if rng.random() < 0.4 else np.minimum(_lengths(rng, n), 16384 // n)
    hk = int(rng.choice([1, 2, 4]))
    hq = hk * int(rng.choice([1, 2, 4]))
    # The reference with max_seqlen hints pads every sequence to the longest: its scores are N x Hq x max_q x max_k
    # f32, several times over in the backward. Halve the lengths until that is ~256 MB, so that the suite's parallel
    # workers fit on one GPU (whole-sequence halving keeps the empty and the one-token ones as they are).
    while n * hq * max(lengths_q.max(), 1) * max(lengths_k.max(), 1) > 1 << 26:
        lengths_q, lengths_k = (np.where(x > 1, (x + 1) // 2, x) for x in (lengths_q, lengths_k))
    cfg = dict(
        lengths_q=lengths_q, lengths_k=lengths_k, hk=hk, hq=hq,
        d=int(rng.choice([8, 40, 64, 80, 96, 128, 160, 192, 256])),
        dtype=str(rng.choice(["bfloat16", "float16"])),
        causal=bool(rng.random() < 0.5), window=(-1, -1), sinks=bool(rng.random() < 0.3),
        softcap=float(rng.choice([0.0, 0.0, 0.0, 15.0])),
        padding_q=int(rng.choice([0, 0, 37])), padding_k=int(rng.choice([0, 0, 64])),
        seqused_q=bool(rng.random() < 0.25), seqused_k=bool(rng.random() < 0.35))
    if not cfg["causal"] and rng.random() < 0.3:
        cfg["window"] = (int(rng.integers(-1, 300)), int(rng.integers(-1, 300)))
    return cfg


def _inputs(cfg, rng):
    dtype = jnp.dtype(cfg["dtype"])
    tq = int(cfg["lengths_q"].sum()) + cfg["padding_q"]
    tk = int(cfg["lengths_k"].sum()) + cfg["padding_k"]
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = normal(tq, cfg["hq"], cfg["d"]).astype(dtype)
    k = normal(tk, cfg["hk"], cfg["d"]).astype(dtype)
    v = normal(tk, cfg["hk"], cfg["d"]).astype(dtype)
    extra = dict(
        cu_seqlens_q=jnp.asarray(_offsets(cfg["lengths_q"])), cu_seqlens_k=jnp.asarray(_offsets(cfg["lengths_k"])),
        seqused_q=jnp.asarray(rng.integers(0, cfg["lengths_q"] + 1), jnp.int32) if cfg["seqused_q"] else None,
        seqused_k=jnp.asarray(rng.integers(0, cfg["lengths_k"] + 1), jnp.int32) if cfg["seqused_k"] else None,
        sinks=normal(cfg["hq"]) if cfg["sinks"] else None)
    cotangents = (normal(tq, cfg["hq"], cfg["d"]).astype(dtype), normal(cfg["hq"], tq))
    return (q, k, v), extra, cotangents


def _run(cfg, qkv, extra, cotangents, backend):
    hints = dict(max_seqlen_q=int(max(cfg["lengths_q"].max(), 1)), max_seqlen_k=int(max(cfg["lengths_k"].max(), 1)))
    sinks = extra["sinks"]
    fixed = {key: val for key, val in extra.items() if key != "sinks"}

    def attention(q, k, v, sinks):
        return flashjax.flash_attn_varlen(q, k, v, **fixed, sinks=sinks, causal=cfg["causal"],
                                          window_size=cfg["window"], softcap=cfg["softcap"], return_lse=True,
                                          backend=backend, **hints)

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attention, q, k, v, sinks)
        return out, lse, vjp((d_out, jnp.where(jnp.isfinite(lse), d_lse, 0.0)))

    out, lse, grads = fwd_bwd(*qkv, sinks, *cotangents)  # sinks None: a pytree without leaves, its gradient None
    return out, lse, grads


def _compare(cfg, kernel, reference):
    out_k, lse_k, grads_k = kernel
    out_r, lse_r, grads_r = reference
    lse_k, lse_r = np.asarray(lse_k), np.asarray(lse_r)
    errors = {"out": sweep.rel_err(out_k, out_r)}
    same_inf = np.array_equal(np.isneginf(lse_k), np.isneginf(lse_r)) and not np.any(np.isnan(lse_k))
    finite = np.isfinite(lse_r)
    errors["lse"] = sweep.rel_err(lse_k[finite], lse_r[finite]) if same_inf else float("nan")
    for name, g_k, g_r in zip(("dq", "dk", "dv", "dsinks"), grads_k, grads_r):
        if g_r is not None:
            errors[name] = sweep.rel_err(g_k, g_r)
    return errors


@pytest.mark.parametrize("index", range(CASES))
def test_random_varlen_matches_reference(index):
    rng = np.random.default_rng([SEED, index])
    cfg = random_varlen_config(rng)
    qkv, extra, cotangents = _inputs(cfg, rng)
    kernel = _run(cfg, qkv, extra, cotangents, "kernel")
    reference = _run(cfg, qkv, extra, cotangents, "reference")
    errors = _compare(cfg, kernel, reference)
    tol = sweep.TOLERANCE[cfg["dtype"]]
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"seed {SEED}, index {index}: {bad} (config {cfg})"


MALFORMED = {
    "decreasing": [0, 40, 20, 90],
    "negative": [-50, 10, -3, 90],
    "past_the_end": [0, 30, 5000, 90],
    "not_from_zero": [17, 40, 60, 80],
    "int32_max": [0, 2**31 - 1, 2**31 - 1, 2**31 - 1],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("causal", [False, True])
def test_malformed_offsets_give_finite_outputs_under_jit(name, causal):
    rng = np.random.default_rng(SEED)
    q = jnp.asarray(rng.standard_normal((90, 4, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    offsets = jnp.asarray(MALFORMED[name], jnp.int32)
    seqused = jnp.asarray([2**31 - 1, -5, 7], jnp.int32)

    @jax.jit  # under jit the offsets are not concrete: nothing checks them in Python, the kernel clamps them
    def call(q, k, v, cu_q, cu_k, used):
        plain = flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, backend="kernel")
        used_too = flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, seqused_q=used, seqused_k=used, causal=causal,
                                              return_lse=True, backend="kernel")
        return plain, used_too

    for out, lse in call(q, k, v, offsets, offsets[::-1] if name == "decreasing" else offsets, seqused):
        out, lse = jax.block_until_ready((out, lse))
        assert np.all(np.isfinite(np.asarray(out, np.float32))), name
        assert not np.any(np.isnan(np.asarray(lse))) and not np.any(np.asarray(lse) == np.inf), name


def test_explain_says_the_sm80_family_runs_varlen():
    q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    text = flashjax.explain(q, k, k, cu, cu, causal=True)
    assert "sm80" in text and "varlen" in text, text
