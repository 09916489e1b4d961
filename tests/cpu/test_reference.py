"""The pure-JAX reference against the float64 NumPy oracle, plus its edge cases.

Random cases draw fresh data (never zeros) over shapes, GQA ratios, head dims,
causal/window/sink/softcap/mask-mod combinations and input dtypes; each case is
one jit compile, so the counts below are the knob for the suite's runtime.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# tests/conftest.py puts python/ on sys.path and tests/cpu/conftest.py selects
# the CPU platform; pytest's rootdir-relative import finds the oracle beside us.
import numpy_oracle as oracle
from flashjax import masks, reference

DENSE_CASES = 104
VARLEN_CASES = 32
JVP_CASES = 10

# Relative (by norm) tolerances against the float64 oracle. f32 inputs: f32
# accumulation error only. bf16/fp16 inputs: the oracle runs on the same
# rounded inputs, so the error is the rounding of the outputs and gradients.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 6e-3, jnp.float16: 1e-3}
LSE_ATOL = 2e-5

# Each case compiles its own small graph: compile time dominates the suite, and
# skipping LLVM's expensive passes halves it without changing f32 results
# beyond rounding.
_FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


def fast_jit(fn):
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


@dataclasses.dataclass(frozen=True)
class HeadStripeMask(masks.MaskMod):
    """Test-only mod using every index, h included: drops keys on a head-dependent stripe."""

    stride: int = masks.static()

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx + kv_idx + h) % self.stride != 0


@dataclasses.dataclass(frozen=True)
class EvenRowsMask(masks.MaskMod):
    """Test-only mod that empties every odd query row."""

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx >= 0)


# --------------------------------------------------------------------------- case generation


def _random_mask(rng, batch: int, seqlen: int):
    """(MaskMod, the same predicate in NumPy) of a random kind; ``batch`` rows of ``seqlen`` ids."""
    kind = rng.choice(["causal", "document", "window", "prefix", "stripe"])
    if kind == "causal":
        return masks.causal_mask(), lambda b, h, i, j: j <= i
    if kind == "document":
        doc_ids = np.cumsum(rng.random((batch, max(seqlen, 1))) < 0.2, axis=1).astype(np.int32)
        return masks.document_mask(doc_ids), lambda b, h, i, j: doc_ids[b][i] == doc_ids[b][j]
    if kind == "window":
        left, right = int(rng.integers(0, 6)), int(rng.integers(0, 4))
        return masks.sliding_window_mask(left, right), lambda b, h, i, j: (j >= i - left) & (j <= i + right)
    if kind == "prefix":
        prefix_len = rng.integers(0, seqlen + 2, size=batch).astype(np.int32)
        return masks.prefix_lm_mask(prefix_len), lambda b, h, i, j: (j < prefix_len[b]) | (j <= i)
    stride = int(rng.integers(2, 5))
    return HeadStripeMask(stride), lambda b, h, i, j: (i + j + h) % stride != 0


def _random_window(rng, seqlen: int):
    """Unbounded, one-sided, two-sided or (0, 0); bounds reach 5 past the sequence (wider than it)."""
    left, right = (int(bound) for bound in rng.integers(0, seqlen + 6, size=2))
    return [(-1, -1), (left, -1), (-1, right), (left, right), (0, 0)][rng.integers(0, 5)]


def _random_options(rng, head_dim: int, heads_q: int, batch: int, seqlen: int):
    """Keyword arguments shared by the reference and the oracle, and the reference's mask mod."""
    mask_mod, allow = _random_mask(rng, batch, seqlen) if rng.random() < 0.35 else (None, None)
    options = dict(
        scale=float(rng.uniform(0.5, 2.0) / np.sqrt(head_dim)),
        causal=bool(rng.random() < 0.5),
        window=_random_window(rng, seqlen),
        sinks=rng.normal(0.0, 2.0, heads_q).astype(np.float32) if rng.random() < 0.35 else None,
        softcap=float(rng.choice([1.5, 10.0])) if rng.random() < 0.25 else 0.0,
        allow=allow,
    )
    return options, mask_mod


def _random_heads(rng):
    heads_k = int(rng.integers(1, 3))
    return heads_k * int(rng.choice([1, 2, 4])), heads_k


