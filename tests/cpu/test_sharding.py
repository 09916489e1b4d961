"""flash_attn split over batch and heads on 8 virtual CPU devices (conftest.py sets the device count).

Each sharded call is compiled, its optimized HLO must hold no all-gather, all-to-all, collective-permute or
reduce-scatter (the only all-reduce allowed is dsinks', a sum over the batch shards of Hq floats), and its results
must equal the unsharded call's. Both paths run: the reference, and api's kernel path (the primitives, partitioned
by sharding.py; off CUDA they lower to the reference), with Auto and Explicit mesh axes. Sequence sharding and KV heads
split from their query heads raise, naming ring attention and the head counts.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flashjax
from flashjax import api, primitives

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices: tests/cpu/conftest.py "
                                                                "sets XLA_FLAGS before jax starts")

B, SQ, SK, HQ, HK, D, DV = 4, 12, 8, 8, 4, 16, 8
_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(-start)?\(")
SPECS = {"batch": ("batch", None), "heads": (None, "heads"), "both": ("batch", "heads")}


@pytest.fixture(params=["reference", "kernel"])
def path(request, monkeypatch):
    if request.param == "kernel":
        # api's kernel path (padding to a compiled width, the primitives and their partitioning rule) on the CPU.
        monkeypatch.setattr(api, "choose", lambda call, device_sm=None: ("kernel", "forced", {"head_dim": 64}))
    return request.param


def _mesh(axis_type):
    return jax.make_mesh((2, 4), ("batch", "heads"), axis_types=(axis_type, axis_type))


def _random(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _dense_inputs(seed, heads_k=HK):
    rng = np.random.default_rng(seed)
    return (_random(rng, B, SQ, HQ, D), _random(rng, B, SK, heads_k, D), _random(rng, B, SK, heads_k, DV),
            _random(rng, HQ), _random(rng, B, SQ, HQ, DV), _random(rng, B, HQ, SQ))


def _collectives(compiled_text):
    """(op, [element counts of its results]) for every collective of a compiled module."""
    found = []
    for types, op, _ in _COLLECTIVE.findall(compiled_text):
        counts = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", types)]
        found.append((op, counts))
    return found


def _assert_per_shard(fn, args, max_reduced=HQ):
    """fn compiled for sharded args has no communication but an all-reduce of at most max_reduced floats."""
    for op, counts in _collectives(jax.jit(fn).lower(*args).compile().as_text()):
        assert op == "all-reduce" and max(counts) <= max_reduced, (op, counts)


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _dense_vjp(q, k, v, sinks, ct_out, ct_lse):
    def call(q, k, v, sinks):
        return flashjax.flash_attn(q, k, v, sinks=sinks, causal=True, window_size=(5, -1), softcap=3.0,
                                   return_lse=True, backend="reference")
    (out, lse), pullback = jax.vjp(call, q, k, v, sinks)
    return (out, lse, *pullback((ct_out, ct_lse)))


def _assert_close(got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("split", sorted(SPECS))
def test_forward_and_backward_run_per_shard(path, axis_type, split):
    batch, heads = SPECS[split]
    mesh = _mesh(axis_type)
    inputs = _dense_inputs(seed=len(split))
    want = jax.jit(_dense_vjp)(*inputs)
    q, k, v, sinks, ct_out, ct_lse = inputs
    args = (_put(mesh, q, batch, None, heads), _put(mesh, k, batch, None, heads), _put(mesh, v, batch, None, heads),
            _put(mesh, sinks, heads), _put(mesh, ct_out, batch, None, heads), _put(mesh, ct_lse, batch, heads))
    _assert_per_shard(_dense_vjp, args)
    got = jax.jit(_dense_vjp)(*args)
    _assert_close(got, want)
    assert (tuple(got[0].sharding.spec) + (None,) * 4)[:3] == (batch, None, heads), got[0].sharding  # split like q


def test_replicated_kv_is_sliced_locally(path):
    # k and v given whole (e.g. one KV head for all): each device takes its heads' slice, no collective.
    mesh = _mesh(AxisType.Auto)
    q, k, v, sinks, ct_out, ct_lse = _dense_inputs(seed=7)
    fn = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, return_lse=True, backend="reference")
    args = (_put(mesh, q, "batch", None, "heads"), _put(mesh, k, "batch"), _put(mesh, v, "batch"))
    _assert_per_shard(fn, args)
    for got, want in zip(jax.jit(fn)(*args), jax.jit(fn)(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_forward_mode_runs_per_shard(path):
    mesh = _mesh(AxisType.Auto)
    q, k, v, sinks, _, _ = _dense_inputs(seed=3)
    tangents = tuple(jnp.flip(x, axis=0) * 0.5 for x in (q, k, v))

    def jvp(q, k, v, tq, tk, tv):
        fn = lambda q, k, v: flashjax.flash_attn(q, k, v, window_size=(4, 2), return_lse=True, backend="reference")
        return jax.jvp(fn, (q, k, v), (tq, tk, tv))

    args = tuple(_put(mesh, x, "batch", None, "heads") for x in (q, k, v, *tangents))
    _assert_per_shard(jvp, args)
    for got, want in zip(jax.tree.leaves(jax.jit(jvp)(*args)), jax.tree.leaves(jax.jit(jvp)(q, k, v, *tangents))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_varlen_runs_per_head_shard(axis_type):
    mesh = _mesh(axis_type)
    rng = np.random.default_rng(11)
    cu_q, cu_k = jnp.asarray([0, 5, 5, 13, 19], jnp.int32), jnp.asarray([0, 7, 9, 9, 16], jnp.int32)
    q, k, v = _random(rng, 21, HQ, D), _random(rng, 16, HK, D), _random(rng, 16, HK, DV)
    ct_out, ct_lse = _random(rng, 21, HQ, DV), _random(rng, HQ, 21)

    def vjp(q, k, v, ct_out, ct_lse):
        call = lambda q, k, v: flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                                          backend="reference")
        (out, lse), pullback = jax.vjp(call, q, k, v)
        return (out, lse, *pullback((ct_out, ct_lse)))

    args = (*(_put(mesh, x, None, ("batch", "heads")) for x in (q,)), *(_put(mesh, x, None, "heads") for x in (k, v)),
            _put(mesh, ct_out, None, ("batch", "heads")), _put(mesh, ct_lse, ("batch", "heads")))
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="8 must divide the 4 key/value heads"):
        jax.jit(vjp).lower(*args).compile()  # 8 query-head shards cannot keep 4 KV heads with their queries
    args = tuple(_put(mesh, x, *([None, "heads"] if x.ndim == 3 else ["heads"])) for x in (q, k, v, ct_out, ct_lse))
    _assert_per_shard(vjp, args)
    for got, want in zip(jax.jit(vjp)(*args), jax.jit(vjp)(q, k, v, ct_out, ct_lse)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _compile_error(axis_type):
    # Explicit axes: the policy runs when the call is traced, a ValueError. Auto axes: when XLA partitions the call,
    # the same ValueError wrapped in XLA's error.
    return ValueError if axis_type == AxisType.Explicit else (ValueError, jax.errors.JaxRuntimeError)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("sharded", ["q", "k"])
def test_a_sequence_split_points_at_ring_attention(path, axis_type, sharded):
    mesh = _mesh(axis_type)
    q, k, v = _dense_inputs(seed=5)[:3]
    q = _put(mesh, q, "batch", "heads") if sharded == "q" else _put(mesh, q, "batch")
    k = _put(mesh, k, "batch", "heads") if sharded == "k" else _put(mesh, k, "batch")
    v = _put(mesh, v, "batch")
    fn = jax.jit(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="reference"))
    with pytest.raises(_compile_error(axis_type), match=rf"{sharded}'s sequence axis .* flashjax.ring_attention"):
        fn.lower(q, k, v).compile()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_kv_heads_stay_with_their_query_heads(path, axis_type):
    mesh = _mesh(axis_type)
    q, k, v = _dense_inputs(seed=6, heads_k=2)[:3]
    args = (_put(mesh, q, None, None, "heads"), _put(mesh, k, "batch"), _put(mesh, v, "batch"))
    fn = jax.jit(lambda q, k, v: flashjax.flash_attn(q, k, v, backend="reference"))
    with pytest.raises(_compile_error(axis_type), match=r"4 must divide the 2 key/value heads: "
                                                        r"each KV head stays on the devices of its 4 query heads"):
        fn.lower(*args).compile()


def test_vmapped_calls_keep_the_policy():
    # Under vmap the sharding check sees an extra leading dim; a sequence split is still refused.
    mesh = _mesh(AxisType.Auto)
    q, k, v = _dense_inputs(seed=8)[:3]
    stack = lambda x, *spec: _put(mesh, jnp.stack([x, -x]), None, *spec)
    fn = jax.jit(jax.vmap(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="reference")))
    args = (stack(q, "batch", None, "heads"), stack(k, "batch", None, "heads"), stack(v, "batch", None, "heads"))
    _assert_per_shard(fn, args)
    np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(fn(*(jnp.asarray(x) for x in args))), rtol=2e-5,
                               atol=2e-5)
    with pytest.raises(jax.errors.JaxRuntimeError, match="q's sequence axis"):
        fn.lower(stack(q, "batch", "heads"), *args[1:]).compile()


def test_the_gspmd_partitioner_takes_the_same_rule():
    # GSPMD (deprecated, still selectable in jax 0.11 and 0.12) asks infer_sharding_from_operands instead of the rule.
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = _mesh(AxisType.Auto)
        q, k, v, sinks, ct_out, ct_lse = _dense_inputs(seed=9)
        params = dict(softmax_scale=0.3, softcap=0.0, window_left=-1, window_right=0, has_sinks=True)

        def vjp(q, k, v, sinks, ct_out, ct_lse):
            (out, lse), pullback = jax.vjp(lambda *a: tuple(primitives.forward(*a, **params)), q, k, v, sinks)
            return (out, lse, *pullback((ct_out, ct_lse)))

        args = (*(_put(mesh, x, "batch", None, "heads") for x in (q, k, v)), _put(mesh, sinks, "heads"),
                _put(mesh, ct_out, "batch", None, "heads"), _put(mesh, ct_lse, "batch", "heads"))
        _assert_per_shard(vjp, args)
        _assert_close(jax.jit(vjp)(*args), jax.jit(vjp)(q, k, v, sinks, ct_out, ct_lse))
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
