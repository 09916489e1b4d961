"""The kernel path of a mask mod, wired on the CPU (issue 38): api computes the mod's packed bits, the primitives carry
them forward, into the tangent and into the backward (a residual), and off CUDA the primitives' reference lowerings
unpack them. Forced onto the kernel path (api.choose monkeypatched, as tests/cpu/test_sharding.py does), every call
must equal the reference's with the mod itself: forward, gradients, jvp, vmap (bits mapped and not) and sharding over
batch and heads (per-batch and per-head bits split, broadcast bits replicated, no communication but dsinks').
The bits themselves (flashjax.mask_bits) are checked against the predicate evaluated densely."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flashjax
from flashjax import api, mask_bits, primitives
from flashjax.masks import MaskMod

B, SQ, SK, HQ, HK, D = 4, 45, 70, 8, 4, 16


@dataclasses.dataclass(frozen=True)
class HeadReach(MaskMod):
    """Per (batch, head): key j visible to row i iff j <= i + reach[b, h] (bits per batch and per head)."""

    reach: jax.Array

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.reach[b, h]


def _mods(rng):
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (B, SK)), axis=1), jnp.int32)
    return {
        "causal": flashjax.causal_mask(),  # bits [1, 1, Sq, Wk]
        "document": flashjax.document_mask(ids),  # [B, 1, ...]
        "window": flashjax.sliding_window_mask(9, 3),
        "per_head": HeadReach(jnp.asarray(rng.integers(-10, 30, (B, HQ)), jnp.int32)),  # [B, Hq, ...]
    }


def _inputs(rng):
    def normal(*shape, dtype=jnp.bfloat16):  # the kernel path's dtypes; the reference runs them in f32 either way
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return normal(B, SQ, HQ, D), normal(B, SK, HK, D), normal(B, SK, HK, D), normal(HQ, dtype=jnp.float32)


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setattr(api, "choose", lambda call, device_sm=None: ("kernel", "forced", {"head_dim": 64}))


@pytest.mark.parametrize("seqlen_k", [1, 31, 32, 33, 70, 128])
def test_bits_are_the_predicate(seqlen_k):
    rng = np.random.default_rng(seqlen_k)
    for name, mod in _mods(rng).items():
        if name == "document":
            mod = flashjax.document_mask(jnp.asarray(np.sort(rng.integers(0, 4, (B, max(SQ, seqlen_k))), 1),
                                                     jnp.int32))
        shape = mask_bits.mask_bits_shape(mod, batch=B, heads=HQ, seqlen_q=SQ, seqlen_k=seqlen_k)
        bits = np.asarray(mask_bits.mask_bits_reference(mod, batch=B, heads=HQ, seqlen_q=SQ, seqlen_k=seqlen_k))
        assert bits.shape == shape and bits.dtype == np.uint32
        assert shape[3] == -(-seqlen_k // 32)
        dense = np.asarray(jnp.broadcast_to(mod.dense(B, HQ, SQ, seqlen_k), (B, HQ, SQ, seqlen_k)))
        unpacked = (bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        unpacked = unpacked.reshape(bits.shape[:3] + (-1,)).astype(bool)
        assert not unpacked[..., seqlen_k:].any()  # bits past Sk are 0
        np.testing.assert_array_equal(np.broadcast_to(unpacked[..., :seqlen_k], dense.shape), dense, err_msg=name)


def _call(q, k, v, sinks, mod, backend, **kw):
    return flashjax.flash_attn(q, k, v, sinks=sinks, mask_mod=mod, return_lse=True, backend=backend, **kw)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # The same f32 computation on the same bf16 inputs, rounded to bf16: equal but for a rounding step.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(20, 2), softcap=4.0)])
def test_forward_grads_and_jvp_match_the_reference(kernel_path, kw):
    rng = np.random.default_rng(1)
    q, k, v, sinks = _inputs(rng)
    for name, mod in _mods(rng).items():
        loss = lambda backend: (lambda q, k, v, s: sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0) * w) for x, w in zip(
            _call(q, k, v, s, mod, backend, **kw), (1.0, 0.3))))
        _assert_close(_call(q, k, v, sinks, mod, "auto", **kw), _call(q, k, v, sinks, mod, "reference", **kw))
        _assert_close(jax.grad(loss("auto"), (0, 1, 2, 3))(q, k, v, sinks),
                      jax.grad(loss("reference"), (0, 1, 2, 3))(q, k, v, sinks))
        out = lambda backend: (lambda q: _call(q, k, v, sinks, mod, backend, **kw)[0])
        _assert_close(jax.jvp(out("auto"), (q,), ((q * 0.5).astype(q.dtype),)), jax.jvp(out("reference"), (q,), ((q * 0.5).astype(q.dtype),)))


def test_the_backward_gets_the_forwards_bits(kernel_path):
    """One bits computation per step: the backward's FFI operand is the forward's array (a residual)."""
    rng = np.random.default_rng(2)
    q, k, v, sinks = _inputs(rng)
    mod = _mods(rng)["document"]
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(_call(q, k, v, None, mod, "auto")[0])))(q)
    text = str(jaxpr)
    # The mod's predicate is evaluated once (one map over query chunks), not again for the backward.
    assert len(re.findall(r"\bflashjax_fwd\b", text)) == 1 and len(re.findall(r"\bflashjax_bwd\b", text)) == 1, text
    assert len(re.findall(r"\bscan\[", text)) == 1, text


@pytest.mark.parametrize("mapped", ["fields", "inputs", "both"])
def test_vmap_matches_each_call(kernel_path, mapped):
    rng = np.random.default_rng(3)
    q, k, v, sinks = _inputs(rng)
    qs = jnp.stack([q, (0.5 * q).astype(q.dtype)])
    reaches = jnp.asarray(rng.integers(-10, 30, (2, B, HQ)), jnp.int32)
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, B, SK)), axis=2), jnp.int32)
    for make, fields in ((HeadReach, reaches), (flashjax.document_mask, ids)):
        def one(q, field):
            return _call(q, k, v, sinks, make(field), "auto")
        if mapped == "fields":
            got, want = jax.vmap(lambda f: one(q, f))(fields), [one(q, fields[i]) for i in range(2)]
        elif mapped == "inputs":
            got, want = jax.vmap(lambda x: one(x, fields[0]))(qs), [one(qs[i], fields[0]) for i in range(2)]
        else:
            got, want = jax.vmap(one)(qs, fields), [one(qs[i], fields[i]) for i in range(2)]
        _assert_close(got, jax.tree.map(lambda *xs: jnp.stack(xs), *want))
    got = jax.vmap(lambda x: _call(x, k, v, sinks, flashjax.causal_mask(), "auto"))(qs)  # broadcast bits, unmapped
    _assert_close(got, jax.tree.map(lambda *xs: jnp.stack(xs),
                                    *[_call(qs[i], k, v, sinks, flashjax.causal_mask(), "auto") for i in range(2)]))


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(-start)?\(")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices (tests/cpu/conftest.py)")
@pytest.mark.parametrize("spec", [("batch", None), (None, "heads"), ("batch", "heads")])
def test_sharded_over_batch_and_heads_matches_one_device(kernel_path, spec):
    mesh = jax.make_mesh((2, 4), ("batch", "heads"))
    rng = np.random.default_rng(4)
    q, k, v, sinks = _inputs(rng)
    for name, mod in _mods(rng).items():
        def loss(q, k, v, sinks):
            out, lse = _call(q, k, v, sinks, mod, "auto", causal=True)
            return jnp.sum(out) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, P(*s)))
        args = (put(q, (spec[0], None, spec[1])), put(k, (spec[0], None, spec[1])), put(v, (spec[0], None, spec[1])),
                put(sinks, (spec[1],)))
        text = fn.lower(*args).compile().as_text()
        for types, op, _ in _COLLECTIVE.findall(text):
            counts = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", types)]
            assert op == "all-reduce" and max(counts) <= HQ, (name, op, counts)
        _assert_close(fn(*args), fn(q, k, v, sinks))