def _random_head_dims(rng):
    head_dim = int(rng.choice([8, 16, 24, 32, 40, 64]))
    return head_dim, (head_dim if rng.random() < 0.7 else int(rng.choice([8, 16, 48])))


def _random_dtype(rng):
    return [jnp.float32, jnp.bfloat16, jnp.float16][rng.choice(3, p=[0.8, 0.1, 0.1])]


def _random_seqlen(rng, high: int):
    return 0 if rng.random() < 0.06 else int(rng.integers(1, high + 1))


def _normal(rng, shape, dtype):
    """Fresh N(0, 1) data rounded to ``dtype``, returned as (jax array, its exact float64 values)."""
    x = jnp.asarray(rng.normal(size=shape), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def _reference_kwargs(options, mask_mod):
    return dict(softmax_scale=options["scale"], causal=options["causal"], window_size=options["window"],
                softcap=options["softcap"], mask_mod=mask_mod)


def _sinks_array(options):
    return None if options["sinks"] is None else jnp.asarray(options["sinks"])


# --------------------------------------------------------------------------- comparison helpers


def assert_close(actual, expected, rtol, what):
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN"
    error = np.linalg.norm(actual - expected)
    scale = np.linalg.norm(expected)
    assert error <= rtol * scale + 1e-6, f"{what}: |err| {error:.3g} vs |ref| {scale:.3g} (rtol {rtol})"


def assert_lse_close(actual, expected, what):
    assert actual.dtype == jnp.float32, f"{what}: dtype {actual.dtype}"
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{what}: -inf pattern")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=LSE_ATOL, atol=LSE_ATOL, err_msg=what)


def _value_and_grads(fn, primals, cotangents):
    """jit(fn) and its vjp in one compile: (out, lse, grads of primals)."""

    def run(primals, cotangents):
        (out, lse), pullback = jax.vjp(fn, *primals)
        return out, lse, pullback(cotangents)

    return fast_jit(run)(primals, cotangents)


# --------------------------------------------------------------------------- dense vs oracle


def _dense_case(seed: int):
    rng = np.random.default_rng(1000 + seed)
    batch = int(rng.integers(1, 4))
    seqlen_q, seqlen_k = _random_seqlen(rng, 40), _random_seqlen(rng, 40)
    if rng.random() < 0.25:  # self-attention shapes, where bottom-right and top-left alignments agree
        seqlen_k = seqlen_q
    heads_q, heads_k = _random_heads(rng)
    head_dim, head_dim_v = _random_head_dims(rng)
    dtype = _random_dtype(rng)
    options, mask_mod = _random_options(rng, head_dim, heads_q, batch, max(seqlen_q, seqlen_k))
    q, q64 = _normal(rng, (batch, seqlen_q, heads_q, head_dim), dtype)
    k, k64 = _normal(rng, (batch, seqlen_k, heads_k, head_dim), dtype)
    v, v64 = _normal(rng, (batch, seqlen_k, heads_k, head_dim_v), dtype)
    d_out = rng.normal(size=(batch, seqlen_q, heads_q, head_dim_v)).astype(np.float32)
    d_lse = rng.normal(size=(batch, heads_q, seqlen_q)).astype(np.float32)
    return dtype, options, mask_mod, (q, k, v), (q64, k64, v64), d_out, d_lse


@pytest.mark.parametrize("seed", range(DENSE_CASES))
def test_dense_matches_oracle(seed):
    """Forward (out, lse) on every case; gradients dq, dk, dv, dsinks on every other one."""
    dtype, options, mask_mod, (q, k, v), (q64, k64, v64), d_out, d_lse = _dense_case(seed)
    describe = f"case {seed}: {q.shape} {k.shape} {v.shape} {jnp.dtype(dtype).name} {options} {mask_mod}"
    sinks = _sinks_array(options)
    kwargs = _reference_kwargs(options, mask_mod)
    fn = lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, **kwargs)  # noqa: E731
    rtol = RTOL[dtype]
    with_grads = seed % 2 == 0
    if with_grads:
        cotangents = (jnp.asarray(d_out, dtype), jnp.asarray(d_lse))
        out, lse, grads = _value_and_grads(fn, (q, k, v, sinks), cotangents)
        d_out64 = np.asarray(cotangents[0].astype(jnp.float32), np.float64)
    else:
        out, lse = fast_jit(fn)(q, k, v, sinks)
        d_out64 = None
    expected = oracle.attention_with_grads(q64, k64, v64, d_out=d_out64, d_lse=d_lse, **options)

    assert out.dtype == q.dtype and lse.dtype == jnp.float32, describe
    assert_close(out, expected[0], rtol, f"out, {describe}")
    assert_lse_close(lse, expected[1], f"lse, {describe}")
    if with_grads:
        for name, grad, want in zip(["dq", "dk", "dv"], grads[:3], expected[2:5]):
            assert grad.dtype == q.dtype, describe
            assert_close(grad, want, rtol, f"{name}, {describe}")
        if sinks is not None:
            assert_close(grads[3], expected[5], rtol, f"dsinks, {describe}")


