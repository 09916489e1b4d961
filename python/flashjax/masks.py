"""Flex-attention style mask mods (docs/design.md §2.6).

A mask mod is a frozen dataclass deriving from :class:`MaskMod` and a callable
``mod(b, h, q_idx, kv_idx) -> bool`` written in ``jnp``. The indices are raw:
top-left aligned, and sequence-local in varlen calls where ``b`` is the sequence
index. Every subclass is registered as a JAX pytree on definition:

- fields declared with :func:`static` are pytree aux data: compile-time constants
  that take part in the jit cache key (and, for the kernels, in the generated
  source), so they must be hashable and changing one retraces;
- every other field is a pytree leaf: runtime data, so a new value (e.g. new
  document ids) reuses the compiled function and kernel.

The predicate must broadcast and return bool: the reference evaluates it with
index arrays of shapes such as b [B,1,1,1], h [1,H,1,1], q_idx [1,1,Sq,1],
kv_idx [1,1,1,Sk], and the call checks its result abstractly (jax.eval_shape)
at trace time. Array fields indexed by batch or position should be checked
against the call in :meth:`MaskMod.check_shapes`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MaskMod",
    "static",
    "causal_mask",
    "document_mask",
    "sliding_window_mask",
    "prefix_lm_mask",
    "CausalMask",
    "DocumentMask",
    "SlidingWindowMask",
    "PrefixLMMask",
]

_STATIC_METADATA_KEY = "flashjax_static"


def static(default: Any = dataclasses.MISSING) -> Any:
    """Declares a mask-mod field as a compile-time constant (pytree aux data).

    Without ``default`` the field is required. Its value must be hashable.
    """
    return dataclasses.field(default=default, metadata={_STATIC_METADATA_KEY: True})


def _is_static_field(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(_STATIC_METADATA_KEY, False))


class MaskMod:
    """Base class of all mask mods; subclasses are ``@dataclasses.dataclass(frozen=True)``."""

    # Per-class split of the dataclass fields, filled on first flatten: the
    # dataclass decorator runs after __init_subclass__, so fields are not known
    # when the class is registered.
    _field_split: ClassVar[tuple[tuple[str, ...], tuple[str, ...]] | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._field_split = None
        jax.tree_util.register_pytree_with_keys(
            cls,
            _flatten_with_keys,
            lambda aux, leaves, cls=cls: _unflatten(cls, aux, leaves),
            _flatten,
        )

    def __call__(self, b, h, q_idx, kv_idx):
        raise NotImplementedError(f"{type(self).__qualname__} must define __call__(b, h, q_idx, kv_idx)")

    @classmethod
    def _fields(cls) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(leaf field names, static field names), in declaration order."""
        if cls._field_split is None:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"mask mod {cls.__qualname__} must be a @dataclasses.dataclass(frozen=True)")
            fields = dataclasses.fields(cls)
            cls._field_split = (
                tuple(f.name for f in fields if not _is_static_field(f)),
                tuple(f.name for f in fields if _is_static_field(f)),
            )
        return cls._field_split

    def static_key(self) -> tuple:
        """A stable, hashable identity of the compile-time part of this mod.

        It names the class (module and qualname, so equal names in different
        modules differ) and the static field values; runtime array fields are
        not part of it. Kernel caches key on it.
        """
        _, static_names = self._fields()
        values = tuple((name, getattr(self, name)) for name in static_names)
        for name, value in values:
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"{type(self).__qualname__}.{name} is a static() field and must be hashable, got {value!r}"
                ) from e
        return (f"{type(self).__module__}.{type(self).__qualname__}", values)

    def check_shapes(self, *, batch: int, heads: int, seqlen_q: int | None, seqlen_k: int | None) -> None:
        """Raises ValueError where this mod's array fields do not fit a call; the call runs it at trace time.

        batch is B (dense) or N, the number of sequences (varlen); seqlen_q/seqlen_k are the dense call's lengths,
        None in varlen (sequence lengths are run-time data there). The default checks nothing: a subclass with
        per-batch or per-position arrays overrides it, since an index past an array's end would be clamped by
        jnp indexing instead of failing. The call also checks what the predicate returns (bool, broadcastable).
        """

    def dense(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
        """Evaluates the predicate for every (b, h, q_idx, kv_idx): bool [B, H, Sq, Sk]."""
        b = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
        h = jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1)
        q_idx = jnp.arange(seqlen_q, dtype=jnp.int32).reshape(1, 1, seqlen_q, 1)
        kv_idx = jnp.arange(seqlen_k, dtype=jnp.int32).reshape(1, 1, 1, seqlen_k)
        allowed = jnp.asarray(self(b, h, q_idx, kv_idx), dtype=jnp.bool_)
        return jnp.broadcast_to(allowed, (batch, heads, seqlen_q, seqlen_k))


