"""ring_attention on rings of 2, 4 and 8 virtual CPU devices (conftest.py sets the device count) against one call.

The sequences are split over the ring inside jax.shard_map, in the contiguous or the zigzag layout; out, lse and
every gradient must equal flash_attn's on the whole sequences (the reference, f32). The ring's own backward (its
custom_vjp, what the kernels run) is checked with the reference inside each block, and also with api's kernel path
forced (the primitives, lowering to the reference off CUDA, reading the merged out and lse); backend="reference"
differentiates the ring by autodiff, forward mode included. Causal, windows on either side, GQA and MQA, sinks
(special values too), softcap, odd piece lengths and Sq != Sk both ways.
"""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flashjax
from flashjax import api, ring

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices: tests/cpu/conftest.py "
                                                                "sets XLA_FLAGS before jax starts")
B, D, DV = 2, 8, 6


@pytest.fixture
def ring_backward(monkeypatch):
    """The ring's custom_vjp on the reference backend too (it is what "auto" and "kernel" run)."""
    monkeypatch.setattr(ring, "AUTODIFF_BACKENDS", ())


@pytest.fixture
def kernel_path(monkeypatch, ring_backward):
    """api's kernel path for every block (padding, the fwd/bwd primitives given the merged out and lse)."""
    monkeypatch.setattr(api, "choose", lambda call, device_sm=None: ("kernel", "forced", {"head_dim": 64}))


def _inputs(seed, ring_size, len_q, len_k, heads_q, heads_k, sinks=True):
    rng = np.random.default_rng(seed)
    sq, sk = ring_size * len_q, ring_size * len_k
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return (normal(B, sq, heads_q, D), normal(B, sk, heads_k, D), normal(B, sk, heads_k, DV),
            normal(heads_q) if sinks else None, normal(B, sq, heads_q, DV), normal(B, heads_q, sq))


def _single(q, k, v, sinks, ct_out, ct_lse, **keywords):
    (out, lse), pullback = jax.vjp(lambda q, k, v, s: flashjax.flash_attn(q, k, v, sinks=s, return_lse=True,
                                                                          backend="reference", **keywords),
                                   q, k, v, sinks)
    return (out, lse, *pullback((ct_out, ct_lse)))


def _ring_mesh(ring_size):
    return jax.make_mesh((ring_size,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ring_size])


def _ringed(q, k, v, sinks, ct_out, ct_lse, *, ring_size, layout, **keywords):
    """_single's results, computed by ring_attention over `ring_size` devices (and put back in sequence order)."""
    order = (lambda x, axis=1: flashjax.to_zigzag(x, ring_size, axis=axis)) if layout == "zigzag" else \
        (lambda x, axis=1: x)
    back = (lambda x, axis=1: flashjax.from_zigzag(x, ring_size, axis=axis)) if layout == "zigzag" else \
        (lambda x, axis=1: x)
    seq, lse_seq = P(None, "seq"), P(None, None, "seq")
    attend = jax.shard_map(
        lambda q, k, v, s: flashjax.ring_attention(q, k, v, sinks=s, axis_name="seq", layout=layout,
                                                   return_lse=True, backend="reference", **keywords),
        mesh=_ring_mesh(ring_size), in_specs=(seq, seq, seq, P()), out_specs=(seq, lse_seq))
    (out, lse), pullback = jax.vjp(attend, order(q), order(k), order(v), sinks)
    dq, dk, dv, dsinks = pullback((order(ct_out), order(ct_lse, 2)))
    return back(out), back(lse, 2), back(dq), back(dk), back(dv), dsinks


def _assert_match(got, want, tolerance=2e-5):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        if w is None:
            continue
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tolerance, atol=tolerance, equal_nan=True,
                                   err_msg=name)