def _directional_derivative(f, x, t, eps=1e-5):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


@pytest.mark.parametrize("seed", range(4))
def test_oracle_gradients_match_finite_differences(seed):
    """The oracle's hand-derived gradients against central differences of its own forward."""
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, heads_k = 2, 7, 9, 2
    heads_q = heads_k * 2
    q, k, v = (rng.normal(size=s) for s in [(batch, seqlen_q, heads_q, 8), (batch, seqlen_k, heads_k, 8),
                                            (batch, seqlen_k, heads_k, 16)])
    options = dict(scale=0.4, causal=seed % 2 == 0, window=[(-1, -1), (3, 1)][seed // 2],
                   sinks=rng.normal(size=heads_q), softcap=[0.0, 2.0][seed % 2],
                   allow=(lambda b, h, i, j: (i + j + h + b) % 3 != 0) if seed == 3 else None)
    d_out = rng.normal(size=(batch, seqlen_q, heads_q, 16))
    d_lse = rng.normal(size=(batch, heads_q, seqlen_q))
    _, _, *grads = oracle.attention_with_grads(q, k, v, d_out=d_out, d_lse=d_lse, **options)

    def loss(q, k, v, sinks):
        out, lse = oracle.attention(q, k, v, **{**options, "sinks": sinks})
        return np.sum(out * d_out) + np.sum(np.where(np.isfinite(lse), lse * d_lse, 0.0))

    primals = [q, k, v, options["sinks"]]
    for index, grad in enumerate(grads):
        direction = rng.normal(size=primals[index].shape)
        along = lambda x: loss(*primals[:index], x, *primals[index + 1:])  # noqa: E731
        fd = _directional_derivative(along, primals[index], direction)
        np.testing.assert_allclose(np.sum(grad * direction), fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("seed", range(JVP_CASES))
def test_jvp_matches_finite_differences(seed):
    """Forward mode through out and lse against central differences of the float64 oracle."""
    _, options, mask_mod, _, (q64, k64, v64), _, _ = _dense_case(seed)
    rng = np.random.default_rng(seed)
    sinks64 = None if options["sinks"] is None else options["sinks"].astype(np.float64)
    primals64 = [q64, k64, v64] + ([] if sinks64 is None else [sinks64])
    tangents64 = [rng.normal(size=x.shape) for x in primals64]
    kwargs = _reference_kwargs(options, mask_mod)

    def fn(q, k, v, *sinks):
        return reference.attention(q, k, v, sinks=sinks[0] if sinks else None, **kwargs)

    as_f32 = lambda xs: [jnp.asarray(x, jnp.float32) for x in xs]  # noqa: E731
    (out, lse), (t_out, t_lse) = fast_jit(lambda p, t: jax.jvp(fn, p, t))(as_f32(primals64), as_f32(tangents64))

    def oracle_at(eps):
        moved = [x + eps * t for x, t in zip(primals64, tangents64)]
        return oracle.attention(*moved[:3], **{**options, "sinks": moved[3] if sinks64 is not None else None})

    (out_plus, lse_plus), (out_minus, lse_minus) = oracle_at(1e-5), oracle_at(-1e-5)
    assert_close(t_out, (out_plus - out_minus) / 2e-5, 1e-4, f"t_out case {seed}")
    finite = np.isfinite(lse_plus)
    t_lse = np.asarray(t_lse, np.float64)
    assert np.isfinite(t_lse).all(), "lse tangent must be finite, 0 on empty rows"
    np.testing.assert_array_equal(t_lse[~finite], 0.0)
    assert_close(t_lse[finite], (lse_plus[finite] - lse_minus[finite]) / 2e-5, 1e-4, f"t_lse case {seed}")


# --------------------------------------------------------------------------- varlen


def _random_packing(rng, num_seqs: int, high: int):
    """(cu_seqlens, total tokens incl. trailing padding, seqused or None)."""
    lengths = [0 if rng.random() < 0.2 else int(rng.integers(1, high + 1)) for _ in range(num_seqs)]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    padding = int(rng.integers(0, 4)) if rng.random() < 0.4 else 0
    seqused = None
    if rng.random() < 0.35:
        seqused = np.array([rng.integers(0, n + 1) for n in lengths], np.int32)
    return cu_seqlens, int(cu_seqlens[-1]) + padding, seqused


def _poison_unused(x64, cu_seqlens, seqused):
    """NaN in every token outside the used ranges: the reference must never read them."""
    used = oracle.used_lengths(cu_seqlens, seqused)
    poisoned = np.full_like(x64, np.nan)
    for start, count in zip(cu_seqlens[:-1], used):
        poisoned[start:start + count] = x64[start:start + count]
    return poisoned


def _varlen_case(seed: int):
    rng = np.random.default_rng(5000 + seed)
    num_seqs = int(rng.integers(1, 5))
    cu_q, total_q, seqused_q = _random_packing(rng, num_seqs, 12)
    cu_k, total_k, seqused_k = _random_packing(rng, num_seqs, 14)
    heads_q, heads_k = _random_heads(rng)
    head_dim, head_dim_v = _random_head_dims(rng)
    dtype = _random_dtype(rng)
    options, mask_mod = _random_options(rng, head_dim, heads_q, num_seqs, 14)
    q64 = _poison_unused(np.asarray(_normal(rng, (total_q, heads_q, head_dim), dtype)[1]), cu_q, seqused_q)
    k64 = _poison_unused(np.asarray(_normal(rng, (total_k, heads_k, head_dim), dtype)[1]), cu_k, seqused_k)
    v64 = _poison_unused(np.asarray(_normal(rng, (total_k, heads_k, head_dim_v), dtype)[1]), cu_k, seqused_k)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=seqused_q, seqused_k=seqused_k)
    return dtype, options, mask_mod, (q64, k64, v64), packing, rng


def _varlen_fn(packing, kwargs):
    as_jax = {name: None if x is None else jnp.asarray(x) for name, x in packing.items()}

    def fn(q, k, v, sinks):
        return reference.attention_varlen(q, k, v, as_jax["cu_seqlens_q"], as_jax["cu_seqlens_k"],
                                          seqused_q=as_jax["seqused_q"], seqused_k=as_jax["seqused_k"],
                                          sinks=sinks, **kwargs)

    return fn


def _max_seqlen_hints(packing, hints):
    """max_seqlen_q/k for the case: none, the longest slots ("tight": the per-sequence evaluation), or one token
    short of them ("short": the run-time branch back to all pairs)."""
    if hints == "none":
        return {}
    longest = [int(np.max(np.diff(packing[name]), initial=0)) for name in ("cu_seqlens_q", "cu_seqlens_k")]
    if hints == "short":
        longest = [max(n - 1, 1) for n in longest]
    return dict(max_seqlen_q=longest[0], max_seqlen_k=longest[1])


@pytest.mark.parametrize("seed,hints", [(seed, "none") for seed in range(VARLEN_CASES)]
                         + [(seed, hints) for seed in range(VARLEN_CASES // 2) for hints in ("tight", "short")])
def test_varlen_matches_oracle(seed, hints):
    """Packed forward and gradients, with NaN in every unused or padding token; evaluated all pairs, and per
    sequence with max_seqlen hints (and its fallback when the hints are short)."""
    dtype, options, mask_mod, (q64, k64, v64), packing, rng = _varlen_case(seed)
    describe = f"varlen case {seed} ({hints}): {packing} {q64.shape} {k64.shape} {v64.shape} {options} {mask_mod}"
    q, k, v = (jnp.asarray(x, dtype) for x in (q64, k64, v64))
    sinks = _sinks_array(options)
    d_out = jnp.asarray(rng.normal(size=q.shape[:2] + v.shape[-1:]), dtype)
    d_lse = jnp.asarray(rng.normal(size=(q.shape[1], q.shape[0])), jnp.float32)
    fn = _varlen_fn(packing, {**_reference_kwargs(options, mask_mod), **_max_seqlen_hints(packing, hints)})
    out, lse, grads = _value_and_grads(fn, (q, k, v, sinks), (d_out, d_lse))
    expected = oracle.varlen_attention_with_grads(
        q64, k64, v64, **packing, d_out=np.asarray(d_out.astype(jnp.float32), np.float64),
        d_lse=np.asarray(d_lse, np.float64), **options)

    rtol = RTOL[dtype]
    assert_close(out, expected[0], rtol, f"out, {describe}")
    assert_lse_close(lse, expected[1], f"lse, {describe}")
    for name, grad, want in zip(["dq", "dk", "dv"], grads[:3], expected[2:5]):
        assert_close(grad, want, rtol, f"{name}, {describe}")
    if sinks is not None:
        assert_close(grads[3], expected[5], rtol, f"dsinks, {describe}")


@pytest.mark.parametrize("seed", range(4))
def test_varlen_matches_dense_per_sequence(seed):
    """Each packed sequence equals a dense B=1 call on its used tokens."""
    _, options, _, (q64, k64, v64), packing, rng = _varlen_case(seed + 100)
    num_seqs = len(packing["cu_seqlens_q"]) - 1
    doc_ids = rng.integers(0, 2, size=(num_seqs, 14)).astype(np.int32)
    kwargs = _reference_kwargs(options, masks.document_mask(doc_ids))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q64, k64, v64))
    out, lse = fast_jit(_varlen_fn(packing, kwargs))(q, k, v, _sinks_array(options))

    used_q = oracle.used_lengths(packing["cu_seqlens_q"], packing["seqused_q"])
    used_k = oracle.used_lengths(packing["cu_seqlens_k"], packing["seqused_k"])
    for b in range(num_seqs):
        rows = slice(packing["cu_seqlens_q"][b], packing["cu_seqlens_q"][b] + used_q[b])
        cols = slice(packing["cu_seqlens_k"][b], packing["cu_seqlens_k"][b] + used_k[b])
        dense_kwargs = {**kwargs, "mask_mod": masks.document_mask(doc_ids[b:b + 1])}
        dense = fast_jit(lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, **dense_kwargs))
        dense_out, dense_lse = dense(q[None, rows], k[None, cols], v[None, cols], _sinks_array(options))
        np.testing.assert_allclose(out[rows], dense_out[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, rows], dense_lse[0], rtol=1e-5, atol=1e-6)


def test_varlen_one_trace_serves_every_packing():
    """cu_seqlens/seqused are runtime data: new packings of the same token counts reuse the trace."""
    traces = []

    @fast_jit
    def run(q, k, v, cu_q, cu_k, used_k):
        traces.append(None)
        return reference.attention_varlen(q, k, v, cu_q, cu_k, seqused_q=None, seqused_k=used_k,
                                          softmax_scale=0.5, causal=True, window_size=(4, -1), sinks=None,
                                          softcap=0.0, mask_mod=None)

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(12, 2, 8), (20, 1, 8), (20, 1, 8)])
    packings = [([0, 4, 8, 12], [0, 5, 10, 20], [5, 5, 10]), ([0, 0, 1, 12], [0, 7, 7, 20], [3, 0, 13]),
                ([0, 12, 12, 12], [0, 20, 20, 20], [20, 0, 0])]
    for cu_q, cu_k, used_k in packings:
        out, lse = run(q, k, v, *(jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used_k)))
        expected_out, expected_lse = oracle.varlen_attention(
            np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(cu_q), np.asarray(cu_k),
            seqused_k=np.asarray(used_k), scale=0.5, causal=True, window=(4, -1))
        assert_close(out, expected_out, 2e-5, f"packing {cu_q} {cu_k}")
        assert_lse_close(lse, expected_lse, f"packing {cu_q} {cu_k}")
    assert len(traces) == 1


