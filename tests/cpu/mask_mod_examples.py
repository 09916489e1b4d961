"""Mask mods for the codegen tests: the built-ins, and custom mods that reach every construct the tracer handles.

Each case builds its mod from a random generator (random field values) and says which index ranges to probe:
negative and past-the-end indices everywhere, and int32 extremes for the mods whose arithmetic can overflow.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashjax import masks
from flashjax.masks import MaskMod, static

BATCH, HEADS, SEQLEN = 3, 4, 24
INT32_EXTREMES = np.array([-2**31, -2**31 + 1, -2**30, 2**30, 2**31 - 2, 2**31 - 1], np.int32)


def _row(field, b):
    """Row b of a per-batch field, or its only row (one row serves every batch entry)."""
    return 0 if field.shape[0] == 1 else b


@dataclasses.dataclass(frozen=True)
class PrefixLMWindow(MaskMod):
    """Prefix LM whose causal part is a window of static width."""

    prefix_len: jax.Array
    window: int = static()

    def __call__(self, b, h, q_idx, kv_idx):
        prefix = self.prefix_len[_row(self.prefix_len, b)]
        return (kv_idx < prefix) | ((kv_idx <= q_idx) & (q_idx - kv_idx < self.window))


@dataclasses.dataclass(frozen=True)
class GlobalLocal(MaskMod):
    """The first num_global tokens see and are seen by everything; the rest see a symmetric local window."""

    num_global: int = static()
    window: int = static()

    def __call__(self, b, h, q_idx, kv_idx):
        is_global = (q_idx < self.num_global) | (kv_idx < self.num_global)
        return is_global | (jnp.abs(q_idx - kv_idx) <= self.window)


@dataclasses.dataclass(frozen=True)
class FloorDivMod(MaskMod):
    """Python floor division and modulo of negative numbers, by a static block and by run-time divisors per head
    (0 and -1 included), and lax's truncating div / rem on the same (x / 0, INT_MIN / -1)."""

    divisor: jax.Array  # [H]
    block: int = static()

    def __call__(self, b, h, q_idx, kv_idx):
        same_block = (q_idx - 7) // self.block == (kv_idx - 7) // self.block
        d = self.divisor[h]
        floored = ((q_idx - kv_idx) // d) % 3 == (q_idx % d) % -self.block
        truncated = lax.rem(q_idx, d) < lax.div(kv_idx, d)
        return same_block ^ floored ^ truncated


@dataclasses.dataclass(frozen=True)
class HeadOffsets(MaskMod):
    """Causal with a per-(batch, head) shift read from a 2-D field; a single row serves every batch entry."""

    offsets: jax.Array  # [B or 1, H]

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.offsets[_row(self.offsets, b), h]


@dataclasses.dataclass(frozen=True)
class GatherModes(MaskMod):
    """jnp.take's fill mode (out-of-range reads the fill value) against clip mode."""

    ids: jax.Array  # [S]

    def __call__(self, b, h, q_idx, kv_idx):
        q_id = jnp.take(self.ids, q_idx, mode="fill", fill_value=-1)
        kv_id = self.ids.at[kv_idx].get(mode="clip")
        default_fill = jnp.take(self.ids, kv_idx + h)  # fill with INT_MIN past the end
        return (q_id == kv_id) | (default_fill < 0)


@dataclasses.dataclass(frozen=True)
class BitsAndShifts(MaskMod):
    """Bitwise logic and shifts by run-time amounts (some outside [0, 32))."""

    shift: jax.Array  # [H]

    def __call__(self, b, h, q_idx, kv_idx):
        s = self.shift[h]
        left = (q_idx >> s) & 3
        right = ((kv_idx << 1) ^ q_idx) & 3
        logical = lax.shift_right_logical(q_idx, s) > (kv_idx | 1)
        return (left == right) | (logical & ~(kv_idx == 3)) | (lax.shift_left(kv_idx, s) == ~q_idx)


@dataclasses.dataclass(frozen=True)
class Overflowing(MaskMod):
    """int32 arithmetic that wraps on large indices: products, squares, negation and abs of INT_MIN."""

    def __call__(self, b, h, q_idx, kv_idx):
        hashed = (q_idx * 1000003 + kv_idx * 7919) % 97
        return (hashed < 40) ^ (q_idx**2 > kv_idx**3) ^ (jnp.abs(-kv_idx) < jnp.sign(q_idx) * 5)


@dataclasses.dataclass(frozen=True)
class Branches(MaskMod):
    """lax.switch on the head (its index clamped by lax), lax.cond, select_n on an int32 index, clip. Scalar
    indices only: lax.switch and lax.cond take a scalar predicate."""

    def __call__(self, b, h, q_idx, kv_idx):
        by_head = lax.switch(h, [lambda q, k: k <= q, lambda q, k: k >= q, lambda q, k: (q - k) % 4 == 0], q_idx,
                             kv_idx)
        nested = lax.cond(b > 0, lambda q, k: q + k > 10, lambda q, k: q - k < 2, q_idx, kv_idx)
        picked = lax.select_n(jnp.clip(q_idx % 5, 0, 2), kv_idx, q_idx, jnp.maximum(q_idx, kv_idx))
        return by_head & (nested | (picked > jnp.minimum(kv_idx, 12)))


@dataclasses.dataclass(frozen=True)
class StaticTokens(MaskMod):
    """A static tuple of global token positions, compared through a constant array and a reduction."""

    tokens: tuple = static()

    def __call__(self, b, h, q_idx, kv_idx):
        table = jnp.asarray(self.tokens, jnp.int32)
        is_token = jnp.any(table == jnp.expand_dims(kv_idx, -1), axis=-1)
        return is_token | (kv_idx <= q_idx) & (table[h] != q_idx)


@dataclasses.dataclass(frozen=True)
class ArrayIntermediates(MaskMod):
    """Reads through array expressions: arithmetic on the whole field, a flattening reshape, a transpose, a
    concatenation, a reversal, a strided slice; a scalar field and a bool field."""

    ids: jax.Array  # [B, S]
    offset: jax.Array  # [] int32
    sees_all: jax.Array  # [S] bool

    def __call__(self, b, h, q_idx, kv_idx):
        row = _row(self.ids, b)
        doubled = (self.ids * 2 + 1)[row, q_idx]
        flat = self.ids.reshape(-1)[b * self.ids.shape[1] + kv_idx]
        transposed = self.ids.T[q_idx, row]
        joined = jnp.concatenate([self.ids, self.ids + 100], axis=1)[row, kv_idx + 3]
        reversed_first = self.ids[0, ::-1][q_idx]
        strided = self.ids[0, 1::3][h]
        near = (doubled - flat) % 5 == (transposed + joined + reversed_first + strided) % 5
        return (near & (kv_idx <= q_idx + self.offset)) | self.sees_all[kv_idx]


@dataclasses.dataclass(frozen=True)
class RowThenColumn(MaskMod):
    """Picks a row, then an element of it (a dynamic_slice of a whole row): right on scalar indices only, as a
    kernel thread calls it, so its truth is the mod vmapped over scalars."""

    ids: jax.Array  # [B, S]

    def __call__(self, b, h, q_idx, kv_idx):
        row = self.ids[b]
        window = lax.dynamic_slice_in_dim(row, q_idx - 2, 4)
        return (window[1] == row[kv_idx]) | (window[3] > window[0])


@jax.custom_vjp
def _doubled(x):
    return x * 2


_doubled.defvjp(lambda x: (_doubled(x), None), lambda residual, g: (g,))


@dataclasses.dataclass(frozen=True)
class Wrapped(MaskMod):
    """Code inside jax's wrappers: a custom_jvp (relu), a custom_vjp, jax.checkpoint and a nested jit."""

    def __call__(self, b, h, q_idx, kv_idx):
        shifted = jax.checkpoint(lambda x: x + 1)(q_idx)
        return (jax.nn.relu(q_idx - kv_idx) > 2) | (_doubled(kv_idx) > shifted) | jax.jit(lambda x: x < 1)(b)


@dataclasses.dataclass(frozen=True)
class BothOf(MaskMod):
    """Two mods ANDed: fields nested one pytree level down."""

    first: MaskMod
    second: MaskMod

    def __call__(self, b, h, q_idx, kv_idx):
        return self.first(b, h, q_idx, kv_idx) & self.second(b, h, q_idx, kv_idx)


@dataclasses.dataclass(frozen=True)
class BlockPattern(MaskMod):
    """A per-batch pattern of 4 x 4 blocks, read by both q and kv: a box's field read varies along two axes."""

    pattern: jax.Array  # [B, blocks_q, blocks_k]

    def __call__(self, b, h, q_idx, kv_idx):
        return self.pattern[b, q_idx // 4, kv_idx // 4] != 0


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[np.random.Generator], MaskMod]
    extremes: bool = False  # also probe int32 extremes as q_idx / kv_idx
    scalar_only: bool = False  # the mod needs scalar indices (lax.switch, row slices): its truth is it vmapped


def _ints(rng, shape, low, high):
    return rng.integers(low, high, size=shape, dtype=np.int64).astype(np.int32)


def _doc_ids(rng, rows):
    return np.sort(_ints(rng, (rows, SEQLEN), 0, 4), axis=1).astype(np.int32)


CASES = [
    Case("causal", lambda rng: masks.causal_mask()),
    Case("document", lambda rng: masks.document_mask(_doc_ids(rng, BATCH))),
    Case("document_one_row", lambda rng: masks.document_mask(_doc_ids(rng, 1))),
    Case("sliding_window", lambda rng: masks.sliding_window_mask(5, 2)),
    Case("prefix_lm", lambda rng: masks.prefix_lm_mask(_ints(rng, (BATCH,), -3, SEQLEN + 3))),
    Case("prefix_lm_one_row", lambda rng: masks.prefix_lm_mask(_ints(rng, (1,), 0, SEQLEN))),
    Case("prefix_lm_window", lambda rng: PrefixLMWindow(_ints(rng, (BATCH,), 0, SEQLEN), window=4)),
    Case("global_local", lambda rng: GlobalLocal(num_global=3, window=2)),
    Case("floor_div_mod", lambda rng: FloorDivMod(np.array([0, -3, 4, -1], np.int32)[rng.permutation(HEADS)],
                                                  block=5), extremes=True),
    Case("head_offsets", lambda rng: HeadOffsets(_ints(rng, (BATCH, HEADS), -6, 6))),
    Case("head_offsets_one_row", lambda rng: HeadOffsets(_ints(rng, (1, HEADS), -6, 6))),
    Case("gather_modes", lambda rng: GatherModes(_ints(rng, (SEQLEN,), 0, 3))),
    Case("bits_and_shifts", lambda rng: BitsAndShifts(np.array([0, 3, 31, 40], np.int32)), extremes=True),
    Case("overflowing", lambda rng: Overflowing(), extremes=True),
    Case("branches", lambda rng: Branches(), scalar_only=True),
    Case("row_then_column", lambda rng: RowThenColumn(_ints(rng, (BATCH, SEQLEN), 0, 4)), scalar_only=True),
    Case("static_tokens", lambda rng: StaticTokens((0, 5, 17, 23))),
    Case("array_intermediates", lambda rng: ArrayIntermediates(
        _ints(rng, (BATCH, SEQLEN), -9, 9), np.int32(rng.integers(-3, 3)), rng.random(SEQLEN) < 0.2)),
    Case("wrapped", lambda rng: Wrapped()),
    Case("block_pattern", lambda rng: BlockPattern(_ints(rng, (BATCH, SEQLEN // 4, SEQLEN // 4), 0, 2))),
    Case("both_of", lambda rng: BothOf(masks.document_mask(_doc_ids(rng, BATCH)),
                                       PrefixLMWindow(_ints(rng, (1,), 0, SEQLEN), window=6))),
]


def index_grid(rng: np.random.Generator, extremes: bool):
    """Broadcasting int32 index arrays b [nb,1,1,1], h [1,nh,1,1], q_idx [1,1,nq,1], kv_idx [1,1,1,nk] that reach
    past both ends of every axis."""
    b = np.arange(-2, BATCH + 2, dtype=np.int32)
    h = np.arange(-2, HEADS + 2, dtype=np.int32)
    positions = np.concatenate([np.arange(-6, 3), _ints(rng, (14,), -40, SEQLEN + 40),
                                np.arange(SEQLEN - 3, SEQLEN + 3)]).astype(np.int32)
    q, kv = rng.permutation(positions), rng.permutation(positions)
    if extremes:
        q, kv = np.concatenate([q, INT32_EXTREMES]), np.concatenate([kv, INT32_EXTREMES[::-1]])
    return b.reshape(-1, 1, 1, 1), h.reshape(1, -1, 1, 1), q.reshape(1, 1, -1, 1), kv.reshape(1, 1, 1, -1)