# (ring size, layout, query and key piece lengths per device, Hq, Hk, flash_attn keywords)
CASES = [
    (2, "contiguous", 5, 5, 4, 2, dict(causal=True)),
    (2, "zigzag", 4, 6, 2, 2, dict(window_size=(3, 1), softcap=2.5)),
    (2, "contiguous", 7, 3, 4, 1, dict(causal=True, window_size=(6, -1))),
    (4, "zigzag", 6, 6, 4, 2, dict(causal=True)),
    (4, "contiguous", 3, 5, 2, 1, dict()),
    (4, "zigzag", 6, 4, 4, 4, dict(window_size=(-1, 2), softmax_scale=0.7)),
    (4, "contiguous", 4, 4, 4, 2, dict(causal=True, window_size=(5, -1))),
    (8, "zigzag", 4, 4, 4, 2, dict(causal=True)),
    (8, "contiguous", 3, 5, 2, 1, dict(window_size=(7, 3))),
]


def _case_id(case):
    ring_size, layout, len_q, len_k, heads_q, heads_k, keywords = case
    return f"n{ring_size}-{layout}-{len_q}x{len_k}-h{heads_q}:{heads_k}-" + "-".join(f"{k}={v}" for k, v in
                                                                                   keywords.items())


def _assert_case_matches(case, seed):
    ring_size, layout, len_q, len_k, heads_q, heads_k, keywords = case
    inputs = _inputs(seed, ring_size, len_q, len_k, heads_q, heads_k)
    got = jax.jit(lambda *a: _ringed(*a, ring_size=ring_size, layout=layout, **keywords))(*inputs)
    _assert_match(got, jax.jit(lambda *a: _single(*a, **keywords))(*inputs))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ring_backward_matches_one_call(case, ring_backward):
    _assert_case_matches(case, seed=len(CASES) + CASES.index(case))


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=_case_id)
def test_kernel_path_blocks_match_one_call(case, kernel_path):
    _assert_case_matches(case, seed=100 + CASES.index(case))


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=_case_id)
def test_autodiff_of_the_reference_ring_matches_one_call(case):
    _assert_case_matches(case, seed=200 + CASES.index(case))


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_special_sinks_join_once(special, ring_backward):
    # Traced sinks (a concrete NaN is refused at the call); rows before the first key see no key (Sq > Sk, causal).
    q, k, v, sinks, ct_out, ct_lse = _inputs(7, 2, 6, 4, 4, 2)
    sinks = sinks.at[1].set(special)
    keywords = dict(causal=True)
    got = jax.jit(lambda *a: _ringed(*a, ring_size=2, layout="zigzag", **keywords))(q, k, v, sinks, ct_out, ct_lse)
    want = jax.jit(lambda *a: _single(*a, **keywords))(q, k, v, sinks, ct_out, ct_lse)
    assert np.isfinite(np.asarray(want[0])).sum() > 0
    _assert_match(got, want)