def test_varlen_unused_rows_are_empty_even_with_sinks():
    """Documented choice: unused query rows and padding get out 0, lse -inf (no sink), zero grads."""
    rng = np.random.default_rng(3)
    cu = jnp.asarray([0, 5, 9], jnp.int32)
    seqused_q = jnp.asarray([2, 4], jnp.int32)
    total_q = 11  # two padding tokens past cu[-1]
    q = jnp.asarray(rng.normal(size=(total_q, 2, 8)), jnp.float32).at[2:5].set(jnp.nan).at[9:].set(jnp.inf)
    k, v = (jnp.asarray(rng.normal(size=(9, 1, 8)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)

    def fn(q, k, v, sinks):
        return reference.attention_varlen(q, k, v, cu, cu, seqused_q=seqused_q, seqused_k=None,
                                          softmax_scale=0.3, causal=False, window_size=(-1, -1), sinks=sinks,
                                          softcap=0.0, mask_mod=None)

    d_out, d_lse = jnp.ones((total_q, 2, 8)), jnp.ones((2, total_q))
    out, lse, (dq, dk, dv, dsinks) = _value_and_grads(fn, (q, k, v, sinks), (d_out, d_lse))
    unused = np.asarray([2, 3, 4, 9, 10])
    np.testing.assert_array_equal(out[unused], 0.0)
    np.testing.assert_array_equal(lse[:, unused], -np.inf)
    np.testing.assert_array_equal(dq[unused], 0.0)
    for x in (out, dq, dk, dv, dsinks):
        assert np.isfinite(np.asarray(x)).all()
    assert np.isfinite(np.asarray(lse)[:, [0, 1, 5, 6, 7, 8]]).all()


# --------------------------------------------------------------------------- empty rows


def _empty_row_problem(rng, seqlen_q, seqlen_k, with_sinks):
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in [(2, seqlen_q, 4, 16), (2, seqlen_k, 2, 16), (2, seqlen_k, 2, 8)])
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32) if with_sinks else None
    return q, k, v, sinks


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("layout", ["causal_short_k", "no_keys", "mask_mod", "window"])
def test_empty_rows_are_zero_without_nan(layout, with_sinks):
    """Rows with no visible key: out exactly 0, lse -inf (sink_h with sinks), zero grads, no NaN anywhere."""
    rng = np.random.default_rng(7)
    seqlen_q, seqlen_k = {"causal_short_k": (8, 3), "no_keys": (5, 0), "mask_mod": (6, 6), "window": (9, 6)}[layout]
    # "window": offset Sk - Sq = -3 puts rows 0..2 wholly left of the keys.
    kwargs = dict(softmax_scale=0.25, causal=layout == "causal_short_k",
                  window_size=(1, 0) if layout == "window" else (-1, -1), softcap=0.0,
                  mask_mod=EvenRowsMask() if layout == "mask_mod" else None)
    q, k, v, sinks = _empty_row_problem(rng, seqlen_q, seqlen_k, with_sinks)
    fn = lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, **kwargs)  # noqa: E731
    d_out = jnp.asarray(rng.normal(size=(2, seqlen_q, 4, 8)), jnp.float32)
    d_lse = jnp.asarray(rng.normal(size=(2, 4, seqlen_q)), jnp.float32)
    out, lse, grads = _value_and_grads(fn, (q, k, v, sinks), (d_out, d_lse))

    visible = oracle.band(seqlen_q, seqlen_k, kwargs["causal"], kwargs["window_size"])
    if layout == "mask_mod":
        visible = visible & (np.arange(seqlen_q)[:, None] % 2 == 0)
    empty = ~visible.any(axis=1)
    assert empty.any()
    np.testing.assert_array_equal(out[:, empty], 0.0)
    expected_lse = np.broadcast_to(-np.inf if sinks is None else np.asarray(sinks)[None, :, None], lse.shape)
    np.testing.assert_array_equal(lse[:, :, empty], expected_lse[:, :, empty])
    np.testing.assert_array_equal(grads[0][:, empty], 0.0)
    for x in (out, *[g for g in grads if g is not None]):
        assert np.isfinite(np.asarray(x)).all()

    tangents = tuple(jnp.ones_like(x) for x in (q, k, v)) + (None if sinks is None else jnp.ones_like(sinks),)
    _, (t_out, t_lse) = fast_jit(lambda p, t: jax.jvp(fn, p, t))((q, k, v, sinks), tangents)
    assert np.isfinite(np.asarray(t_out)).all() and np.isfinite(np.asarray(t_lse)).all()
    np.testing.assert_array_equal(t_out[:, empty], 0.0)


