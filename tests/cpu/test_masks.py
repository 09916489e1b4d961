"""Mask mods: the built-in predicates, argument validation, and their pytree behaviour."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import masks

BATCH, HEADS, SEQLEN_Q, SEQLEN_K = 2, 3, 7, 9


def _indices():
    """Index grids (b, h, i, j), each [B, H, Sq, Sk], for writing expected predicates in NumPy."""
    return np.meshgrid(np.arange(BATCH), np.arange(HEADS), np.arange(SEQLEN_Q), np.arange(SEQLEN_K), indexing="ij")


@dataclasses.dataclass(frozen=True)
class WindowedPrefixLM(masks.MaskMod):
    """A user-defined mod mixing a runtime leaf and a compile-time constant (the fa4-jax example)."""

    prefix_len: jax.Array
    window: int = masks.static()

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx < self.prefix_len[b]) | ((kv_idx <= q_idx) & (q_idx - kv_idx <= self.window))


# --------------------------------------------------------------------------- predicates


def test_causal_mask_dense_is_top_left():
    b, h, i, j = _indices()
    np.testing.assert_array_equal(masks.causal_mask().dense(BATCH, HEADS, SEQLEN_Q, SEQLEN_K), j <= i)


def test_document_mask_dense():
    doc_ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7]], np.int32)
    b, h, i, j = _indices()
    np.testing.assert_array_equal(masks.document_mask(doc_ids).dense(BATCH, HEADS, SEQLEN_Q, SEQLEN_K),
                                  doc_ids[b, i] == doc_ids[b, j])


@pytest.mark.parametrize("left, right", [(0, 0), (2, 0), (1, 3), (20, 20)])
def test_sliding_window_mask_dense(left, right):
    b, h, i, j = _indices()
    np.testing.assert_array_equal(masks.sliding_window_mask(left, right).dense(BATCH, HEADS, SEQLEN_Q, SEQLEN_K),
                                  (i - left <= j) & (j <= i + right))


def test_sliding_window_mask_right_defaults_to_zero():
    assert masks.sliding_window_mask(4) == masks.sliding_window_mask(4, 0)


def test_prefix_lm_mask_dense():
    prefix_len = np.array([3, 0], np.int32)
    b, h, i, j = _indices()
    np.testing.assert_array_equal(masks.prefix_lm_mask(prefix_len).dense(BATCH, HEADS, SEQLEN_Q, SEQLEN_K),
                                  (j < prefix_len[b]) | (j <= i))


def test_dense_broadcasts_head_dependent_mod():
    mod = WindowedPrefixLM(jnp.array([1, 2]), window=2)
    dense = mod.dense(BATCH, HEADS, SEQLEN_Q, SEQLEN_K)
    assert dense.shape == (BATCH, HEADS, SEQLEN_Q, SEQLEN_K) and dense.dtype == jnp.bool_
    b, h, i, j = _indices()
    np.testing.assert_array_equal(dense, (j < np.array([1, 2])[b]) | ((j <= i) & (i - j <= 2)))


def test_base_class_call_is_abstract():
    @dataclasses.dataclass(frozen=True)
    class NoPredicate(masks.MaskMod):
        pass

    with pytest.raises(NotImplementedError, match="NoPredicate"):
        NoPredicate()(0, 0, 0, 0)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad, error", [(np.zeros((2, 4), np.float32), TypeError), (np.zeros(4, np.int32), ValueError),
                                        (np.zeros((1, 2, 3), np.int32), ValueError), ([[0.5, 1.5]], TypeError)])
def test_document_mask_rejects_bad_doc_ids(bad, error):
    with pytest.raises(error, match="doc_ids"):
        masks.document_mask(bad)


@pytest.mark.parametrize("bad, error", [(np.zeros(2, np.float32), TypeError), (np.zeros((2, 1), np.int32), ValueError),
                                        (3.0, TypeError)])
def test_prefix_lm_mask_rejects_bad_prefix_len(bad, error):
    with pytest.raises(error, match="prefix_len"):
        masks.prefix_lm_mask(bad)


@pytest.mark.parametrize("left, right, error, name", [(-1, 0, ValueError, "left"), (2, -3, ValueError, "right"),
                                                      (1.5, 0, TypeError, "left"), (True, 0, TypeError, "left"),
                                                      (2, "1", TypeError, "right")])
def test_sliding_window_mask_rejects_bad_bounds(left, right, error, name):
    with pytest.raises(error, match=name):
        masks.sliding_window_mask(left, right)


def test_integer_ids_become_int32():
    mod = masks.document_mask(np.array([[1, 2, 3]], np.int64))
    assert mod.doc_ids.dtype == jnp.int32
    assert masks.prefix_lm_mask([1, 2]).prefix_len.dtype == jnp.int32
    assert masks.sliding_window_mask(np.int64(3)).left == 3 and type(masks.sliding_window_mask(np.int64(3)).left) is int


# --------------------------------------------------------------------------- pytree behaviour


def test_array_fields_are_leaves_and_static_fields_are_aux_data():
    doc_ids = jnp.array([[0, 1, 1]], jnp.int32)
    leaves, treedef = jax.tree_util.tree_flatten(masks.document_mask(doc_ids))
    assert len(leaves) == 1 and leaves[0] is doc_ids
    assert jax.tree_util.tree_leaves(masks.sliding_window_mask(3, 1)) == []
    assert jax.tree_util.tree_leaves(masks.causal_mask()) == []
    mixed = WindowedPrefixLM(jnp.array([2]), window=5)
    assert [leaf.tolist() for leaf in jax.tree_util.tree_leaves(mixed)] == [[2]]
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(mixed)[0]]
    assert paths == [(jax.tree_util.GetAttrKey("prefix_len"),)]


def test_flatten_unflatten_roundtrip():
    for mod in (masks.causal_mask(), masks.sliding_window_mask(2, 1), masks.document_mask([[0, 0, 1]]),
                masks.prefix_lm_mask([4]), WindowedPrefixLM(jnp.array([2]), window=5)):
        leaves, treedef = jax.tree_util.tree_flatten(mod)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
        assert type(rebuilt) is type(mod)
        for field in dataclasses.fields(mod):
            np.testing.assert_array_equal(getattr(rebuilt, field.name), getattr(mod, field.name))
        assert rebuilt.static_key() == mod.static_key()


def test_unflatten_accepts_placeholder_leaves_without_validation():
    """JAX rebuilds pytrees with non-array leaves (e.g. tree_map to None); validation must not run then."""
    placeholder = jax.tree_util.tree_map(lambda _: None, masks.document_mask([[0, 1]]))
    assert isinstance(placeholder, masks.DocumentMask) and placeholder.doc_ids is None
    shapes = jax.eval_shape(lambda mod: mod, masks.prefix_lm_mask([1, 2, 3]))
    assert shapes.prefix_len.shape == (3,)


def test_new_leaf_value_does_not_retrace_but_new_static_value_does():
    traces = []

    @jax.jit
    def apply(mod):
        traces.append(type(mod).__name__)
        return mod.dense(2, 1, 5, 5)

    first = apply(masks.document_mask(np.array([[0, 0, 1, 1, 1], [0, 1, 2, 3, 4]])))
    second = apply(masks.document_mask(np.array([[0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])))
    assert len(traces) == 1
    assert not np.array_equal(first, second)

    apply(masks.sliding_window_mask(1, 0))
    apply(masks.sliding_window_mask(1, 0))
    assert len(traces) == 2
    apply(masks.sliding_window_mask(2, 0))
    assert len(traces) == 3

    apply(WindowedPrefixLM(jnp.array([1, 2]), window=1))
    apply(WindowedPrefixLM(jnp.array([3, 0]), window=1))
    assert len(traces) == 4
    apply(WindowedPrefixLM(jnp.array([3, 0]), window=2))
    assert len(traces) == 5


def test_static_key_identifies_class_and_static_values():
    window = masks.sliding_window_mask(3, 1)
    assert window.static_key() == masks.sliding_window_mask(3, 1).static_key()
    assert window.static_key() != masks.sliding_window_mask(3, 2).static_key()
    assert window.static_key() == ("flashjax.masks.SlidingWindowMask", (("left", 3), ("right", 1)))
    # Arrays are runtime data: not part of the key.
    assert masks.document_mask([[0, 1]]).static_key() == masks.document_mask([[5, 5], [6, 6]]).static_key()
    assert masks.document_mask([[0, 1]]).static_key() != masks.prefix_lm_mask([1]).static_key()
    custom = WindowedPrefixLM(jnp.array([1]), window=4).static_key()
    assert custom[0].endswith("WindowedPrefixLM") and custom[1] == (("window", 4),)
    keys = {window.static_key(), masks.causal_mask().static_key(), custom}
    assert len(keys) == 3


def test_treedefs_and_static_only_mods_hash():
    assert hash(masks.causal_mask()) == hash(masks.causal_mask())
    assert masks.sliding_window_mask(2, 2) == masks.sliding_window_mask(2, 2)
    assert {masks.sliding_window_mask(2, 2), masks.sliding_window_mask(2, 2)} == {masks.sliding_window_mask(2, 2)}
    first = jax.tree_util.tree_structure(WindowedPrefixLM(jnp.array([1]), window=4))
    second = jax.tree_util.tree_structure(WindowedPrefixLM(jnp.array([9]), window=4))
    assert first == second and hash(first) == hash(second)
    assert first != jax.tree_util.tree_structure(WindowedPrefixLM(jnp.array([1]), window=5))


def test_unhashable_static_value_is_reported():
    @dataclasses.dataclass(frozen=True)
    class ListStatic(masks.MaskMod):
        values: list = masks.static()

        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    with pytest.raises(TypeError, match="values"):
        ListStatic([1, 2]).static_key()


def test_static_without_default_is_required():
    with pytest.raises(TypeError):
        WindowedPrefixLM(jnp.array([1]))


def test_subclass_that_is_not_a_dataclass_is_rejected_on_use():
    class Plain(masks.MaskMod):
        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    with pytest.raises(TypeError, match="dataclass"):
        jax.tree_util.tree_flatten(Plain())


def test_mod_works_under_vmap_over_its_leaves():
    """Array fields are ordinary pytree leaves, so transformations map over them."""
    prefix_lens = jnp.array([[0, 1], [3, 4]], jnp.int32)
    dense = jax.vmap(lambda p: masks.prefix_lm_mask(p).dense(2, 1, 4, 4))(prefix_lens)
    for index in range(2):
        np.testing.assert_array_equal(dense[index], masks.prefix_lm_mask(prefix_lens[index]).dense(2, 1, 4, 4))