def test_forward_mode_through_the_reference_ring():
    q, k, v, _, _, _ = _inputs(8, 2, 5, 7, 4, 2, sinks=False)
    tangents = (jnp.flip(q, 1), jnp.flip(k, 1) * 0.5, -v)
    seq = P(None, "seq")
    attend = jax.shard_map(lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq", causal=True,
                                                                   backend="reference", return_lse=True),
                           mesh=_ring_mesh(2), in_specs=(seq,) * 3, out_specs=(seq, P(None, None, "seq")))
    single = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="reference", return_lse=True)
    got = jax.jit(lambda *a: jax.jvp(attend, a[:3], a[3:]))(q, k, v, *tangents)
    want = jax.jit(lambda *a: jax.jvp(single, a[:3], a[3:]))(q, k, v, *tangents)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_batch_head_and_sequence_parallel_on_one_mesh(ring_backward):
    # docs/sharding.md's example: a (batch 2, heads 2, seq 2) mesh, every axis manual inside shard_map.
    mesh = jax.make_mesh((2, 2, 2), ("batch", "heads", "seq"), axis_types=(AxisType.Auto,) * 3)
    q, k, v, sinks, ct_out, ct_lse = _inputs(9, 2, 6, 6, 4, 2)
    spec = P("batch", "seq", "heads")
    attend = jax.shard_map(
        lambda q, k, v, s: flashjax.ring_attention(q, k, v, sinks=s, axis_name="seq", causal=True, layout="zigzag",
                                                   return_lse=True, backend="reference"),
        mesh=mesh, in_specs=(spec, spec, spec, P("heads")), out_specs=(spec, P("batch", "heads", "seq")))
    zig = lambda x, axis=1: flashjax.to_zigzag(x, 2, axis=axis)
    unzig = lambda x, axis=1: flashjax.from_zigzag(x, 2, axis=axis)

    def run(q, k, v, sinks, ct_out, ct_lse):
        (out, lse), pullback = jax.vjp(attend, zig(q), zig(k), zig(v), sinks)
        dq, dk, dv, dsinks = pullback((zig(ct_out), zig(ct_lse, 2)))
        return unzig(out), unzig(lse, 2), unzig(dq), unzig(dk), unzig(dv), dsinks

    _assert_match(jax.jit(run)(q, k, v, sinks, ct_out, ct_lse),
                  jax.jit(lambda *a: _single(*a, causal=True))(q, k, v, sinks, ct_out, ct_lse))