def test_zero_length_queries_and_keys():
    """Sq = 0 gives empty outputs; Sk = 0 is covered by the empty-row test."""
    q = jnp.ones((2, 0, 4, 8), jnp.float32)
    k = v = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 2, 8)), jnp.float32)
    out, lse = _attend(q, k, v, causal=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)


# --------------------------------------------------------------------------- semantics spot checks


def _problem(rng, seqlen_q=9, seqlen_k=13, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.normal(size=s), dtype)
                 for s in [(2, seqlen_q, 4, 16), (2, seqlen_k, 2, 16), (2, seqlen_k, 2, 24)])


def _attend(q, k, v, sinks=None, **overrides):
    kwargs = {**dict(softmax_scale=0.3, causal=False, window_size=(-1, -1), softcap=0.0, mask_mod=None), **overrides}
    return fast_jit(lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, **kwargs))(q, k, v, sinks)


def test_sinks_rescale_the_sinkless_result():
    """§2.4: out = out_nosink * sigmoid(lse_nosink - sink), lse = logaddexp(lse_nosink, sink)."""
    q, k, v = _problem(np.random.default_rng(1))
    sinks = jnp.asarray([-1.0, 0.0, 2.0, 5.0])
    out, lse = _attend(q, k, v, causal=True, sinks=sinks)
    out0, lse0 = _attend(q, k, v, causal=True)
    share = jax.nn.sigmoid(lse0 - sinks[None, :, None])
    np.testing.assert_allclose(out, out0 * jnp.swapaxes(share, 1, 2)[..., None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, jnp.logaddexp(lse0, sinks[None, :, None]), rtol=1e-6)


def test_causal_forces_right_bound_to_zero():
    """§2.3: causal=True keeps the left bound of window_size and forces right = 0."""
    q, k, v = _problem(np.random.default_rng(2))
    expected = _attend(q, k, v, window_size=(3, 0))
    for attended in (_attend(q, k, v, causal=True, window_size=(3, 5)), _attend(q, k, v, causal=True,
                                                                               window_size=(3, -1))):
        np.testing.assert_array_equal(attended[0], expected[0])
        np.testing.assert_array_equal(attended[1], expected[1])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 9), (5, 9), (9, 5)])
