"""Forward mode on the kernels (issue 39): jax.jvp, jax.linearize, jax.jacfwd, jvp of grad and vmap of jvp of
flash_attn against the reference, with random tangents for every input (sinks included).

Plain jax.jvp runs the fused pass (flashjax_jvp: out, lse and their tangents in one sm90 kernel) on Hopper at D <= 128
for dense calls; elsewhere, and under jax.linearize / jax.grad, the forward and then the tangent (flashjax_tangent),
which runs on the sm90 tangent kernel on Hopper (the sm80 one with FLASHJAX_DISABLE_FAMILIES=sm90) and on the sm80 one
on every other GPU. The sweep and the cases below go through plain jax.jvp, so they test the fused kernel where it
exists; the jvp of the backward (forward over reverse)
takes its primal from the backward kernel and its tangent from the reference backward's JVP
(primitives._bwd_jvp). Errors are relative by norm against the f32 reference on the same rounded inputs; the
tangents get the gradients' tolerance (twice the forward's, docs/design.md §5), jvp of grad four times it.
"""
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import primitives
import sweep

SEED = int(os.environ.get("FLASHJAX_SWEEP_SEED", np.random.SeedSequence().entropy % 2**32))
N = int(os.environ.get("FLASHJAX_JVP_SWEEP_N", "48"))


def test_jvp_sweep_seed_is_reported():
    print(f"FLASHJAX_SWEEP_SEED={SEED}")


def _assert_jvp_matches(cfg, rng, where, sinks_value=None, skip_lse_heads=()):
    primals, tangents = sweep.make_tangent_inputs(cfg, rng, sinks_value)
    bad = sweep.jvp_errors(cfg, sweep.run_jvp(cfg, primals, tangents, "kernel"),
                           sweep.run_jvp(cfg, primals, tangents, "reference"), skip_lse_heads)
    assert not bad, f"{cfg} ({where}): {bad}"


@pytest.mark.parametrize("index", range(N))
def test_jvp_sweep(index):
    rng = np.random.default_rng([SEED, 200_000 + index])
    _assert_jvp_matches(sweep.random_config(rng), rng, f"seed {SEED}, index {index}")


def _case(dtype="bfloat16", b=2, sq=300, sk=517, hq=4, hk=2, d=128, **kw):
    return sweep.Config(dtype=dtype, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk, head_dim=d, **kw)


# Each feature of the forward at least once, in both dtypes, at every compiled width: causal (bottom-right, Sq > Sk
# so that the first rows see no key), two-sided windows (narrow enough to empty rows, and wide), GQA and MQA, softcap,
# sinks, Dv != D, ragged lengths (never a multiple of the tiles), several KV blocks per tile and a single row.
JVP_CASES = [
    _case(d=64, causal=True),
    _case(dtype="float16", d=64, sq=700, sk=200, causal=True, sinks=True),
    _case(d=96, hq=8, hk=1, window_size=(37, 11)),
    _case(dtype="float16", d=128, sq=1000, sk=1000, window_size=(3, 0)),
    _case(d=128, sq=517, sk=300, hq=8, hk=8, softcap=5.0),
    _case(dtype="float16", d=128, hq=6, hk=3, softcap=30.0, sinks=True, causal=True),
    _case(d=192, sq=260, sk=1100, sinks=True),
    _case(dtype="float16", d=192, causal=True, window_size=(100, -1)),
    _case(d=256, sq=333, sk=333, causal=True, softcap=5.0),
    _case(dtype="float16", d=256, sq=129, sk=2100, hq=8, hk=2, sinks=True),
    _case(d=40, b=3, sq=1, sk=4000, hq=8, hk=1),
    _case(dtype="float16", d=72, sq=65, sk=63, window_size=(0, 0), sinks=True),
    _case(d=128, head_dim_v=64, sq=300, sk=300, causal=True),
    _case(dtype="float16", d=64, sq=0, sk=100),
    _case(d=64, sq=100, sk=0, sinks=True),
]


@pytest.mark.parametrize("cfg", JVP_CASES, ids=str)
def test_jvp_cases(cfg):
    rng = np.random.default_rng([SEED, 210_000 + JVP_CASES.index(cfg)])
    _assert_jvp_matches(cfg, rng, f"seed {SEED}")


SPECIAL_SINK_CASES = [
    _case(d=128, sq=700, sk=200, causal=True, sinks=True),
    _case(dtype="float16", d=64, sq=300, sk=300, window_size=(50, 0), sinks=True),
]


@pytest.mark.parametrize("kind", ["-inf", "+inf", "nan"])
@pytest.mark.parametrize("cfg", SPECIAL_SINK_CASES, ids=str)
def test_jvp_with_special_sinks(cfg, kind):
    """Head 1's sink is -inf (no sink), +inf (all the weight: t_out 0, t_lse = its tangent) or NaN (design §2.4),
    traced under jit. A NaN sink's t_lse is left out: the kernel path's lse of that head is the sink itself
    (api._lse_of_special_sinks), so its tangent is the sink's, where the reference's is NaN."""
    rng = np.random.default_rng([SEED, 220_000 + SPECIAL_SINK_CASES.index(cfg)])
    value = {"-inf": -np.inf, "+inf": np.inf, "nan": np.nan}[kind]
    _assert_jvp_matches(cfg, rng, f"seed {SEED}, sink {kind}", sinks_value=value,
                        skip_lse_heads=(1,) if kind == "nan" else ())


