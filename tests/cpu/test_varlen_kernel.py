"""The varlen kernel path's plumbing (python/flashjax/varlen_kernel.py) without a GPU: the CUDA lowering's FFI call
(target, operands), the gradients through the bwd_varlen primitive (the lse cotangent left out when it is zero), and off
CUDA both primitives on the reference, values and gradients. The backward's FFI call and workspace need the library's
plan: tests/cpu/test_library.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import reference, varlen_kernel

HQ, HK, D = 4, 2, 16
CU_Q = np.array([0, 3, 3, 10], np.int32)
CU_K = np.array([0, 5, 6, 14], np.int32)
PARAMS = dict(softmax_scale=0.3, softcap=0.0, window_left=-1, window_right=0)


def _inputs(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = [(11, HQ, D), (15, HK, D), (15, HK, D), (HQ,)]
    return tuple(jnp.asarray(rng.standard_normal(s), dtype if len(s) == 3 else jnp.float32) for s in shapes)


def _reference(q, k, v, sinks, seqused_q=None, seqused_k=None):
    return reference.attention_varlen(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), seqused_q=seqused_q,
                                      seqused_k=seqused_k, softmax_scale=0.3, causal=True, window_size=(-1, -1),
                                      sinks=sinks, softcap=0.0, mask_mod=None)


@pytest.mark.parametrize("seqused", [False, True])
def test_off_cuda_the_primitive_is_the_reference_with_its_gradients(seqused):
    q, k, v, sinks = _inputs(0)
    used_q = jnp.array([2, 0, 7], jnp.int32) if seqused else None
    used_k = jnp.array([5, 1, 3], jnp.int32) if seqused else None

    def loss(fn):
        def f(q, k, v, sinks):
            out, lse = fn(q, k, v, sinks)
            return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return f

    kernel_path = lambda q, k, v, s: varlen_kernel.attention(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), used_q,
                                                             used_k, s, **PARAMS)
    reference_path = lambda q, k, v, s: _reference(q, k, v, s, used_q, used_k)
    for got, want in zip(kernel_path(q, k, v, sinks), reference_path(q, k, v, sinks)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got = jax.grad(loss(kernel_path), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(loss(reference_path), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seqused,has_sinks", [(False, False), (True, True)])
def test_cuda_lowering_calls_the_varlen_target_with_only_present_operands(monkeypatch, seqused, has_sinks):
    monkeypatch.setattr(varlen_kernel._ffi, "register_targets", lambda: None)  # registration is for compiling only
    q, k, v, sinks = _inputs(1, jnp.bfloat16)
    used = jnp.array([1, 0, 2], jnp.int32) if seqused else None

    def fn(q, k, v, cu_q, cu_k):
        return varlen_kernel.attention(q, k, v, cu_q, cu_k, used, used, sinks if has_sinks else None, **PARAMS)

    text = jax.jit(fn).trace(q, k, v, CU_Q, CU_K).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @flashjax_" in line]
    assert len(calls) == 1 and "@flashjax_fwd_varlen(" in calls[0]
    operands = calls[0].split("(", 1)[1].split(")", 1)[0].split(",")
    assert len(operands) == 5 + 2 * seqused + has_sinks
    # The results: o like q, lse [Hq, Tq]; the token counts are the only sizes (no compile depends on the packing).
    assert "tensor<11x4x16xbf16>" in calls[0] and "tensor<4x11xf32>" in calls[0]


def test_the_gradients_take_the_max_seqlen_hints(monkeypatch):
    """bwd_varlen's reference lowering computes per sequence when given the hints, as the reference path does: they
    must reach it (else it evaluates all Tq x Tk pairs)."""
    seen = []
    real = reference.attention_varlen

    def recording(*args, **kwargs):
        seen.append((kwargs.get("max_seqlen_q"), kwargs.get("max_seqlen_k")))
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_kernel.reference, "attention_varlen", recording)
    q, k, v, sinks = _inputs(3)
    fn = lambda q: varlen_kernel.attention(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), None, None, sinks,
                                           max_seqlen_q=7, max_seqlen_k=8, **PARAMS)[0].sum()
    got = jax.grad(fn)(q)
    assert (7, 8) in seen, seen
    want = jax.grad(lambda q: _reference(q, k, v, sinks)[0].sum())(q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_lse", [False, True])
def test_gradients_run_the_backward_primitive_with_dlse_only_when_lse_is_used(use_lse):
    q, k, v, sinks = _inputs(4)

    def loss(q, k, v, sinks):
        out, lse = varlen_kernel.attention(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), None, None, sinks, **PARAMS)
        return jnp.sum(out * out) + (jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) if use_lse else 0.0)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive is varlen_kernel.bwd_varlen_p]
    assert len(calls) == 1 and calls[0].params["has_dlse"] == use_lse, calls
    assert calls[0].params["has_sinks"]
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    def reference_loss(q, k, v, sinks):
        out, lse = _reference(q, k, v, sinks)
        return jnp.sum(out * out) + (jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) if use_lse else 0.0)

    for g, w in zip(got, jax.grad(reference_loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seqused,has_dlse,has_sinks", [(False, False, False), (True, True, True)])
def test_cuda_lowering_of_the_backward_calls_its_target_with_the_plans_workspace(monkeypatch, seqused, has_dlse,
                                                                                 has_sinks):
    """flashjax_bwd_varlen's operands in the handler's order (q, k, v, o, lse, dout, the offsets, then only the present
    ones of seqused_q, seqused_k, dlse, sinks), the static options as attributes (not the max_seqlen hints), and the
    workspace the library's varlen plan names as extra results (the plan is faked here: test_library.py asks the
    real one)."""
    monkeypatch.setattr(varlen_kernel._ffi, "register_targets", lambda: None)
    monkeypatch.setattr(varlen_kernel._ffi, "default_device", lambda: (80, 108))
    asked = {}

    def fake_plan(**call):
        asked.update(call)
        rows = 128
        return {"bwd": {"workspace": [{"name": "dq_accum", "shape": [HQ, rows, D], "dtype": "float32"},
                                      {"name": "dpsum", "shape": [HQ, rows], "dtype": "float32"},
                                      {"name": "lse_log2", "shape": [HQ, rows], "dtype": "float32"}]}}

    monkeypatch.setattr(varlen_kernel._ffi, "plan", fake_plan)
    q, k, v, sinks = _inputs(5, jnp.bfloat16)
    lse = jnp.zeros((HQ, 11), jnp.float32)
    used = jnp.zeros((3,), jnp.int32)
    params = dict(PARAMS, has_sinks=has_sinks, has_dlse=has_dlse, has_seqused_q=seqused, has_seqused_k=seqused,
                  max_seqlen_q=7, max_seqlen_k=8)
    fn = lambda *a: varlen_kernel.bwd_varlen_p.bind(*a, **params)
    text = jax.jit(fn).trace(q, k, v, q, lse, q, CU_Q, CU_K, used, used, lse, sinks).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @flashjax_" in line]
    assert len(calls) == 1 and "@flashjax_bwd_varlen(" in calls[0], calls
    operands = calls[0].split("(", 1)[1].split(")", 1)[0].split(",")
    assert len(operands) == 8 + 2 * seqused + has_dlse + has_sinks
    assert f"tensor<{HQ}x128x{D}xf32>, tensor<{HQ}x128xf32>, tensor<{HQ}x128xf32>" in calls[0], calls[0]
    assert "max_seqlen" not in calls[0] and f"has_seqused_q = {str(seqused).lower()}" in calls[0], calls[0]
    # The plan asked is the varlen one: N sequences, the token counts, the padded width.
    assert asked["varlen"] and asked["batch"] == 3 and asked["seqlen_q"] == 11 and asked["seqlen_k"] == 15, asked


def _tangents(seed, primals):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in primals)


@pytest.mark.parametrize("seqused", [False, True])
def test_off_cuda_jvp_linearize_and_jvp_of_grad_match_the_reference(seqused):
    """Forward mode runs through tangent_varlen (its reference lowering here): jax.jvp, jax.linearize and jvp of grad
    of the kernel path equal the reference's, with a tangent for every input, sinks included."""
    q, k, v, sinks = _inputs(6)
    used_q = jnp.array([2, 0, 7], jnp.int32) if seqused else None
    used_k = jnp.array([5, 1, 3], jnp.int32) if seqused else None
    kernel_path = lambda q, k, v, s: varlen_kernel.attention(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), used_q,
                                                             used_k, s, **PARAMS)
    reference_path = lambda q, k, v, s: _reference(q, k, v, s, used_q, used_k)
    primals = (q, k, v, sinks)
    tangents = _tangents(7, primals)
    jaxpr = jax.make_jaxpr(lambda *a: jax.jvp(kernel_path, a[:4], a[4:]))(*primals, *tangents)
    assert any(e.primitive is varlen_kernel.tangent_varlen_p for e in jaxpr.jaxpr.eqns)
    (got_out, got_t), (want_out, want_t) = (jax.jvp(f, primals, tangents) for f in (kernel_path, reference_path))
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    for g, w in zip((*got_out, *got_t), (*want_out, *want_t)):
        np.testing.assert_allclose(finite(g), finite(w), rtol=1e-5, atol=1e-5)
    _, linear = jax.linearize(kernel_path, *primals)
    for g, w in zip(linear(*tangents), want_t):
        np.testing.assert_allclose(finite(g), finite(w), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] ** 2)

    hvp = lambda fn: jax.jvp(jax.grad(loss(fn), argnums=(0, 1, 2, 3)), primals, tangents)[1]
    for g, w in zip(hvp(kernel_path), hvp(reference_path)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seqused,has_sinks", [(False, False), (True, True)])
def test_cuda_lowering_of_the_jvp_calls_the_varlen_tangent_target(monkeypatch, seqused, has_sinks):
    """flashjax_tangent_varlen's operands in the handler's order with only the present optional ones (seqused_q,
    seqused_k, sinks, tsinks), no max_seqlen attribute; where the plan has no tangent kernel, the reference's tangent
    is lowered instead (no tangent target in the module)."""
    monkeypatch.setattr(varlen_kernel._ffi, "register_targets", lambda: None)
    monkeypatch.setattr(varlen_kernel._ffi, "default_device", lambda: (80, 108))
    family = {"value": "sm80"}
    monkeypatch.setattr(varlen_kernel._ffi, "plan",  # the forward's plan without the run-time walk's workspace
                        lambda **call: {"fwd": {"family": "sm80"}, "tangent": {"family": family["value"]}})
    q, k, v, sinks = _inputs(8, jnp.bfloat16)
    used = jnp.array([1, 0, 2], jnp.int32) if seqused else None

    def fn(q, k, v, tq, tk, tv, ts):
        call = lambda q, k, v, s: varlen_kernel.attention(q, k, v, jnp.asarray(CU_Q), jnp.asarray(CU_K), used, used,
                                                          s if has_sinks else None, max_seqlen_q=7, **PARAMS)
        return jax.jvp(call, (q, k, v, sinks), (tq, tk, tv, ts))

    def calls():  # a new function each time: jit's lowering cache would hand back the first module
        text = jax.jit(lambda *a: fn(*a)).trace(q, k, v, q, k, v, sinks).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "stablehlo.custom_call @flashjax_tangent" in line]

    found = calls()
    assert len(found) == 1 and "@flashjax_tangent_varlen(" in found[0], found
    operands = found[0].split("(", 1)[1].split(")", 1)[0].split(",")
    assert len(operands) == 10 + 2 * seqused + 2 * has_sinks
    assert "max_seqlen" not in found[0] and "tensor<11x4x16xbf16>" in found[0] and "tensor<4x11xf32>" in found[0]
    family["value"] = None
    assert calls() == []