def test_causal_mask_mod_is_top_left(seqlen_q, seqlen_k):
    """causal_mask() sees raw indices: equal to causal=True only when Sq == Sk."""
    q, k, v = _problem(np.random.default_rng(3), seqlen_q, seqlen_k)
    top_left = _attend(q, k, v, mask_mod=masks.causal_mask())
    bottom_right = _attend(q, k, v, causal=True)
    expected = oracle.attention(q, k, v, scale=0.3, allow=lambda b, h, i, j: j <= i)
    assert_close(top_left[0], expected[0], 2e-5, "top-left causal mask mod")
    assert np.array_equal(top_left[0], bottom_right[0]) == (seqlen_q == seqlen_k)


def test_mask_mod_is_anded_with_causal_and_window():
    rng = np.random.default_rng(4)
    q, k, v = _problem(rng, 10, 14)
    doc_ids = np.repeat(np.arange(4), 4)[None].repeat(2, 0).astype(np.int32)
    out, lse = _attend(q, k, v, causal=True, window_size=(5, -1), mask_mod=masks.document_mask(doc_ids))
    expected = oracle.attention(q, k, v, scale=0.3, causal=True, window=(5, -1),
                                allow=lambda b, h, i, j: doc_ids[b][i] == doc_ids[b][j])
    assert_close(out, expected[0], 2e-5, "mask AND causal/window")
    assert_lse_close(lse, expected[1], "mask AND causal/window")