def _small(seed, dtype=jnp.bfloat16, b=1, sq=13, sk=21, hq=4, hk=2, d=16):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), dtype)
                 for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))


def _hopper():
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def _rel(got, want):
    return sweep.rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64))


def _sm90_enabled():
    return _hopper() and "sm90" not in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "")


def _fused_jvp_expected(d):
    """Whether plain jax.jvp lowers to the fused kernel (primitives.fused_jvp_enabled: D <= 64 unless
    FLASHJAX_FUSED_JVP says otherwise; the sm90 kernel has D <= 128)."""
    return _sm90_enabled() and d <= 128 and primitives.fused_jvp_enabled(d)


def test_the_jvp_lowers_to_the_tangent_kernel_and_explain_names_it():
    # jax.linearize never fuses: its tangent is the tangent kernel's, on Hopper the sm90 one.
    q, k, v = _small(0, sq=300, sk=300, d=128)
    f = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel")
    text = jax.jit(lambda p, t: jax.linearize(f, *p)[1](*t)).lower((q, k, v), (q, k, v)).as_text()
    assert "flashjax_tangent" in text and "flashjax_jvp" not in text
    explained = flashjax.explain(q, k, v, causal=True)
    # Hopper: the sm90 tangent kernel (unless FLASHJAX_DISABLE_FAMILIES=sm90); every other GPU: the sm80 one.
    family = "sm90" if _sm90_enabled() else "sm80"
    assert re.search(rf"tangent \(jax\.jvp\): {family} tangent kernel", explained), explained
    if _sm90_enabled():
        assert re.search(r"fused jvp \(plain jax\.jvp\): sm90 fused jvp kernel", explained), explained


FUSED_CASES = [_case(d=d, sq=sq, sk=sk, causal=causal, **kw)
               for d in (64, 96, 128, 256) for causal in (False, True)
               for sq, sk, kw in ((333, 517, {}), (517, 300, {"sinks": True, "softcap": 5.0}))]


@pytest.mark.parametrize("cfg", FUSED_CASES, ids=str)
def test_plain_jvp_runs_the_fused_kernel_at_d_up_to_128(cfg, monkeypatch):
    """With FLASHJAX_FUSED_JVP=1, plain jax.jvp lowers to flashjax_jvp on Hopper at D 64/96/128 and to flashjax_fwd +
    flashjax_tangent at D 256 (and everywhere off Hopper); either way it matches the reference."""
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "1")
    rng = np.random.default_rng([SEED, 240_000 + FUSED_CASES.index(cfg)])
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    p = tuple(x for x in primals if x is not None)
    t = tuple(x for x in tangents if x is not None)
    f = sweep.attention(cfg, "kernel")
    g = (lambda *a: f(*a)) if len(p) == 4 else (lambda q, k, v: f(q, k, v, None))
    text = jax.jit(lambda p, t: jax.jvp(g, p, t)).lower(p, t).as_text()
    if _fused_jvp_expected(cfg.head_dim):
        assert "flashjax_jvp" in text and "flashjax_tangent" not in text and "@flashjax_fwd" not in text
    else:
        assert "flashjax_tangent" in text and "flashjax_jvp" not in text
    _assert_jvp_matches(cfg, np.random.default_rng([SEED, 240_000 + FUSED_CASES.index(cfg)]), f"seed {SEED}")


@pytest.mark.parametrize("d", [64, 128])
def test_plain_jvp_fuses_by_default_where_it_is_faster(d, monkeypatch):
    """Unset, FLASHJAX_FUSED_JVP fuses at D <= 64 only (the fused pass measured slower than the pair at D 128)."""
    monkeypatch.delenv("FLASHJAX_FUSED_JVP", raising=False)
    q, k, v = _small(4, sq=300, sk=300, d=d)
    f = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel")
    text = jax.jit(lambda p, t: jax.jvp(f, p, t)).lower((q, k, v), (q, k, v)).as_text()
    fused = _sm90_enabled() and d <= 64
    assert ("flashjax_jvp" in text) == fused and ("flashjax_tangent" in text) == (not fused), text[-2000:]


@pytest.mark.parametrize("cfg", [_case(d=64, sq=400, sk=700, hq=8, hk=2, causal=True, sinks=True),
                                 _case(dtype="float16", d=128, sq=777, sk=513, softcap=20.0, window_size=(90, 7))],
                         ids=str)
