"""First contact (issue 35, items 6 and 7): bad input a new user is likely to pass gets a clear error at trace time,
or a documented meaning (docs/design.md §2), and head dims that are not a multiple of 8 run.

Each error test checks that the message names the argument, the value and what was expected.
"""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import numpy_oracle as oracle
from flashjax import _ffi, api, reference


def _raises(cls, *fragments):
    return pytest.raises(cls, match="".join(f"(?=.*{re.escape(f)})" for f in fragments))


def _qkv(b=2, sq=9, sk=11, hq=4, hk=2, d=32, dv=None, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype),
            jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype),
            jnp.asarray(rng.standard_normal((b, sk, hk, dv or d)), dtype))


def _packed(tq=13, tk=17, hq=4, hk=2, d=32, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((tq, hq, d)), dtype), jnp.asarray(rng.standard_normal((tk, hk, d)), dtype),
            jnp.asarray(rng.standard_normal((tk, hk, d)), dtype))


def _cu(*xs):
    return jnp.asarray(xs, jnp.int32)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backend="auto" falls back to the reference on CPU, with a warning
        yield


def _assert_same_values(got, want, what, rtol=1e-5, atol=1e-6):
    """Equal NaN and +-inf positions, and the finite entries close."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf positions")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol, err_msg=what)


# ------------------------------------------------------------------------------------------- 1. NaN and inf sinks
def test_concrete_nan_sinks_raise_naming_the_heads():
    q, k, v = _qkv(hq=4)
    sinks = jnp.asarray([0.5, jnp.nan, 1.0, jnp.nan], jnp.float32)
    with _raises(ValueError, "sinks at query heads [1, 3]", "not NaN", "[nan, nan]", "-inf", "+inf"):
        flashjax.flash_attn(q, k, v, sinks=sinks)
    with _raises(ValueError, "sinks at query heads [1, 3]"):
        flashjax.flash_attn(q, k, v, sinks=np.asarray(sinks))
    with _raises(ValueError, "sinks at query heads [1, 3]"):  # a constant under jit is concrete too
        jax.jit(lambda q: flashjax.flash_attn(q, k, v, sinks=sinks))(q)
    qp, kp, vp = _packed(hq=4)
    with _raises(ValueError, "sinks at query heads [1, 3]"):
        flashjax.flash_attn_varlen(qp, kp, vp, _cu(0, 13), _cu(0, 17), sinks=sinks)


def test_infinite_concrete_sinks_are_valid():
    q, k, v = _qkv(hq=4)
    out = flashjax.flash_attn(q, k, v, sinks=jnp.asarray([-jnp.inf, jnp.inf, 0.0, 1.0], jnp.float32))
    assert out.shape == (2, 9, 4, 32)


# Sq > Sk with causal (bottom-right aligned): the first Sq - Sk rows see no key. One head of each kind of sink, and
# head 0 with a finite one, GQA 2:1 so that the special heads share their KV heads with ordinary ones.
_SPECIAL_SINKS = np.asarray([0.7, -np.inf, np.inf, np.nan], np.float32)


def _special_case(seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    d_out = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
    d_lse = rng.standard_normal((2, 4, 9)).astype(np.float32)
    return q, k, v, d_out, d_lse


def test_special_sinks_traced_match_the_oracle():
    """Under jit (traced sinks): -inf is no sink, +inf takes all the weight (out 0, lse +inf, dsink = sum of dlse),
    NaN makes its head's out and lse NaN (rows with no visible key: out 0, lse NaN), and no head leaks into another."""
    q, k, v, d_out, d_lse = _special_case()
    kwargs = dict(softmax_scale=0.4, causal=True, window_size=(-1, -1), softcap=0.0, mask_mod=None)

    @jax.jit
    def run(q, k, v, sinks):
        (out, lse), vjp = jax.vjp(lambda *a: reference.attention(*a[:3], sinks=a[3], **kwargs), q, k, v, sinks)
        return out, lse, vjp((jnp.asarray(d_out), jnp.asarray(d_lse)))

    out, lse, grads = run(q, k, v, jnp.asarray(_SPECIAL_SINKS))
    want = oracle.attention_with_grads(q, k, v, scale=0.4, causal=True, sinks=_SPECIAL_SINKS, d_out=d_out, d_lse=d_lse)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads), want):
        _assert_same_values(got, expected, name, rtol=2e-4, atol=2e-5)
    out, lse = np.asarray(out), np.asarray(lse)
    empty = slice(0, 4)  # rows 0..3 see no key
    assert np.all(out[:, :, 2] == 0) and np.all(lse[:, 2] == np.inf)
    assert np.all(np.isnan(out[:, 4:, 3])) and np.all(np.isnan(lse[:, 3])) and np.all(out[:, empty, 3] == 0)
    assert np.all(lse[:, 1, empty] == -np.inf) and np.all(out[:, empty, 1] == 0)
    assert float(grads[3][1]) == 0.0 and np.isnan(float(grads[3][3]))
    np.testing.assert_allclose(float(grads[3][2]), d_lse[:, 2].sum(), rtol=1e-5)