def test_mask_mod_leaves_are_runtime_data():
    """A mask mod passed through jit: new document ids reuse the trace and change the result."""
    traces = []

    @fast_jit
    def run(q, k, v, mask_mod):
        traces.append(None)
        return reference.attention(q, k, v, softmax_scale=0.3, causal=True, window_size=(-1, -1), sinks=None,
                                   softcap=0.0, mask_mod=mask_mod)

    q, k, v = _problem(np.random.default_rng(9), 9, 9)
    for doc_ids in (np.array([[0, 0, 0, 1, 1, 1, 2, 2, 2]] * 2, np.int32), np.array([[0] * 4 + [1] * 5] * 2, np.int32)):
        out, lse = run(q, k, v, masks.document_mask(doc_ids))
        expected = oracle.attention(q, k, v, scale=0.3, causal=True,
                                    allow=lambda b, h, i, j: doc_ids[b][i] == doc_ids[b][j])
        assert_close(out, expected[0], 2e-5, "document mask through jit")
    assert len(traces) == 1


def test_large_logits_do_not_overflow():
    q, k, v = _problem(np.random.default_rng(5))
    out, lse = _attend(q * 40.0, k * 40.0, v, sinks=jnp.asarray([300.0, -300.0, 0.0, 1e4]))
    expected = oracle.attention(np.asarray(q) * 40.0, np.asarray(k) * 40.0, np.asarray(v), scale=0.3,
                                sinks=np.asarray([300.0, -300.0, 0.0, 1e4]))
    assert_close(out, expected[0], 1e-4, "large logits")
    np.testing.assert_allclose(lse, expected[1], rtol=1e-5)