def test_fused_jvp_agrees_with_forward_then_tangent(cfg, monkeypatch):
    """The fused pass against the pair it replaces (FLASHJAX_FUSED_JVP=0), same inputs: out and lse as the forward
    writes them, the tangents within the tangents' tolerance."""
    rng = np.random.default_rng([SEED, 250_000])
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "1")  # D 128 fuses only when asked
    fused = sweep.run_jvp(cfg, primals, tangents, "kernel")
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "0")
    pair = sweep.run_jvp(cfg, primals, tangents, "kernel")
    tol = sweep.TOLERANCE[cfg.dtype]
    (out_f, lse_f), (t_out_f, t_lse_f) = fused
    (out_p, lse_p), (t_out_p, t_lse_p) = pair
    assert _rel(out_f, out_p) <= tol and _rel(t_out_f, t_out_p) <= 2 * tol
    finite = np.isfinite(np.asarray(lse_p))
    assert np.array_equal(np.isfinite(np.asarray(lse_f)), finite)
    assert _rel(np.asarray(lse_f)[finite], np.asarray(lse_p)[finite]) <= tol
    assert _rel(t_lse_f, t_lse_p) <= 2 * tol


def test_linearize_matches_jvp(monkeypatch):
    """jax.linearize runs the forward and the tangent kernel: equal to jax.jvp's pair, and within the tangents'
    tolerance of jax.jvp's fused pass (which rounds out once, not before t_out's correction)."""
    q, k, v = _small(1, sq=200, sk=300, d=64)
    t = _small(2, sq=200, sk=300, d=64)
    f = lambda q, k, v: flashjax.flash_attn(q, k, v, window_size=(40, 3), backend="kernel")
    _, f_lin = jax.linearize(f, q, k, v)
    t_lin = jax.jit(f_lin)(*t)
    _, t_fused = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), t)
    assert _rel(t_lin, t_fused) <= 2 * sweep.TOLERANCE["bfloat16"]
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "0")
    _, t_pair = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), t)
    assert _rel(t_lin, t_pair) <= 1e-6


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_jacfwd_of_small_shapes_matches_the_reference(dtype):
    q, k, v = _small(3, dtype=dtype, sq=5, sk=7, hq=2, hk=1, d=8)
    sinks = jnp.asarray([0.3, -1.0], jnp.float32)
    tol = 2 * sweep.TOLERANCE[jnp.dtype(dtype).name]

    def jac(backend, *args):
        f = lambda q, k, v, s: flashjax.flash_attn(q, k, v, causal=True, sinks=s, softcap=5.0, backend=backend)
        return jax.jacfwd(f, argnums=(0, 1, 2, 3))(*args)

    got = jac("kernel", q, k, v, sinks)
    want = jac("reference", *(x.astype(jnp.float32) for x in (q, k, v)), sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert _rel(g, w) <= tol, name


@pytest.mark.parametrize("cfg", [_case(d=64, sq=200, sk=300, causal=True, sinks=True),
                                 _case(dtype="float16", d=128, sq=150, sk=150, hq=4, hk=1, softcap=5.0,
                                       window_size=(30, 30), sinks=True)], ids=str)
def test_jvp_of_grad_matches_the_reference(cfg):
    """Forward over reverse (Hessian-vector products) in q, k, v and sinks, with cotangents on out and lse."""
    rng = np.random.default_rng([SEED, 230_000])
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    _, _, _, _, d_out, d_lse = sweep.make_inputs(cfg, rng)

    def hvp(backend, primals, tangents):
        f = sweep.attention(cfg, backend)

        def loss(*args):
            out, lse = f(*args)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)) + jnp.sum(
                jnp.where(jnp.isfinite(lse), lse * d_lse, 0.0))

        return jax.jit(lambda p, t: jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), p, t)[1])(primals, tangents)

    got = hvp("kernel", primals, tangents)
    cast = lambda xs: tuple(x.astype(jnp.float32) for x in xs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hvp("reference", cast(primals), cast(tangents))
    tol = 4 * sweep.TOLERANCE[cfg.dtype]
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert _rel(g, w) <= tol, f"{cfg}: {name} {_rel(g, w):.3g} > {tol:g}"


def test_vmap_of_jvp_matches_each_jvp():
    q, k, v = _small(4, sq=120, sk=130, d=64)
    rng = np.random.default_rng(5)
    tqs = jnp.asarray(rng.standard_normal((3,) + q.shape), q.dtype)
    tk, tv = _small(6, sq=120, sk=130, d=64)[1:]
    sinks = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32)
    tss = jnp.asarray(rng.standard_normal((3, q.shape[2])), jnp.float32)
    f = lambda q, k, v, s: flashjax.flash_attn(q, k, v, causal=True, sinks=s, return_lse=True, backend="kernel")
    one = jax.jit(lambda tq, ts: jax.jvp(f, (q, k, v, sinks), (tq, tk, tv, ts))[1])
    batched = jax.jit(jax.vmap(one))(tqs, tss)
    for i in range(3):
        t_out, t_lse = one(tqs[i], tss[i])
        assert _rel(batched[0][i], t_out) <= 1e-6 and _rel(batched[1][i], t_lse) <= 1e-6
