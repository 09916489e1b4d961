"""Forward mode of varlen (packed sequences) on the kernels: jax.jvp, jax.linearize and jvp of grad of
flash_attn_varlen against the reference, with random tangents for q, k, v and sinks (issues 37 and 39).

The tangent runs on the sm80 tangent kernel (flashjax_tangent_varlen) on every GPU, over the batch's real blocks like
the forward; rows no sequence uses (padding tokens, rows past seqused) have a constant primal, so their tangents must
be exactly 0. The packings are test_varlen.py's (random and fixed); errors are sweep.jvp_errors' (relative by norm,
the tangents at twice the output tolerance). Malformed offsets under jit must give finite tangents, no crash.
"""
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import sweep
import test_varlen

SEED = test_varlen.SEED
CASES = int(os.environ.get("FLASHJAX_VARLEN_JVP_N", 24))


def _call(cfg, extra, backend):
    hints = dict(max_seqlen_q=int(max(cfg["lengths_q"].max(), 1)), max_seqlen_k=int(max(cfg["lengths_k"].max(), 1)))
    fixed = {key: val for key, val in extra.items() if key != "sinks"}

    def attention(q, k, v, sinks):
        return flashjax.flash_attn_varlen(q, k, v, **fixed, sinks=sinks, causal=cfg["causal"],
                                          window_size=cfg["window"], softcap=cfg["softcap"], return_lse=True,
                                          backend=backend, **hints)

    return attention


def _primals_and_tangents(cfg, rng):
    (q, k, v), extra, _ = test_varlen._inputs(cfg, rng)
    sinks = extra["sinks"]
    primals = (q, k, v, sinks)
    normal = lambda x: None if x is None else jnp.asarray(rng.standard_normal(x.shape), jnp.float32).astype(x.dtype)
    return primals, tuple(normal(x) for x in primals), extra


def _jvp(cfg, extra, primals, tangents, backend):
    attention = _call(cfg, extra, backend)
    return jax.jit(lambda p, t: jax.jvp(attention, p, t))(primals, tangents)


def _check_case(cfg, rng, where):
    primals, tangents, extra = _primals_and_tangents(cfg, rng)
    kernel = _jvp(cfg, extra, primals, tangents, "kernel")
    reference = _jvp(cfg, extra, primals, tangents, "reference")
    # sweep.jvp_errors reads t_lse as [rows, heads]: varlen's lse is [Hq, Tq].
    transpose = lambda r: ((r[0][0], r[0][1].T), (r[1][0], r[1][1].T))
    bad = sweep.jvp_errors(types.SimpleNamespace(dtype=cfg["dtype"]), transpose(kernel), transpose(reference))
    assert not bad, f"seed {SEED}, {where}: {bad} (config {cfg})"
    # Rows that no sequence uses: exactly zero tangents.
    used_q = None if extra["seqused_q"] is None else np.asarray(extra["seqused_q"])
    unused = test_varlen._unused_rows(cfg["lengths_q"], used_q, primals[0].shape[0])
    t_out, t_lse = kernel[1]
    assert np.all(np.asarray(t_out, np.float32)[unused] == 0), where
    assert np.all(np.asarray(t_lse)[:, unused] == 0), where


@pytest.mark.parametrize("index", range(CASES))
def test_random_varlen_jvp_matches_reference(index):
    rng = np.random.default_rng([SEED, 300_000 + index])
    _check_case(test_varlen.random_varlen_config(rng), rng, f"index {index}")


@pytest.mark.parametrize("name", sorted(test_varlen.FIXED))
def test_fixed_varlen_jvp_cases_match_reference(name):
    _check_case(test_varlen.FIXED[name], np.random.default_rng([SEED, 310_000]), name)


def test_varlen_jvp_lowers_to_the_tangent_kernel_and_explain_names_it():
    cfg = test_varlen.FIXED["sinks_dlse_softcap"]
    primals, tangents, extra = _primals_and_tangents(cfg, np.random.default_rng(SEED))
    attention = _call(cfg, extra, "kernel")
    text = jax.jit(lambda p, t: jax.jvp(attention, p, t)).lower(primals, tangents).as_text()
    assert "flashjax_tangent_varlen" in text
    q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    explained = flashjax.explain(q, k, k, cu, cu, causal=True)
    tangent = explained.split("tangent (jax.jvp): ", 1)[1]
    assert tangent.startswith("sm80 tangent kernel") and "varlen" in tangent, explained


def test_varlen_linearize_and_jvp_of_grad_match_the_reference():
    cfg = test_varlen.FIXED["causal_left_window"]
    rng = np.random.default_rng([SEED, 320_000])
    primals, tangents, extra = _primals_and_tangents(cfg, rng)
    primals, tangents = primals[:3], tangents[:3]  # no sinks in this case
    tol = sweep.TOLERANCE[cfg["dtype"]]

    def rel(got, want):
        return sweep.rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64))

    def out_only(backend):
        attention = _call(cfg, extra, backend)
        return lambda q, k, v: attention(q, k, v, None)[0]

    _, linear = jax.linearize(out_only("kernel"), *primals)
    want = jax.jvp(out_only("reference"), primals, tangents)[1]
    assert rel(jax.jit(linear)(*tangents), want) <= 2 * tol

    def hvp(backend):
        fn = out_only(backend)
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
        return jax.jit(lambda p, t: jax.jvp(jax.grad(loss, argnums=(0, 1, 2)), p, t)[1])(primals, tangents)

    for name, got, want in zip(("dq", "dk", "dv"), hvp("kernel"), hvp("reference")):
        assert rel(got, want) <= 4 * tol, name


@pytest.mark.parametrize("name", sorted(test_varlen.MALFORMED))
def test_malformed_offsets_give_finite_tangents_under_jit(name):
    rng = np.random.default_rng(SEED)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    primals = (normal(90, 4, 64), normal(120, 2, 64), normal(120, 2, 64),
               jnp.asarray(rng.standard_normal(4), jnp.float32))
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in primals)
    offsets = jnp.asarray(test_varlen.MALFORMED[name], jnp.int32)
    seqused = jnp.asarray([2**31 - 1, -5, 7], jnp.int32)

    @jax.jit  # not concrete: nothing checks the offsets in Python, the kernels clamp them
    def call(p, t, cu, used):
        fn = lambda q, k, v, s: flashjax.flash_attn_varlen(q, k, v, cu, cu[::-1] if name == "decreasing" else cu,
                                                           seqused_q=used, seqused_k=used, sinks=s, causal=True,
                                                           return_lse=True, backend="kernel")
        return jax.jvp(fn, p, t)

    (out, lse), (t_out, t_lse) = jax.block_until_ready(call(primals, tangents, offsets, seqused))
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(t_out, np.float32)))
    assert np.all(np.isfinite(np.asarray(t_lse))), name
