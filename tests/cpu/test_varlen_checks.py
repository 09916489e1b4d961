"""Packed-sequence offsets checked by value (flashjax/varlen.py), and the reference's per-sequence evaluation at a
size the all-pairs one could not hold."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flashjax


def _cu(*offsets):
    return np.asarray(offsets, np.int32)


def _qkv(rng, total_q=10, total_k=10, heads=2, head_dim=16):
    shapes = ((total_q, heads, head_dim), (total_k, heads, head_dim), (total_k, heads, head_dim))
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in shapes)


BAD_OFFSETS = [
    # (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, message fragment): the examples and the seqused rules
    (_cu(2, 4, 10), _cu(0, 4, 10), None, None, "cu_seqlens_q[0] must be 0"),
    (_cu(0, 8, 4, 10), _cu(0, 3, 5, 10), None, None, "cu_seqlens_q[2] = 4 after cu_seqlens_q[1] = 8"),
    (_cu(0, 4, 20), _cu(0, 4, 10), None, None, "cu_seqlens_q[2] must be at most the token count 10, got 20"),
    (_cu(0, 4, 10), _cu(0, 6, 5), None, None, "cu_seqlens_k must be nondecreasing"),
    (_cu(0, 4, 10), _cu(0, 4, 11), None, None, "cu_seqlens_k[2] must be at most the token count 10"),
    (_cu(0, 4, 10), _cu(0, 4, 10), _cu(4, 7), None, "seqused_q[1] must be in [0, 6]"),
    (_cu(0, 4, 10), _cu(0, 4, 10), None, _cu(-1, 2), "seqused_k[0] must be in [0, 4]"),
]


@pytest.mark.parametrize("cu_q,cu_k,used_q,used_k,message", BAD_OFFSETS)
def test_concrete_bad_offsets_raise_naming_the_entry(cu_q, cu_k, used_q, used_k, message):
    q, k, v = _qkv(np.random.default_rng(0))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, backend="reference")
    with pytest.raises(ValueError, match="flashjax: "):  # jax arrays outside jit are concrete too
        flashjax.flash_attn_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
                                   seqused_q=None if used_q is None else jnp.asarray(used_q),
                                   seqused_k=None if used_k is None else jnp.asarray(used_k), backend="reference")
    with pytest.raises(ValueError, match="flashjax: "):
        flashjax.check_varlen(cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, total_q=10, total_k=10)


@pytest.mark.parametrize("cu_q,cu_k,used_q,used_k,message", BAD_OFFSETS)
def test_traced_bad_offsets_are_caught_by_check_varlen_through_checkify(cu_q, cu_k, used_q, used_k, message):
    def checked(cu_q, cu_k, used_q, used_k):
        flashjax.check_varlen(cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, total_q=10, total_k=10)
        return cu_q.sum()

    error, _ = jax.jit(checkify.checkify(checked))(cu_q, cu_k, used_q, used_k)
    with pytest.raises(checkify.JaxRuntimeError, match="flashjax: "):
        error.throw()


def test_good_offsets_pass_every_check():
    cu_q, cu_k, used_k = _cu(0, 0, 3, 7), _cu(0, 5, 5, 9), _cu(5, 0, 2)
    flashjax.check_varlen(cu_q, cu_k, seqused_k=used_k, total_q=7, total_k=9)
    flashjax.check_varlen(cu_q, cu_k, total_q=12, total_k=9)  # tokens past the end are padding

    def checked(cu_q, cu_k, used_k):
        flashjax.check_varlen(cu_q, cu_k, seqused_k=used_k, total_q=7, total_k=9)
        return cu_q.sum()

    error, _ = jax.jit(checkify.checkify(checked))(cu_q, cu_k, used_k)
    error.throw()  # nothing to throw


def test_under_jit_offsets_stay_runtime_data_and_bad_ones_give_finite_rows():
    """Inside jit the call cannot see the values: a decreasing packing runs (wrong rows, by the documented rule)."""
    q, k, v = _qkv(np.random.default_rng(1))
    call = jax.jit(lambda q, k, v, cu_q, cu_k: flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True,
                                                                          max_seqlen_q=8, max_seqlen_k=8,
                                                                          backend="reference"))
    out = call(q, k, v, jnp.asarray(_cu(0, 8, 4, 10)), jnp.asarray(_cu(0, 3, 5, 10)))
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_packed_32k_tokens_match_the_dense_batch_per_sequence():
    """64 sequences of 512 tokens: per sequence (the max_seqlen hints) the reference holds N x 512 x 512 scores
    instead of 32k x 32k, and equals the dense call over the same sequences as a batch."""
    rng = np.random.default_rng(2)
    num_seqs, length, heads, head_dim = 64, 512, 2, 16
    q, k, v = _qkv(rng, num_seqs * length, num_seqs * length, heads, head_dim)
    cu = jnp.asarray(np.arange(num_seqs + 1) * length, jnp.int32)
    packed = jax.jit(lambda q, k, v: flashjax.flash_attn_varlen(q, k, v, cu, cu, max_seqlen_q=length,
                                                                max_seqlen_k=length, causal=True, return_lse=True,
                                                                backend="reference"))(q, k, v)
    dense = jax.jit(lambda q, k, v: flashjax.flash_attn(*(x.reshape(num_seqs, length, heads, head_dim)
                                                          for x in (q, k, v)), causal=True, return_lse=True,
                                                        backend="reference"))(q, k, v)
    np.testing.assert_allclose(np.asarray(packed[0], np.float32),
                               np.asarray(dense[0].reshape(packed[0].shape), np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(packed[1]), np.asarray(dense[1].transpose(1, 0, 2).reshape(heads, -1)),
                               rtol=1e-4, atol=1e-4)
