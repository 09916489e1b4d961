"""jax.export of a varlen call (issue 37): one artifact serves every packing of the same token counts, lowered for
CUDA onto the varlen FFI target, and on CPU (the reference lowering) it round-trips and computes what the jitted call
does, values and gradients."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import flashjax
from flashjax import varlen_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import export_fixture  # noqa: E402  (tests/gpu: the list of FFI targets jax.export must let through)

TQ, TK, HQ, HK, D = 23, 31, 4, 2, 16


def _fwd_bwd(q, k, v, cu_q, cu_k, d_out):
    """The public call (on CPU: the reference, float32 allowed)."""
    def attention(q, k, v):
        return flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=16, max_seqlen_k=16,
                                          backend="reference")
    out, pullback = jax.vjp(attention, q, k, v)
    return (out, *pullback(d_out))


def _kernel_fwd_bwd(q, k, v, cu_q, cu_k, d_out):
    """What flash_attn_varlen runs with backend='kernel' (its primitive and custom_vjp), callable without a GPU."""
    def attention(q, k, v):
        return varlen_kernel.attention(q, k, v, cu_q, cu_k, None, None, None, softmax_scale=D ** -0.5, softcap=0.0,
                                       window_left=-1, window_right=0)[0]
    out, pullback = jax.vjp(attention, q, k, v)
    return (out, *pullback(d_out))


def _inputs(seed):
    rng = np.random.default_rng(seed)
    shapes = [(TQ, HQ, D), (TK, HK, D), (TK, HK, D)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    return q, k, v, jnp.asarray(rng.standard_normal((TQ, HQ, D)), jnp.float32)


PACKINGS = [(np.array([0, 5, 5, 20, 23], np.int32), np.array([0, 9, 12, 25, 31], np.int32)),
            (np.array([0, 16, 16, 17, 23], np.int32), np.array([0, 1, 2, 18, 30], np.int32))]


def test_the_export_lowers_onto_the_varlen_target_for_cuda(monkeypatch):
    from flashjax import _ffi
    monkeypatch.setattr(_ffi, "register_targets", lambda: None)  # registration serves compilation only
    q, k, v, d_out = _inputs(0)
    args = [x.astype(jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(c) for c in PACKINGS[0]] + [
        d_out.astype(jnp.bfloat16)]
    exported = export_fixture.export_call(_kernel_fwd_bwd, platforms=("cuda",))(*args)
    text = exported.mlir_module()
    assert "@flashjax_fwd_varlen" in text and "@flashjax_bwd_varlen" in text  # both passes on the kernels
    assert exported.serialize()  # the artifact is bytes a later process can load


def test_one_cpu_export_serves_every_packing_and_matches_the_jitted_call():
    pytest.importorskip("flatbuffers", reason="jax.export's serializer needs flatbuffers")
    q, k, v, d_out = _inputs(1)
    cu = [jnp.asarray(c) for c in PACKINGS[0]]
    exported = export.deserialize(
        export_fixture.export_call(_fwd_bwd, platforms=("cpu",))(q, k, v, *cu, d_out).serialize())
    for cu_q, cu_k in PACKINGS:
        got = exported.call(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), d_out)
        want = jax.jit(_fwd_bwd)(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), d_out)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