def test_neg_inf_sink_is_no_sink():
    q, k, v = _qkv(hq=4, dtype=jnp.float32)
    sinks = jnp.full((4,), -jnp.inf, jnp.float32)
    loss = lambda sinks: lambda q, k, v: jnp.sum(flashjax.flash_attn(q, k, v, causal=True, sinks=sinks,  # noqa: E731
                                                                      backend="reference") ** 2)
    with_sink = jax.value_and_grad(loss(sinks), argnums=(0, 1, 2))(q, k, v)
    without = jax.value_and_grad(loss(None), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(with_sink), jax.tree.leaves(without)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nan_sink_stays_out_of_rows_that_are_not_there():
    """Varlen: tokens past cu_seqlens_q[N] and unused query rows are not rows; the sink (NaN too) never reaches them."""
    q, k, v = _packed(tq=13, tk=17, hq=4, dtype=jnp.float32)
    sinks = jnp.asarray(_SPECIAL_SINKS)
    out, lse = jax.jit(lambda q, s: flashjax.flash_attn_varlen(q, k, v, _cu(0, 4, 10), _cu(0, 9, 17), sinks=s,
                                                               seqused_q=_cu(4, 3), return_lse=True,
                                                               backend="reference"))(q, sinks)
    missing = np.r_[7:13]  # sequence 1 uses rows 4..6; rows 7..12 are not rows
    assert np.all(np.asarray(out)[missing] == 0) and np.all(np.asarray(lse)[:, missing] == -np.inf)
    assert np.all(np.isnan(np.asarray(lse)[3, :7])) and np.all(np.asarray(lse)[2, :7] == np.inf)


# ------------------------------------------------------------------------------------ 2. mask fields vs the call
@pytest.mark.parametrize("shape,fragment", [((2, 9), "S >= 11"), ((3, 11), "(2, S >= 11), or (1, S >= 11)"),
                                            ((4, 30), "(2, S >= 11)")])
def test_document_mask_ids_must_fit_the_call(shape, fragment):
    q, k, v = _qkv(b=2, sq=9, sk=11)
    mask = flashjax.document_mask(jnp.zeros(shape, jnp.int32))
    with _raises(ValueError, "DocumentMask.doc_ids.shape", str(shape), fragment):
        flashjax.flash_attn(q, k, v, mask_mod=mask)
    with _raises(ValueError, "DocumentMask.doc_ids.shape", str(shape)):  # traced ids: the shape is still static
        jax.jit(lambda ids: flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(ids)))(jnp.zeros(shape,
                                                                                                          jnp.int32))


def test_document_mask_broadcasts_one_row_and_takes_longer_ids():
    q, k, v = _qkv(b=2, sq=9, sk=11, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 3, (1, 11)), jnp.int32)
    shared = flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(ids), backend="reference")
    stacked = flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(jnp.concatenate([ids, ids])),
                                  backend="reference")
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(stacked))
    longer = jnp.concatenate([ids, jnp.full((1, 5), 7, jnp.int32)], axis=1)  # ids past Sk are never read
    np.testing.assert_array_equal(np.asarray(flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(longer),
                                                                 backend="reference")), np.asarray(shared))


