"""A mask mod's packed bitmask, the operand the kernels take (issue 38; the contract of docs/design.md §2.6).

PLACEHOLDER of the kernels half of issue 38: only `mask_bits_shape` and `mask_bits_reference` (pure jnp, any
backend), with `mask_bits = mask_bits_reference`. The mask-bits half (its own branch) owns this module and replaces
it with the NVRTC kernel behind `mask_bits` (FFI target flashjax_mask_bits); the signatures are the contract's.

Layout: uint32 [Bm, Hm, Sq, Wk], Wk = ceil(Sk / 32), row-major; bit j (1 << j) of word [b, h, q, w] is 1 iff
mod(b, h, q, 32 w + j) (raw top-left indices, h the query head); bits for kv >= Sk are 0. Bm is B when the mod's
predicate depends on b, else 1; Hm likewise Hq or 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["mask_bits_shape", "mask_bits_reference", "mask_bits"]

# Elements of the bool predicate evaluated at once (a chunk of query rows); bounds the reference's memory.
_CHUNK_ELEMENTS = 1 << 24


def _index_shapes(batch, heads, seqlen_q, seqlen_k):
    return [(batch, 1, 1, 1), (1, heads, 1, 1), (1, 1, seqlen_q, 1), (1, 1, 1, seqlen_k)]


def mask_bits_shape(mod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """(Bm, Hm, Sq, Wk) of the mod's bits for a dense call: Bm = batch where the predicate's value depends on b (its
    result does not broadcast over b), else 1; Hm likewise."""
    indices = [jax.ShapeDtypeStruct(s, jnp.int32) for s in _index_shapes(batch, heads, seqlen_q, seqlen_k)]
    result = jax.eval_shape(lambda m, *idx: m(*idx), mod, *indices)
    shape = (1,) * (4 - len(result.shape)) + tuple(result.shape)
    return (batch if shape[0] != 1 else 1, heads if shape[1] != 1 else 1, seqlen_q, -(-seqlen_k // 32))


def mask_bits_reference(mod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """The bits by evaluating the predicate in jnp over every (b, h, q, kv), a chunk of query rows at a time."""
    bm, hm, _, words = mask_bits_shape(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    if seqlen_q == 0 or words == 0:
        return jnp.zeros((bm, hm, seqlen_q, words), jnp.uint32)
    chunk = int(max(1, min(seqlen_q, _CHUNK_ELEMENTS // max(1, bm * hm * words * 32))))
    num_chunks = -(-seqlen_q // chunk)
    b = jnp.arange(bm, dtype=jnp.int32).reshape(bm, 1, 1, 1)
    h = jnp.arange(hm, dtype=jnp.int32).reshape(1, hm, 1, 1)
    kv = jnp.arange(words * 32, dtype=jnp.int32).reshape(1, 1, 1, words * 32)
    shifts = jnp.arange(32, dtype=jnp.uint32)

    def rows(start):
        q = (start + jnp.arange(chunk, dtype=jnp.int32)).reshape(1, 1, chunk, 1)
        # Keys past Sk are evaluated at a clamped index and then cleared: the mod only ever sees indices < Sk.
        visible = jnp.asarray(mod(b, h, q, jnp.minimum(kv, seqlen_k - 1))).astype(jnp.bool_) & (kv < seqlen_k)
        visible = jnp.broadcast_to(visible, (bm, hm, chunk, words * 32)).reshape(bm, hm, chunk, words, 32)
        return jnp.sum(visible.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)

    starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    bits = jax.lax.map(rows, starts)  # [chunks, Bm, Hm, chunk, Wk]
    bits = jnp.moveaxis(bits, 0, 2).reshape(bm, hm, num_chunks * chunk, words)
    return bits[:, :, :seqlen_q]


mask_bits = mask_bits_reference

