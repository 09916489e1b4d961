"""Public API: validation errors (one test per rule), the two naming styles, backend choice and warnings."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api


def _qkv(b=2, sq=9, sk=11, hq=4, hk=2, d=32, dv=None, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, sk, hk, dv or d)), dtype)
    return q, k, v


def _packed(tq=13, tk=17, hq=4, hk=2, d=32, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((tq, hq, d)), dtype), jnp.asarray(rng.standard_normal((tk, hk, d)), dtype),
            jnp.asarray(rng.standard_normal((tk, hk, d)), dtype))


def _raises(cls, *fragments):
    """pytest.raises that also checks the message names the argument, the value and the expectation."""
    return pytest.raises(cls, match="".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name,shape", [("q", (9, 4, 32)), ("k", (2, 11, 2)), ("v", (2, 11, 2, 32, 1))])
def test_rank(name, shape):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args[name] = jnp.zeros(shape, jnp.bfloat16)
    with _raises(ValueError, f"{name}.shape", str(shape), "rank 4"):
        flashjax.flash_attn(**args)


def test_not_an_array():
    _, k, v = _qkv()
    with _raises(TypeError, "q must be an array", "list"):
        flashjax.flash_attn([1.0], k, v)


def test_dtype_must_be_16_bit():
    q, k, v = _qkv(dtype=jnp.float32)
    with _raises(TypeError, "q.dtype", "float32", "bfloat16 or float16"):
        flashjax.flash_attn(q, k, v)


def test_float32_runs_on_the_reference_only():
    q, k, v = _qkv(dtype=jnp.float32)
    out = flashjax.flash_attn(q, k, v, backend="reference")
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_dtypes_must_match():
    q, k, v = _qkv()
    with _raises(TypeError, "v.dtype", "float16", "bfloat16"):
        flashjax.flash_attn(q, k, v.astype(jnp.float16))


def test_gqa_heads_must_divide():
    q, k, v = _qkv(hq=6, hk=4)
    with _raises(ValueError, "number of key heads", "4", "divisor of the query heads (6)"):
        flashjax.flash_attn(q, k, v)


def test_value_heads_match_key_heads():
    q, k, _ = _qkv(hq=4, hk=2)
    _, _, v = _qkv(hq=4, hk=4)
    with _raises(ValueError, "number of value heads", "4", "key heads (2)"):
        flashjax.flash_attn(q, k, v)


@pytest.mark.parametrize("d", [0, 264])
def test_head_dim_from_1_up_to_256(d):
    q, k, v = _qkv(d=d)
    with _raises(ValueError, "q's head dim", str(d), "between 1 and 256"):
        flashjax.flash_attn(q, k, v)


def test_key_head_dim_matches_query():
    q, _, v = _qkv(d=32)
    _, k, _ = _qkv(d=64)
    with _raises(ValueError, "k's head dim", "64", "q's head dim (32)"):
        flashjax.flash_attn(q, k, v)


def test_value_head_dim_rules():
    q, k, v = _qkv(d=32, dv=257)
    with _raises(ValueError, "v's head dim", "257", "between 1 and 256"):
        flashjax.flash_attn(q, k, v)


def test_batch_sizes_agree():
    q, _, _ = _qkv(b=2)
    _, k, v = _qkv(b=3)
    with _raises(ValueError, "batch sizes", "(2, 3, 3)", "all equal"):
        flashjax.flash_attn(q, k, v)


def test_kv_lengths_agree():
    q, k, _ = _qkv(sk=11)
    _, _, v = _qkv(sk=12)
    with _raises(ValueError, "v.shape[1]", "12", "k's sequence length (11)"):
        flashjax.flash_attn(q, k, v)


@pytest.mark.parametrize("window", [(3,), (1, 2, 3), (1.5, 0), "ab", (True, 0)])
def test_window_size_form(window):
    q, k, v = _qkv()
    with _raises(ValueError, "window_size", "pair of ints"):
        flashjax.flash_attn(q, k, v, window_size=window)


def test_window_size_lower_bound():
    q, k, v = _qkv()
    with _raises(ValueError, "window_size", "(-2, 0)", ">= -1"):
        flashjax.flash_attn(q, k, v, window_size=(-2, 0))


@pytest.mark.parametrize("softcap", [-1.0, float("nan")])
def test_softcap(softcap):
    q, k, v = _qkv()
    with _raises(ValueError, "softcap", ">= 0"):
        flashjax.flash_attn(q, k, v, softcap=softcap)


@pytest.mark.parametrize("scale", [float("inf"), 0.0, -0.5])
def test_softmax_scale_finite_positive(scale):
    q, k, v = _qkv()
    with _raises(ValueError, "softmax_scale", str(scale), "finite float > 0"):
        flashjax.flash_attn(q, k, v, softmax_scale=scale)


def test_softmax_scale_must_be_static():
    q, k, v = _qkv()
    with _raises(TypeError, "softmax_scale", "Python float"):
        flashjax.flash_attn(q, k, v, softmax_scale=jnp.float32(0.1))


def test_sinks_shape():
    q, k, v = _qkv(hq=4)
    with _raises(ValueError, "sinks.shape", "(3,)", "(4,), one logit per query head"):
        flashjax.flash_attn(q, k, v, sinks=jnp.zeros((3,), jnp.float32))


def test_sinks_dtype():
    q, k, v = _qkv(hq=4)
    with _raises(TypeError, "sinks.dtype", "bfloat16", "float32"):
        flashjax.flash_attn(q, k, v, sinks=jnp.zeros((4,), jnp.bfloat16))


def test_mask_mod_type():
    q, k, v = _qkv()
    with _raises(TypeError, "mask_mod", "function", "flashjax.MaskMod"):
        flashjax.flash_attn(q, k, v, mask_mod=lambda b, h, i, j: i >= j)


@pytest.mark.parametrize("name", ["causal", "return_lse", "deterministic"])
def test_bool_flags(name):
    q, k, v = _qkv()
    with _raises(TypeError, name, "1", "a bool"):
        flashjax.flash_attn(q, k, v, **{name: 1})


def test_unknown_backend():
    q, k, v = _qkv()
    with _raises(ValueError, "backend", "'cuda'", "one of ('auto', 'kernel', 'reference')"):
        flashjax.flash_attn(q, k, v, backend="cuda")


def test_kernel_backend_on_cpu_says_why():
    q, k, v = _qkv()
    with _raises(ValueError, "backend='kernel'", "no kernel runs this call", "NVIDIA GPU"):
        flashjax.flash_attn(q, k, v, backend="kernel")


# -------------------------------------------------------------------------------------------- varlen validation
def _cu(*xs):
    return jnp.asarray(xs, jnp.int32)


def test_varlen_rank():
    q, k, v = _qkv()
    with _raises(ValueError, "q.shape", "rank 3"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 9), _cu(0, 11))


def test_varlen_cu_seqlens_dtype():
    q, k, v = _packed()
    with _raises(TypeError, "cu_seqlens_q.dtype", "int64", "int32"):
        flashjax.flash_attn_varlen(q, k, v, np.asarray([0, 13], np.int64), _cu(0, 17))


def test_varlen_cu_seqlens_rank():
    q, k, v = _packed()
    with _raises(ValueError, "cu_seqlens_k.shape", "(1, 2)", "rank 1"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), jnp.zeros((1, 2), jnp.int32))


def test_varlen_cu_seqlens_lengths_agree():
    q, k, v = _packed()
    with _raises(ValueError, "cu_seqlens_k.shape", "(3,)", "cu_seqlens_q's shape (2,)"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 5, 17))


def test_varlen_cu_seqlens_not_empty():
    q, k, v = _packed()
    with _raises(ValueError, "cu_seqlens_q", "N >= 0"):
        flashjax.flash_attn_varlen(q, k, v, jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))


@pytest.mark.parametrize("name", ["seqused_q", "seqused_k"])
def test_varlen_seqused_length(name):
    q, k, v = _packed()
    with _raises(ValueError, f"{name}.shape", "(2,)", "(1,)"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 17), **{name: _cu(1, 2)})


def test_varlen_token_counts_agree():
    q, k, _ = _packed(tk=17)
    _, _, v = _packed(tk=16)
    with _raises(ValueError, "v.shape[0]", "16", "k's token count (17)"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 17))


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_varlen_max_seqlen_hint(value):
    q, k, v = _packed()
    with _raises(ValueError, "max_seqlen_q", str(value), "non-negative int"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 17), max_seqlen_q=value)


def test_vmap_over_varlen_is_rejected():
    q, k, v = _packed()
    qs = jnp.stack([q, q])
    with _raises(ValueError, "vmap over flash_attn_varlen", "the packing is the batch"):
        jax.vmap(lambda q: flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 17)))(qs)


# ------------------------------------------------------------------------------------------------ API behaviour
def test_naming_styles_agree():
    q, k, v = _qkv(sq=11, sk=11)
    sinks = jnp.asarray(np.random.default_rng(1).standard_normal(4), jnp.float32)
    a = flashjax.flash_attn(q, k, v, causal=True, window_size=(5, -1), sinks=sinks, softmax_scale=0.2)
    b = flashjax.flash_mha(q, k, v, is_causal=True, window_size=(5, -1), sinks=sinks, softmax_scale=0.2)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_varlen_naming_styles_agree():
    q, k, v = _packed(tq=17, tk=17)
    cu = _cu(0, 5, 5, 17)
    a = flashjax.flash_attn_varlen(q, k, v, cu, cu, max_seqlen_q=12, max_seqlen_k=12, causal=True)
    b = flashjax.flash_mha_varlen(q, k, v, cu, 12, is_causal=True)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_return_lse_shapes():
    q, k, v = _qkv(b=2, sq=9, hq=4, dv=16)
    out, lse = flashjax.flash_attn(q, k, v, return_lse=True)
    assert out.shape == (2, 9, 4, 16) and out.dtype == q.dtype
    assert lse.shape == (2, 4, 9) and lse.dtype == jnp.float32
    qp, kp, vp = _packed(tq=13, hq=4)
    out, lse = flashjax.flash_attn_varlen(qp, kp, vp, _cu(0, 13), _cu(0, 17), return_lse=True)
    assert out.shape == (13, 4, 32) and lse.shape == (4, 13)


def test_auto_on_cpu_warns_once_and_matches_reference():
    api._warned.clear()
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = flashjax.flash_attn(q, k, v, causal=True)
        flashjax.flash_attn(q, k, v, causal=True)
    messages = [str(w.message) for w in caught if "flashjax" in str(w.message)]
    assert len(messages) == 1 and "NVIDIA GPU" in messages[0]
    b = flashjax.flash_attn(q, k, v, causal=True, backend="reference")
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(d=64)
    a = flashjax.flash_attn(q, k, v, backend="reference")
    b = flashjax.flash_attn(q, k, v, softmax_scale=0.125, backend="reference")
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_jit_grad_through_public_api():
    q, k, v = _qkv()
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)

    def loss(q, k, v, sinks):
        return jnp.sum(flashjax.flash_attn(q, k, v, causal=True, sinks=sinks, backend="reference")
                       .astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
    assert float(jnp.abs(grads[3]).sum()) > 0


def test_explain_reports_path_and_reason():
    spec = jax.ShapeDtypeStruct
    text = flashjax.explain(spec((1, 128, 8, 72), jnp.bfloat16), spec((1, 128, 8, 72), jnp.bfloat16),
                            spec((1, 128, 8, 72), jnp.bfloat16))
    assert text.startswith("q (1, 128, 8, 72)") and "reference" in text and "NVIDIA GPU" in text


def test_explain_checks_its_arguments_as_the_call_does():
    # explain() runs the call's own validation: every bad input the call rejects, explain rejects with the same
    # error, and every keyword the call takes, explain takes.
    spec = jax.ShapeDtypeStruct
    q = spec((1, 128, 8, 64), jnp.bfloat16)
    kv = spec((1, 128, 2, 64), jnp.bfloat16)
    good = dict(causal=True, softmax_scale=0.1, return_lse=True, softcap=5.0, window_size=(32, 0),
                sinks=spec((8,), jnp.float32), deterministic=False, backend="reference")
    assert "reference" in flashjax.explain(q, kv, kv, **good)
    bad_calls = [
        ((q, spec((1, 128, 3, 64), jnp.bfloat16), spec((1, 128, 3, 64), jnp.bfloat16)), {}),
        ((q, kv, kv), dict(softmax_scale=-1.0)),
        ((q, kv, kv), dict(window_size=(-2, 0))),
        ((q, kv, kv), dict(sinks=spec((7,), jnp.float32))),
        ((q, kv, kv), dict(backend="fast")),
        ((q, kv, kv), dict(return_lse="yes")),
        ((spec((1, 128, 8, 264), jnp.bfloat16),) * 3, {}),
        ((spec((1, 128, 8, 64), jnp.float32), kv, kv), {}),
    ]
    for args, keywords in bad_calls:
        with pytest.raises((TypeError, ValueError)) as from_call:
            flashjax.flash_attn(*args, **keywords)
        with pytest.raises(type(from_call.value)) as from_explain:
            flashjax.explain(*args, **keywords)
        assert str(from_explain.value) == str(from_call.value)
    with pytest.raises(TypeError):
        flashjax.explain(q, kv, kv, no_such_keyword=1)


def test_explain_of_a_varlen_call_checks_its_offsets():
    spec = jax.ShapeDtypeStruct
    q = spec((100, 8, 64), jnp.bfloat16)
    kv = spec((120, 2, 64), jnp.bfloat16)
    cu = spec((4,), jnp.int32)
    text = flashjax.explain(q, kv, kv, cu, cu, causal=True, max_seqlen_q=50, seqused_k=spec((3,), jnp.int32))
    assert text.startswith("q (100, 8, 64)") and "reference" in text
    for bad in (dict(seqused_k=spec((2,), jnp.int32)), dict(max_seqlen_q=-1)):
        with pytest.raises(ValueError) as from_call:
            flashjax.flash_attn_varlen(jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype),
                                       jnp.zeros(kv.shape, kv.dtype), jnp.zeros((4,), jnp.int32),
                                       jnp.zeros((4,), jnp.int32), **bad)
        with pytest.raises(ValueError) as from_explain:
            flashjax.explain(q, kv, kv, cu, cu, **bad)
        assert str(from_explain.value) == str(from_call.value)
    with pytest.raises(ValueError, match="cu_seqlens_k.shape"):
        flashjax.explain(q, kv, kv, cu, spec((3,), jnp.int32))