def test_auto_axes_left_inside_the_shard_map(monkeypatch):
    # The ring's axis manual, the batch axis Auto: the reference path runs; the kernel path cannot be partitioned by
    # mesh axes there and says what to do.
    mesh = jax.make_mesh((2, 4), ("batch", "seq"), axis_types=(AxisType.Auto,) * 2)
    q = jax.device_put(_inputs(11, 4, 4, 4, 2, 2)[0], jax.sharding.NamedSharding(mesh, P("batch", "seq")))
    def attend():  # a new function each time: jit's cache does not know the path
        return jax.jit(jax.shard_map(lambda q: flashjax.ring_attention(q, q, q, axis_name="seq", causal=True,
                                                                       backend="reference"),
                                     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"), axis_names={"seq"}))

    want = flashjax.flash_attn(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q), causal=True, backend="reference")
    np.testing.assert_allclose(np.asarray(attend()(q)), np.asarray(want), rtol=2e-5, atol=2e-5)
    monkeypatch.setattr(api, "choose", lambda call, device_sm=None: ("kernel", "forced", {"head_dim": 64}))
    with pytest.raises(jax.errors.JaxRuntimeError, match="make every mesh axis manual"):
        attend().lower(q).compile()


def test_bf16_through_the_default_backend():
    # backend="auto" on the CPU: the reference in each block (a warning says so), the ring's own backward.
    q, k, v, sinks, ct_out, ct_lse = (None if x is None else x.astype(jnp.bfloat16) if x.ndim == 4 else x
                                      for x in _inputs(10, 4, 4, 4, 4, 2))
    seq = P(None, "seq")
    attend = jax.shard_map(lambda q, k, v, s: flashjax.ring_attention(q, k, v, sinks=s, axis_name="seq", causal=True,
                                                                      layout="zigzag"),
                           mesh=_ring_mesh(4), in_specs=(seq, seq, seq, P()), out_specs=seq)
    zig = lambda x: flashjax.to_zigzag(x, 4)

    def run(q, k, v, sinks, ct_out):
        out, pullback = jax.vjp(lambda *a: flashjax.from_zigzag(attend(*(zig(x) for x in a[:3]), a[3]), 4),
                                q, k, v, sinks)
        return (out, *pullback(ct_out))

    def single(q, k, v, sinks, ct_out):
        out, pullback = jax.vjp(lambda q, k, v, s: flashjax.flash_attn(q, k, v, sinks=s, causal=True,
                                                                       backend="reference"), q, k, v, sinks)
        return (out, *pullback(ct_out))

    ct_out = ct_out.astype(jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = jax.jit(run)(q, k, v, sinks, ct_out)
    f32 = lambda x: x.astype(jnp.float32)
    for g, w in zip(got, jax.jit(single)(*(f32(x) for x in (q, k, v, sinks, ct_out)))):
        error = np.linalg.norm(np.asarray(f32(g) - w)) / np.linalg.norm(np.asarray(w))
        assert error < 2e-2, error


def _collective_permutes(text):
    """(result name, operand names) of each collective-permute in a compiled module's text."""
    return re.findall(r"(%\S+) = \S+ collective-permute(?:-start)?\((%[^)]+)\)", text)


def test_kv_transfers_do_not_wait_for_compute(ring_backward):
    # What lets XLA overlap them with the kernels: each K/V transfer's operand is a parameter or the previous
    # transfer's result, never something a step computes. (CPU collectives are synchronous; docs/sharding.md says
    # what the GPU schedule does.)
    seq = P(None, "seq")
    attend = jax.jit(jax.shard_map(lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq", causal=True,
                                                                           layout="zigzag", backend="reference"),
                                   mesh=_ring_mesh(4), in_specs=(seq,) * 3, out_specs=seq))
    x = jnp.ones((B, 16, 2, D), jnp.float32)
    text = attend.lower(x, x, x).compile().as_text()
    permutes = _collective_permutes(text)
    assert len(permutes) == 2 * 3, permutes  # k and v, n - 1 times
    produced_by = dict(re.findall(r"(%\S+) = \S+ (\S+)\(", text))
    sources = {name for name, _ in permutes}
    for _, operand in permutes:
        assert operand in sources or produced_by.get(operand) in ("parameter", "copy", "bitcast"), operand


def test_misuse_is_refused():
    x = jnp.ones((1, 4, 2, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="axis_name 'seq' is not a mesh axis bound here: call it inside "
                                         "jax.shard_map"):
        flashjax.ring_attention(x, x, x, axis_name="seq")
    seq = P(None, "seq")
    odd = jnp.ones((1, 6, 2, D), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q.shape\[1\] must be even with layout='zigzag'"):
        jax.shard_map(lambda q: flashjax.ring_attention(q, q, q, axis_name="seq", layout="zigzag"),
                      mesh=_ring_mesh(2), in_specs=seq, out_specs=seq)(odd)
    with pytest.raises(ValueError, match="layout must be one of"):
        jax.shard_map(lambda q: flashjax.ring_attention(q, q, q, axis_name="seq", layout="striped"),
                      mesh=_ring_mesh(2), in_specs=seq, out_specs=seq)(x)
    with pytest.raises(ValueError, match=r"x.shape\[1\] must be a multiple of 2 \* ring_size = 8"):
        flashjax.to_zigzag(jnp.ones((1, 12, 2, D)), 4)


def test_zigzag_order_and_back():
    x = jnp.arange(2 * 12 * 3, dtype=jnp.float32).reshape(2, 12, 3)
    z = flashjax.to_zigzag(x, 3)
    # 6 chunks of 2: device 0 holds chunks 0 and 5, device 1 chunks 1 and 4, device 2 chunks 2 and 3.
    chunks = [0, 5, 1, 4, 2, 3]
    np.testing.assert_array_equal(np.asarray(z[0, :, 0]) // 3 // 2, np.repeat(chunks, 2))
    np.testing.assert_array_equal(np.asarray(flashjax.from_zigzag(z, 3)), np.asarray(x))
    lse = jnp.swapaxes(x, 1, 2)
    np.testing.assert_array_equal(np.asarray(flashjax.from_zigzag(flashjax.to_zigzag(lse, 2, axis=2), 2, axis=2)),
                                  np.asarray(lse))


def test_the_sharding_example_runs(capsys):
    # examples/sharding.py, shown in docs/sharding.md: batch, heads and sequence split on one mesh of 8 devices.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "examples" / "sharding.py"
    spec = importlib.util.spec_from_file_location("sharding_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example.main()
    assert "gradients match" in capsys.readouterr().out
