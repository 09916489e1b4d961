"""The fused jvp primitive (flashjax_jvp: out, lse, t_out, t_lse in one pass) and where it may appear, on CPU.

The primitive structure is backend independent: off CUDA every primitive lowers to the reference, so these tests check
the rules the kernel path uses. jax.jvp must bind the fused pass; jax.linearize and jax.grad, whose tangents are
unknown under partial evaluation, must keep a known forward (flashjax_fwd) and an unknown tangent (flashjax_tangent,
which the transpose rule turns into the backward). Numbers are checked against plain autodiff of the reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import primitives, reference

B, SQ, SK, HQ, HK, D = 2, 7, 11, 4, 2, 16


def _inputs(seed):
    rng = np.random.default_rng(seed)
    shapes = [(B, SQ, HQ, D), (B, SK, HK, D), (B, SK, HK, D), (HQ,)]
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _params(has_sinks=True, window=(4, 0), softcap=0.0):
    return dict(softmax_scale=0.31, softcap=softcap, window_left=window[0], window_right=window[1],
                has_sinks=has_sinks)


def _kernel(params):
    return lambda q, k, v, s: primitives.forward(q, k, v, s, **params)


def _reference(params):
    def f(q, k, v, s):
        return reference.attention(q, k, v, softmax_scale=params["softmax_scale"], causal=False,
                                   window_size=(params["window_left"], params["window_right"]),
                                   sinks=s if params["has_sinks"] else None, softcap=params["softcap"],
                                   mask_mod=None)
    return f


def _names(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _names(sub)
    return names


def _close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        finite = jnp.isfinite(w)
        np.testing.assert_array_equal(jnp.isfinite(g), finite)  # empty rows: lse = -inf on both sides
        np.testing.assert_allclose(jnp.where(finite, g, 0), jnp.where(finite, w, 0), rtol=tol, atol=tol)


@pytest.mark.parametrize("seed,has_sinks,window,softcap",
                         [(0, True, (4, 0), 0.0), (1, False, (-1, -1), 0.0), (2, True, (2, 1), 3.0),
                          (3, False, (-1, 0), 2.0)])
def test_jvp_binds_the_fused_pass_and_matches_reference(seed, has_sinks, window, softcap):
    params = _params(has_sinks, window, softcap)
    args, tangents = _inputs(seed), _inputs(seed + 50)
    f = _kernel(params)
    assert _names(jax.make_jaxpr(lambda *t: jax.jvp(f, args, t))(*tangents).jaxpr) == {"flashjax_jvp"}
    _close(jax.jit(lambda *t: jax.jvp(f, args, t))(*tangents), jax.jvp(_reference(params), args, tangents))


def test_linearize_splits_into_known_forward_and_unknown_tangent():
    params = _params()
    args, tangents = _inputs(4), _inputs(5)
    f = _kernel(params)
    # The primal computation: the forward alone (known); the linear map: the tangent alone (unknown inputs).
    primal_names = _names(jax.make_jaxpr(lambda *a: jax.linearize(f, *a)[0])(*args).jaxpr)
    assert "flashjax_fwd" in primal_names and "flashjax_jvp" not in primal_names
    out, f_lin = jax.linearize(f, *args)
    assert _names(jax.make_jaxpr(f_lin)(*tangents).jaxpr) == {"flashjax_tangent"}
    want_out, want_t = jax.jvp(_reference(params), args, tangents)
    _close(out, want_out)
    _close(f_lin(*tangents), want_t)


@pytest.mark.parametrize("wrt", [(0, 1, 2, 3), (1,), (3,)])
def test_grad_never_sees_the_fused_pass(wrt):
    params = _params()
    args = _inputs(6)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal((B, SQ, HQ, D)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] * ct) + jnp.sum(jnp.where(jnp.isfinite(l := f(*a)[1]), l, 0))
    grad = jax.grad(loss(_kernel(params)), argnums=wrt)
    names = _names(jax.make_jaxpr(grad)(*args).jaxpr)
    assert {"flashjax_fwd", "flashjax_bwd"} <= names and not {"flashjax_jvp", "flashjax_tangent"} & names
    _close(jax.jit(grad)(*args), jax.grad(loss(_reference(params)), argnums=wrt)(*args))


def test_jvp_with_some_tangents_zero_and_of_a_closed_over_primal():
    # Symbolic zero tangents are instantiated; a primal not differentiated is a constant of the fused pass.
    params = _params(window=(-1, -1))
    q, k, v, s = _inputs(8)
    tq = _inputs(9)[0]
    f = lambda q: primitives.forward(q, k, v, s, **params)
    g = lambda q: _reference(params)(q, k, v, s)
    assert "flashjax_jvp" in _names(jax.make_jaxpr(lambda t: jax.jvp(f, (q,), (t,)))(tq).jaxpr)
    _close(jax.jvp(f, (q,), (tq,)), jax.jvp(g, (q,), (tq,)))


@pytest.mark.parametrize("sink_axis", [None, 0])
def test_vmap_of_jvp_over_tangents_runs_the_forward_once(sink_axis):
    # Only the tangents mapped (jax.jacfwd's shape): the primal outputs stay unmapped, so the forward runs once and the
    # tangent pass takes the mapped tangents (folded into the batch; a mapped sink tangent per example, lax.map).
    params = _params()
    args = _inputs(10)
    ts = [_inputs(11 + i) for i in range(3)]
    stacked = [jnp.stack([t[i] for t in ts]) for i in range(4)]
    if sink_axis is None:
        stacked[3] = ts[0][3]
    in_axes = (0, 0, 0, sink_axis)
    run = lambda f: jax.vmap(lambda *t: jax.jvp(f, args, t), in_axes=in_axes, out_axes=(None, 0))(*stacked)
    names = _names(jax.make_jaxpr(lambda *t: jax.vmap(
        lambda *u: jax.jvp(_kernel(params), args, u), in_axes=in_axes, out_axes=(None, 0))(*t))(*stacked).jaxpr)
    assert "flashjax_tangent" in names and "flashjax_jvp" not in names, names
    _close(run(_kernel(params)), run(_reference(params)))


def test_vmap_of_jvp_over_primals_and_tangents_folds_the_fused_pass():
    params = _params(has_sinks=False)
    examples = [_inputs(20 + i) for i in range(2)]
    tangents = [_inputs(30 + i) for i in range(2)]
    primals = [jnp.stack([e[i] for e in examples]) for i in range(3)] + [examples[0][3]]
    tstack = [jnp.stack([t[i] for t in tangents]) for i in range(3)] + [tangents[0][3]]
    in_axes = ((0, 0, 0, None), (0, 0, 0, None))
    run = lambda f: jax.vmap(lambda p, t: jax.jvp(f, p, t), in_axes=in_axes)(tuple(primals), tuple(tstack))
    names = _names(jax.make_jaxpr(lambda p, t: jax.vmap(lambda a, b: jax.jvp(_kernel(params), a, b),
                                                        in_axes=in_axes)(p, t))(tuple(primals), tuple(tstack)).jaxpr)
    assert "flashjax_jvp" in names, names
    _close(run(_kernel(params)), run(_reference(params)))


def test_jacfwd_matches_reference():
    params = _params(window=(-1, 0), softcap=3.0)
    rng = np.random.default_rng(40)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 3, 2, 4)), jnp.float32) for _ in range(3))
    s = jnp.asarray([0.3, -1.0], jnp.float32)
    kernel = lambda q, k, v, s: primitives.forward(q, k, v, s, **params)[0]
    reference_fn = lambda q, k, v, s: _reference(params)(q, k, v, s)[0]
    _close(jax.jacfwd(kernel, argnums=(0, 1, 2, 3))(q, k, v, s),
           jax.jacfwd(reference_fn, argnums=(0, 1, 2, 3))(q, k, v, s))


def test_jvp_of_grad_keeps_the_backward_and_matches_reference():
    params = _params(softcap=2.5)
    args, tangents = _inputs(12), _inputs(13)
    ct = jnp.asarray(np.random.default_rng(14).standard_normal((B, SQ, HQ, D)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] * ct)
    got = jax.jvp(jax.grad(loss(_kernel(params)), argnums=(0, 1, 2, 3)), args, tangents)
    want = jax.jvp(jax.grad(loss(_reference(params)), argnums=(0, 1, 2, 3)), args, tangents)
    _close(got, want, tol=2e-4)


def test_fused_pass_off_by_switch(monkeypatch):
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "0")
    params = _params()
    args, tangents = _inputs(15), _inputs(16)
    names = _names(jax.make_jaxpr(lambda *t: jax.jvp(_kernel(params), args, t))(*tangents).jaxpr)
    assert {"flashjax_fwd", "flashjax_tangent"} <= names and "flashjax_jvp" not in names


def test_export_of_jvp_round_trips():
    params = _params()
    args, tangents = _inputs(17), _inputs(18)
    fn = jax.jit(lambda a, t: jax.jvp(_kernel(params), a, t))
    exported = jax.export.export(fn)(args, tangents)
    restored = jax.export.deserialize(exported.serialize())
    _close(restored.call(args, tangents), jax.jvp(_reference(params), args, tangents))