def _flatten_with_keys(mod: MaskMod):
    leaf_names, static_names = mod._fields()
    children = tuple((jax.tree_util.GetAttrKey(name), getattr(mod, name)) for name in leaf_names)
    return children, tuple(getattr(mod, name) for name in static_names)


def _flatten(mod: MaskMod):
    leaf_names, static_names = mod._fields()
    return (
        tuple(getattr(mod, name) for name in leaf_names),
        tuple(getattr(mod, name) for name in static_names),
    )


def _unflatten(cls: type[MaskMod], aux: tuple, leaves) -> MaskMod:
    # Bypasses __init__/__post_init__: JAX rebuilds pytrees with placeholder
    # leaves (None, sentinels, tracers of other shapes) that argument validation
    # would wrongly reject.
    leaf_names, static_names = cls._fields()
    mod = object.__new__(cls)
    for name, value in zip(leaf_names, leaves):
        object.__setattr__(mod, name, value)
    for name, value in zip(static_names, aux):
        object.__setattr__(mod, name, value)
    return mod


def _as_int32_array(value, *, name: str, ndim: int, shape_doc: str) -> jax.Array:
    """Validates an integer index array argument and returns it as int32."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an int32 array {shape_doc}, got dtype {dtype}")
    if np.ndim(value) != ndim:
        raise ValueError(f"{name} must be an int32 array {shape_doc}, got shape {np.shape(value)}")
    return jnp.asarray(value, dtype=jnp.int32)


def _check_batch_rows(mod: MaskMod, field: str, shape: tuple, batch: int, rest: str = "") -> None:
    """A per-batch array field has `batch` rows, or one row that serves every batch entry."""
    if shape[0] not in (batch, 1):
        expected = f"({batch}{rest})" + (f", or (1{rest}) for one row shared by every batch entry" if batch != 1 else "")
        raise ValueError(f"flashjax: {type(mod).__qualname__}.{field}.shape must be {expected}, got {shape}")


def _batch_row(field: jax.Array, b):
    """The row of a per-batch field for batch index b: row b, or row 0 of a one-row field (shared by the batch)."""
    return jnp.zeros_like(b) if field.shape[0] == 1 else b


def _non_negative_int(value, *, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative Python int, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative Python int, got {value!r}") from None
    if as_int < 0:
        raise ValueError(f"{name} must be a non-negative Python int, got {value!r}")
    return as_int


@dataclasses.dataclass(frozen=True)
class CausalMask(MaskMod):
    """Top-left causal: query q_idx sees keys kv_idx <= q_idx.

    Raw indices, so this equals ``causal=True`` (bottom-right aligned) only when
    the query and key lengths match.
    """

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx


@dataclasses.dataclass(frozen=True)
class DocumentMask(MaskMod):
    """Block-diagonal by document: query and key see each other iff same document id.

    ``doc_ids`` int32 [B, S] labels the tokens of each batch row (in varlen, of
    each sequence, with sequence-local token positions); the same ids label
    queries and keys, so S must cover both lengths. [1, S] serves every batch
    row. Dense calls check the shape at trace time (B or 1 rows, S >= max(Sq,
    Sk)); in varlen the row count is checked against N and a position past S
    (a sequence longer than the ids, run-time data) is in no document: it sees
    no key and no query sees it.
    """

    doc_ids: jax.Array

    def __post_init__(self):
        object.__setattr__(
            self, "doc_ids", _as_int32_array(self.doc_ids, name="doc_ids", ndim=2, shape_doc="[batch, seqlen]")
        )

    def check_shapes(self, *, batch, heads, seqlen_q, seqlen_k):
        shape = tuple(self.doc_ids.shape)
        if seqlen_q is None:  # varlen: the positions are run-time data
            _check_batch_rows(self, "doc_ids", shape, batch, ", S")
            return
        need = max(seqlen_q, seqlen_k)
        _check_batch_rows(self, "doc_ids", shape, batch, f", S >= {need}")
        if shape[1] < need:
            raise ValueError(
                f"flashjax: {type(self).__qualname__}.doc_ids.shape must be ({shape[0]}, S) with S >= {need} (an id "
                f"for every position of the longer of q ({seqlen_q}) and k ({seqlen_k})), got {shape}"
            )

    def __call__(self, b, h, q_idx, kv_idx):
        length = self.doc_ids.shape[1]
        row = _batch_row(self.doc_ids, b)
        same = self.doc_ids[row, q_idx] == self.doc_ids[row, kv_idx]
        return same & (q_idx < length) & (kv_idx < length)


@dataclasses.dataclass(frozen=True)
class SlidingWindowMask(MaskMod):
    """Top-left band: q_idx - left <= kv_idx <= q_idx + right.

    Unlike ``window_size`` (bottom-right aligned), this sees raw indices. Both
    bounds are compile-time constants.
    """

    left: int = static()
    right: int = static(default=0)

    def __post_init__(self):
        object.__setattr__(self, "left", _non_negative_int(self.left, name="left"))
        object.__setattr__(self, "right", _non_negative_int(self.right, name="right"))

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - self.left) & (kv_idx <= q_idx + self.right)


@dataclasses.dataclass(frozen=True)
class PrefixLMMask(MaskMod):
    """Prefix LM: every query sees the first ``prefix_len[b]`` keys, and is causal (top-left) after.

    ``prefix_len`` int32 [B] (in varlen, one entry per sequence), or [1] for
    every batch row; the call checks the shape at trace time.
    """

    prefix_len: jax.Array

    def __post_init__(self):
        object.__setattr__(
            self, "prefix_len", _as_int32_array(self.prefix_len, name="prefix_len", ndim=1, shape_doc="[batch]")
        )

    def check_shapes(self, *, batch, heads, seqlen_q, seqlen_k):
        _check_batch_rows(self, "prefix_len", tuple(self.prefix_len.shape), batch, ",")

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx < self.prefix_len[_batch_row(self.prefix_len, b)]) | (kv_idx <= q_idx)


def causal_mask() -> CausalMask:
    """Top-left causal mask mod (kv_idx <= q_idx); see :class:`CausalMask`."""
    return CausalMask()


def document_mask(doc_ids) -> DocumentMask:
    """Same-document mask mod from int32 ids [B, S]; see :class:`DocumentMask`."""
    return DocumentMask(doc_ids)


def sliding_window_mask(left: int, right: int = 0) -> SlidingWindowMask:
    """Top-left band mask mod q_idx - left <= kv_idx <= q_idx + right; see :class:`SlidingWindowMask`."""
    return SlidingWindowMask(left, right)


def prefix_lm_mask(prefix_len) -> PrefixLMMask:
    """Prefix-LM mask mod from int32 prefix lengths [B]; see :class:`PrefixLMMask`."""
    return PrefixLMMask(prefix_len)