def test_vmap_over_leading_axis():
    q, k, v = _problem(np.random.default_rng(6))
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    kwargs = dict(softmax_scale=0.3, causal=True, window_size=(-1, -1), sinks=None, softcap=0.0, mask_mod=None)
    out, lse = fast_jit(jax.vmap(lambda q, k, v: reference.attention(q, k, v, **kwargs)))(*stacked)
    for index in range(2):
        single = _attend(*(x[index] for x in stacked), causal=True)
        np.testing.assert_allclose(out[index], single[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse[index], single[1], rtol=1e-6)


# --------------------------------------------------------------------------- chunking


@pytest.mark.parametrize("rows_per_chunk", [1, 4])
def test_chunked_equals_unchunked(monkeypatch, rows_per_chunk):
    """Query-row chunking (budget forced small) gives the same values and gradients, dense and varlen."""
    rng = np.random.default_rng(8)
    q, k, v = _problem(rng, 11, 13)
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
    doc_ids = rng.integers(0, 3, size=(3, 16)).astype(np.int32)  # dense b < 2, varlen b < 3
    kwargs = dict(softmax_scale=0.3, causal=True, window_size=(6, -1), softcap=5.0,
                  mask_mod=masks.document_mask(doc_ids))
    cu_q, cu_k = jnp.asarray([0, 4, 4, 20], jnp.int32), jnp.asarray([0, 9, 15, 26], jnp.int32)
    varlen_inputs = (q.reshape(22, 4, 16), k.reshape(26, 2, 16), v.reshape(26, 2, 24))

    def dense(q, k, v, sinks):
        return reference.attention(q, k, v, sinks=sinks, **kwargs)

    def varlen(q, k, v, sinks):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, seqused_q=jnp.asarray([4, 0, 14]),
                                          seqused_k=None, sinks=sinks, **kwargs)

    results = {}
    for chunked in (False, True):
        if chunked:
            monkeypatch.setattr(reference, "_SCORE_BYTES_BUDGET", 4 * 2 * 4 * 13 * rows_per_chunk)
        for name, fn, inputs in (("dense", dense, (q, k, v)), ("varlen", varlen, varlen_inputs)):
            cotangents = tuple(jnp.ones(x.shape) for x in jax.eval_shape(fn, *inputs, sinks))
            out, lse, grads = _value_and_grads(fn, (*inputs, sinks), cotangents)
            results[name, chunked] = (out, lse, *grads)
    for name in ("dense", "varlen"):
        for got, want in zip(results[name, True], results[name, False]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