def test_document_mask_in_varlen():
    q, k, v = _packed(tq=13, tk=17, dtype=jnp.float32)
    with _raises(ValueError, "DocumentMask.doc_ids.shape", "(3, 20)", "(2, S), or (1, S)"):
        flashjax.flash_attn_varlen(q, k, v, _cu(0, 6, 13), _cu(0, 8, 17), backend="reference",
                                   mask_mod=flashjax.document_mask(jnp.zeros((3, 20), jnp.int32)))
    # Sequence 1 has 9 keys; with ids of length 8 its key at position 8 (token 16) is in no document: the call is
    # the one without that key.
    out, lse = flashjax.flash_attn_varlen(q, k, v, _cu(0, 6, 13), _cu(0, 8, 17), return_lse=True, backend="reference",
                                          mask_mod=flashjax.document_mask(jnp.zeros((2, 8), jnp.int32)))
    want, want_lse = flashjax.flash_attn_varlen(q, k[:16], v[:16], _cu(0, 6, 13), _cu(0, 8, 16), return_lse=True,
                                                backend="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5)


def test_prefix_lm_mask_rows_must_fit_the_batch():
    q, k, v = _qkv(b=2)
    with _raises(ValueError, "PrefixLMMask.prefix_len.shape", "(3,)", "(2,), or (1,)"):
        flashjax.flash_attn(q, k, v, mask_mod=flashjax.prefix_lm_mask(jnp.asarray([1, 2, 3], jnp.int32)))
    one = flashjax.flash_attn(q, k, v, mask_mod=flashjax.prefix_lm_mask(jnp.asarray([3], jnp.int32)))
    two = flashjax.flash_attn(q, k, v, mask_mod=flashjax.prefix_lm_mask(jnp.asarray([3, 3], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(two, np.float32))


# ------------------------------------------------------------------------------------- 3. static numbers
def test_softcap_true_is_a_type_error():
    q, k, v = _qkv()
    with _raises(TypeError, "softcap", "not a bool", "True"):
        flashjax.flash_attn(q, k, v, softcap=True)
    with _raises(TypeError, "softcap", "'x'"):
        flashjax.flash_attn(q, k, v, softcap="x")


_STATIC_OPTIONS = [  # (name in the message, keywords given the value x, a valid value, varlen)
    ("softcap", lambda x: dict(softcap=x), 5.0, False),
    ("softmax_scale", lambda x: dict(softmax_scale=x), 0.2, False),
    ("window_size's left bound", lambda x: dict(window_size=(x, 0)), 3, False),
    ("window_size's right bound", lambda x: dict(window_size=(-1, x)), 3, False),
    ("causal", lambda x: dict(causal=x), True, False),
    ("max_seqlen_q", lambda x: dict(max_seqlen_q=x), 13, True),
    ("max_seqlen_k", lambda x: dict(max_seqlen_k=x), 17, True),
]


def _call(varlen, **keywords):
    if varlen:
        q, k, v = _packed()
        return flashjax.flash_attn_varlen(q, k, v, _cu(0, 13), _cu(0, 17), **keywords)
    q, k, v = _qkv()
    return flashjax.flash_attn(q, k, v, **keywords)


@pytest.mark.parametrize("name,keywords,value,varlen", _STATIC_OPTIONS, ids=[o[0] for o in _STATIC_OPTIONS])
def test_static_options_given_as_arrays_say_so(name, keywords, value, varlen):
    with _raises(TypeError, f"{name} must be", "a static value, not an array", "Array("):
        _call(varlen, **keywords(jnp.asarray(value)))
    with _raises(TypeError, f"{name} must be", "cannot be a traced value", "static_argnames", "Tracer"):
        jax.jit(lambda x: _call(varlen, **keywords(x)))(value)
    _call(varlen, **keywords(value))  # the Python value runs


def test_window_size_as_one_array_says_static():
    with _raises(TypeError, "window_size must be a pair of Python ints", "not an array", "Array([3, 0]"):
        _call(False, window_size=jnp.asarray([3, 0]))


# ------------------------------------------------------------------------------------- 4. what a mask mod returns
@dataclasses.dataclass(frozen=True)
class _IntMask(flashjax.MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _FixedShapeMask(flashjax.MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.ones((3, 5), jnp.bool_)


@dataclasses.dataclass(frozen=True)
class _PairMask(flashjax.MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx, kv_idx >= 0


@dataclasses.dataclass(frozen=True)
class _ConstantMask(flashjax.MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return True


def test_mask_mod_must_return_bool():
    q, k, v = _qkv()
    with _raises(TypeError, "mask_mod _IntMask's result dtype", "bool", "'int32'"):
        flashjax.flash_attn(q, k, v, mask_mod=_IntMask())


def test_mask_mod_result_must_broadcast():
    q, k, v = _qkv(b=2, sq=9, sk=11, hq=4)
    with _raises(ValueError, "mask_mod _FixedShapeMask's result shape", "(3, 5)", "broadcastable to (2, 4, 9, 11)"):
        flashjax.flash_attn(q, k, v, mask_mod=_FixedShapeMask())
    qp, kp, vp = _packed(tq=13, tk=17, hq=4)
    with _raises(ValueError, "mask_mod _FixedShapeMask's result shape", "(3, 5)", "broadcastable to (1, 4, 13, 17)"):
        flashjax.flash_attn_varlen(qp, kp, vp, _cu(0, 13), _cu(0, 17), mask_mod=_FixedShapeMask())
    with _raises(TypeError, "mask_mod _PairMask's result", "tuple", "one bool array"):
        flashjax.flash_attn(q, k, v, mask_mod=_PairMask())


def test_mask_mod_returning_a_python_bool_runs():
    q, k, v = _qkv(dtype=jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(flashjax.flash_attn(q, k, v, mask_mod=_ConstantMask(), backend="reference")),
        np.asarray(flashjax.flash_attn(q, k, v, backend="reference")))


# ------------------------------------------------------------------------------------- 5. missing offsets
@pytest.mark.parametrize("missing", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_offsets_given_as_none(missing):
    q, k, v = _packed()
    offsets = {"cu_seqlens_q": _cu(0, 13), "cu_seqlens_k": _cu(0, 17), missing: None}
    with _raises(TypeError, f"{missing} must be an int32 array of shape [N + 1]", "None"):
        flashjax.flash_attn_varlen(q, k, v, **offsets)
    with _raises(TypeError, "cu_seqlens_q must be an int32 array of shape [N + 1]", "None"):
        flashjax.flash_mha_varlen(q, k, v, None, 13)


# ------------------------------------------------------------------------------------- more traps
def test_mask_mod_factory_or_class_not_called():
    q, k, v = _qkv()
    with _raises(TypeError, "mask_mod must be a flashjax.MaskMod", "mask_mod=causal_mask(...)", "'function'"):
        flashjax.flash_attn(q, k, v, mask_mod=flashjax.causal_mask)
    with _raises(TypeError, "mask_mod must be a flashjax.MaskMod", "an instance: call the class", "'type'"):
        flashjax.flash_attn(q, k, v, mask_mod=flashjax.masks.SlidingWindowMask)


@dataclasses.dataclass(frozen=True)
class _ListBandMask(flashjax.MaskMod):
    bounds: list = flashjax.static()

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx >= q_idx - self.bounds[0]


def test_unhashable_static_field_is_named():
    q, k, v = _qkv()
    with _raises(TypeError, "_ListBandMask.bounds is a static() field and must be hashable", "[2]"):
        jax.jit(lambda q: flashjax.flash_attn(q, k, v, mask_mod=_ListBandMask([2])))(q)


def test_flags_given_as_arrays_say_static():
    with _raises(TypeError, "return_lse must be a Python bool", "not an array", "bool(x)"):
        _call(False, return_lse=jnp.asarray(True))


# ------------------------------------------------------------------------------ B. head dims not a multiple of 8
@pytest.mark.parametrize("d,dv", [(1, 1), (7, 7), (33, 59), (59, 59), (100, 7), (200, 33), (255, 256)])
def test_any_head_dim_runs_with_the_true_scale(d, dv):
    q, k, v = _qkv(b=1, sq=7, sk=10, hq=4, hk=2, d=d, dv=dv, dtype=jnp.float32, seed=d)
    sinks = jnp.asarray([0.3, -0.5, 1.0, 0.0], jnp.float32)
    out, lse = flashjax.flash_attn(q, k, v, causal=True, sinks=sinks, return_lse=True, backend="reference")
    assert out.shape == (1, 7, 4, dv)
    want_out, want_lse = oracle.attention(q, k, v, scale=1 / np.sqrt(d), causal=True, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,dv", [(59, 59), (59, 33), (33, 200), (100, 7), (1, 130)])
def test_kernel_path_pads_odd_head_dims_and_slices_back(d, dv):
    """api's kernel path (pad q, k, v to the compiled width, the fwd/bwd primitives, slice the output), run on CPU
    where the primitives lower to the reference: out, lse and every gradient equal the unpadded reference's, with
    the scale of the true head dim."""
    width = next(w for w in (64, 96, 128, 192, 256) if w >= max(d, dv))
    q, k, v = _qkv(b=2, sq=33, sk=21, hq=4, hk=2, d=d, dv=dv, dtype=jnp.float32, seed=d + dv)
    sinks = jnp.asarray([0.3, -0.5, 1.0, 0.0], jnp.float32)
    options = api._dense_call(q, k, v, causal=True, window_size=(7, -1), sinks=sinks, backend="reference").options
    assert options.softmax_scale == pytest.approx(1 / np.sqrt(d))
    rng = np.random.default_rng(5)
    d_out = jnp.asarray(rng.standard_normal((2, 33, 4, dv)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((2, 4, 33)), jnp.float32)

    def padded(q, k, v, sinks):
        return api._kernel_attention(q, k, v, sinks, options, width)

    def unpadded(q, k, v, sinks):
        return reference.attention(q, k, v, **api._reference_kwargs(options, sinks))

    results = []
    for fn in (padded, unpadded):
        (out, lse), vjp = jax.vjp(jax.jit(fn), q, k, v, sinks)
        results.append((out, lse, *vjp((d_out, d_lse))))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *results):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.skipif(not _ffi.available(), reason="libflashjax.so not built")
def test_the_plan_pads_every_head_dim_to_the_next_compiled_width():
    widths = (64, 96, 128, 192, 256)
    for d in range(1, 257):
        plan = _ffi.plan(dtype="bfloat16", batch=1, seqlen_q=100, seqlen_k=100, heads_q=2, heads_k=2, head_dim=d,
                         device_sm=90)
        assert plan["head_dim"] == next(w for w in widths if w >= d), d


def test_explain_and_the_call_accept_odd_head_dims():
    spec = jax.ShapeDtypeStruct
    text = flashjax.explain(spec((1, 64, 4, 59), jnp.bfloat16), spec((1, 64, 2, 59), jnp.bfloat16),
                            spec((1, 64, 2, 33), jnp.bfloat16))
    assert text.startswith("q (1, 64, 4, 59)")
    q, k, v = _qkv(d=59, dv=33)
    assert flashjax.flash_attn(q, k, v).shape == (2, 9, 4, 33)


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_kernel_path_special_sinks_match_the_reference(special):
    """api's kernel path sends a +inf sink to the kernels as a huge finite logit and gives lse the sink itself (the
    kernels' arithmetic would form inf - inf): out, lse and every gradient equal the reference's (run on CPU, where
    the primitives lower to the reference; tests/gpu checks the kernels)."""
    q, k, v = _qkv(b=2, sq=33, sk=21, hq=4, hk=2, d=64, dv=64, dtype=jnp.float32, seed=3)
    sinks = jnp.asarray([0.3, special, 1.0, 0.0], jnp.float32)
    # Traced sinks (under jit below): a concrete NaN would be refused by the call's own check.
    options = api._dense_call(q, k, v, causal=True, sinks=jnp.zeros(4, jnp.float32), backend="reference").options
    rng = np.random.default_rng(6)
    d_out = jnp.asarray(rng.standard_normal((2, 33, 4, 64)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((2, 4, 33)), jnp.float32)
    results = []
    for fn in (lambda *a: api._kernel_attention(*a, options, 64),
               lambda q, k, v, s: reference.attention(q, k, v, **api._reference_kwargs(options, s))):
        (out, lse), vjp = jax.vjp(jax.jit(fn), q, k, v, sinks)
        results.append((out, lse, *vjp((d_out, d_lse))))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *results):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, equal_nan=True,
                                   err_msg=name)
