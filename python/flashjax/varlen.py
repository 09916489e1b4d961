"""The values of a packed call's offsets (cu_seqlens_*, seqused_*), checked.

The kernels and the reference are safe whatever the offsets hold (they clamp; bad values give wrong rows, never an
out-of-bounds read), but a wrong packing is almost always a bug in the caller's data pipeline, so flashjax says so
wherever it can see the values:

- flash_attn_varlen checks concrete offsets (numpy arrays, or jax arrays outside jit) on every call;
- under jit the values are not known at trace time: ``check_varlen`` inside the jitted function, run through
  ``jax.experimental.checkify.checkify``, gives the same checks at run time.

The rules (docs/design.md §2.7): cu_seqlens starts at 0, never decreases, and ends at or before the token count
(tokens past its last entry are padding, not rows); seqused[b] lies in [0, cu_seqlens[b + 1] - cu_seqlens[b]].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = ["check_varlen"]


def check_varlen(cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None, total_q=None, total_k=None):
    """Checks packed-sequence offsets by value; raises ValueError naming the first bad entry.

    Args:
      cu_seqlens_q, cu_seqlens_k: int32 [N + 1] offsets, as flash_attn_varlen takes them.
      seqused_q, seqused_k: optional int32 [N].
      total_q, total_k: the token counts (q.shape[0], k.shape[0]); without them the end is not checked.

    Concrete values are checked at once. Traced values (under jit) are checked with checkify: wrap the jitted
    function in ``jax.experimental.checkify.checkify`` and call ``.throw()`` on the error it returns.
    """
    for name, offsets, used_name, used, total in _sides(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q,
                                                        total_k):
        if _is_concrete(offsets) and (used is None or _is_concrete(used)):
            _check_concrete(name, np.asarray(offsets), used_name, None if used is None else np.asarray(used), total)
        else:
            _check_traced(name, jnp.asarray(offsets), used_name, None if used is None else jnp.asarray(used), total)


def check_concrete_call(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q, total_k):
    """flash_attn_varlen's check: the offsets whose values are known now (outside jit), the others left alone."""
    for name, offsets, used_name, used, total in _sides(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q,
                                                        total_k):
        if _is_concrete(offsets):
            used = np.asarray(used) if used is not None and _is_concrete(used) else None
            _check_concrete(name, np.asarray(offsets), used_name, used, total)


def _sides(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q, total_k):
    return (("cu_seqlens_q", cu_seqlens_q, "seqused_q", seqused_q, total_q),
            ("cu_seqlens_k", cu_seqlens_k, "seqused_k", seqused_k, total_k))


def _is_concrete(x) -> bool:
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, jax.core.Tracer):
        return False
    return isinstance(x, jax.Array) and x.is_fully_addressable


def _check_concrete(name, offsets, used_name, used, total):
    offsets = offsets.astype(np.int64)
    if offsets.size and offsets[0] != 0:
        raise ValueError(f"flashjax: {name}[0] must be 0 (the first sequence starts at token 0), got {offsets[0]}")
    drops = np.nonzero(offsets[1:] < offsets[:-1])[0]
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(f"flashjax: {name} must be nondecreasing, got {name}[{i}] = {offsets[i]} after "
                         f"{name}[{i - 1}] = {offsets[i - 1]}")
    if total is not None and offsets.size and offsets[-1] > total:
        raise ValueError(f"flashjax: {name}[{offsets.size - 1}] must be at most the token count {total}, got "
                         f"{offsets[-1]}")
    if used is None:
        return
    lengths = offsets[1:] - offsets[:-1]
    bad = np.nonzero((used < 0) | (used > lengths))[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"flashjax: {used_name}[{b}] must be in [0, {lengths[b]}] (sequence {b}'s length in {name}), "
                         f"got {used[b]}")


def _check_traced(name, offsets, used_name, used, total):
    if offsets.shape[0]:
        checkify.check(offsets[0] == 0, f"flashjax: {name}[0] must be 0, got {{}}", offsets[0])
    if offsets.shape[0] > 1:
        drops = offsets[1:] < offsets[:-1]
        i = jnp.argmax(drops) + 1
        checkify.check(~jnp.any(drops), f"flashjax: {name} must be nondecreasing, got {name}[{{}}] = {{}} after {{}}",
                       i, offsets[i], offsets[i - 1])
    if total is not None and offsets.shape[0]:
        checkify.check(offsets[-1] <= total, f"flashjax: {name}[-1] must be at most the token count {total}, got {{}}",
                       offsets[-1])
    if used is not None and offsets.shape[0] > 1:
        lengths = offsets[1:] - offsets[:-1]
        bad = (used < 0) | (used > lengths)
        b = jnp.argmax(bad)
        checkify.check(~jnp.any(bad), f"flashjax: {used_name}[{{}}] must be in [0, {{}}], got {{}}", b, lengths[b],
                       used[b])
