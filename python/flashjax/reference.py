"""The executable spec: pure-JAX attention with exactly the semantics of docs/design.md §2.

Every kernel is tested against these two functions, and ``backend="reference"``
runs them. They favour clarity over speed: scores are materialized in f32, in
query-row chunks once the score matrix would pass ``_SCORE_BYTES_BUDGET``.
They are plain jnp, so jit, grad, vjp, jvp and vmap (of the dense one) work
through them; masking uses the double-where pattern so that empty rows, unused
tokens and padding produce zeros, never NaN, in values and derivatives.

Arguments arrive validated and resolved by ``api.py`` (scale is a float,
``window_size`` a pair of ints, ``causal`` not yet folded into the window).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from flashjax.masks import MaskMod

__all__ = ["attention", "attention_varlen", "attention_vjp"]

# Largest f32 score matrix materialized at once (B * Hq * rows * Sk * 4 bytes);
# beyond it the query rows are processed in chunks so CPU runs never OOM.
_SCORE_BYTES_BUDGET = 256 * 2**20

_COMPUTE_DTYPE = jnp.float32

# (q rows [B, C, Hq, D], global row indices [C]) -> (out [B, C, Hq, Dv] f32, lse [B, Hq, C] f32)
_RowAttention = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def attention(q, k, v, *, softmax_scale: float, causal: bool, window_size: tuple, sinks, softcap: float,
              mask_mod: MaskMod | None):
    """Dense attention: q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv].

    Returns ``(out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] f32)``. The
    band is bottom-right aligned (offset = Sk - Sq); ``mask_mod`` sees raw
    top-left indices and is ANDed with it. A row with no visible key gets
    out = 0 and lse = -inf, or lse = sinks[h] when sinks are given.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    left, right = _band_bounds(causal, window_size)
    k32, v32 = k.astype(_COMPUTE_DTYPE), v.astype(_COMPUTE_DTYPE)
    kv_idx = jnp.arange(seqlen_k, dtype=jnp.int32)
    batch_idx = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
    head_idx = jnp.arange(heads_q, dtype=jnp.int32).reshape(1, heads_q, 1, 1)

    def attend_rows(q_rows, row_idx):
        visible = _band_visible(row_idx[:, None], kv_idx[None, :], seqlen_k - seqlen_q, left, right)
        visible = _and_mask_mod(visible, mask_mod, batch_idx, head_idx, row_idx[None, None, :, None],
                                kv_idx[None, None, None, :])
        return _attend(q_rows, k32, v32, visible, row_valid=None, sinks=sinks, softmax_scale=softmax_scale,
                       softcap=softcap)

    out, lse = _map_query_chunks(attend_rows, q.astype(_COMPUTE_DTYPE), heads_q * seqlen_k)
    return out.astype(q.dtype), lse


def attention_vjp(q, k, v, out, lse, d_out, d_lse, *, softmax_scale: float, causal: bool, window_size: tuple, sinks,
                  softcap: float, mask_mod: MaskMod | None):
    """Gradients (dq, dk, dv, dsinks or None) of a dense call whose rows came out as (out, lse), as the backward
    kernels compute them: from P = exp(s - lse) and D = rowsum(d_out * out) - d_lse, read rather than recomputed.

    With (out, lse) of this very call that is autodiff of ``attention``. When the call's keys are one block of
    longer rows (ring attention: out and lse are those of the whole row) it is the block's share of the row's
    gradient. Computed as autodiff of ``attention`` with the cotangents moved onto the block's own (out_b, lse_b):
    per row w = exp(lse_b - lse), d_out_b = w d_out, d_lse_b = w (d_out . out_b - d_out . out + d_lse), which turns
    autodiff's dS = P_b (dP_b - D_b) into exactly P (dP - D). Rows whose lse_b equals lse (and NaN rows) take the
    cotangents as given, so the first case is plain autodiff, bit for bit.
    """
    kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                  mask_mod=mask_mod)
    if sinks is None:
        (out_b, lse_b), pullback = jax.vjp(lambda q, k, v: attention(q, k, v, sinks=None, **kwargs), q, k, v)
    else:
        (out_b, lse_b), pullback = jax.vjp(lambda q, k, v, s: attention(q, k, v, sinks=s, **kwargs), q, k, v, sinks)
    same = (lse_b == lse) | jnp.isnan(lse)
    weight = jnp.where(same, 1.0, jnp.exp(jnp.where(same, 0.0, lse_b - lse)))  # [B, Hq, Sq]

    def row_dot(o):  # d_out . o per row, [B, Hq, Sq]
        return jnp.swapaxes(jnp.sum(d_out.astype(_COMPUTE_DTYPE) * o.astype(_COMPUTE_DTYPE), axis=-1), 1, 2)

    d_out_b = jnp.where(jnp.swapaxes(same, 1, 2)[..., None], d_out,
                        (jnp.swapaxes(weight, 1, 2)[..., None] * d_out.astype(_COMPUTE_DTYPE)).astype(d_out.dtype))
    d_lse_b = jnp.where(same, d_lse, weight * (row_dot(out_b) - row_dot(out) + d_lse))
    grads = pullback((d_out_b, d_lse_b))
    return (*grads, None) if sinks is None else grads


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q, seqused_k, softmax_scale: float,
                     causal: bool, window_size: tuple, sinks, softcap: float, mask_mod: MaskMod | None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """Packed attention: q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv], cu_seqlens_* int32 [N + 1].

    Returns ``(out [Tq, Hq, Dv] in q.dtype, lse [Hq, Tq] f32)``. Sequence b is
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]],
    restricted to its first ``seqused_*[b]`` tokens when given (clamped to the
    slot length). The band is bottom-right aligned per sequence with
    offset = used_k - used_q; ``mask_mod`` sees b = the sequence index and
    sequence-local indices.

    The packing is runtime data (per-token sequence ids come from a binary
    search), so one trace serves every packing. Tokens outside every used
    range (unused query rows, tokens past ``cu_seqlens_q[-1]``) are treated as
    rows that are not there: out = 0 and lse = -inf even when sinks are given
    (the sink joins only real rows), with zero gradients. Unused tokens of q, k
    and v are replaced by zeros before use, so NaN there cannot leak.

    With both ``max_seqlen_*`` hints the same values are computed per sequence
    (N x max_seqlen_q x max_seqlen_k scores instead of Tq x Tk) wherever the
    offsets are well formed and the hints hold; a run-time branch takes the
    all-pairs evaluation otherwise, so a wrong hint costs time, never results.
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    total_q, heads_q, _ = q.shape
    total_k = k.shape[0]
    if num_seqs == 0:
        return (jnp.zeros((total_q, heads_q, v.shape[-1]), q.dtype),
                jnp.full((heads_q, total_q), -jnp.inf, jnp.float32))
    kwargs = dict(seqused_q=seqused_q, seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                  window_size=window_size, sinks=sinks, softcap=softcap, mask_mod=mask_mod)
    hints = None if max_seqlen_q is None or max_seqlen_k is None else (max(int(max_seqlen_q), 1),
                                                                         max(int(max_seqlen_k), 1))
    if hints is not None and num_seqs * hints[0] * hints[1] < total_q * total_k:
        operands = (q, k, v, cu_seqlens_q, cu_seqlens_k)
        return lax.cond(_packing_fits(cu_seqlens_q, cu_seqlens_k, total_q, total_k, hints),
                        lambda *x: _varlen_by_sequence(*x, hints=hints, **kwargs),
                        lambda *x: _varlen_all_pairs(*x, **kwargs), *operands)
    return _varlen_all_pairs(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)


def _varlen_all_pairs(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q, seqused_k, softmax_scale, causal,
                      window_size, sinks, softcap, mask_mod):
    """attention_varlen as its definition reads: every query row against every packed key, masked."""
    total_q, heads_q, _ = q.shape
    total_k = k.shape[0]
    left, right = _band_bounds(causal, window_size)
    used_q = _used_lengths(cu_seqlens_q, seqused_q)
    used_k = _used_lengths(cu_seqlens_k, seqused_k)
    k_seq, k_local, k_valid = _locate_tokens(cu_seqlens_k, used_k, jnp.arange(total_k, dtype=jnp.int32))
    _, _, q_valid_all = _locate_tokens(cu_seqlens_q, used_q, jnp.arange(total_q, dtype=jnp.int32))
    # Zeroing unused tokens up front keeps NaN/inf in padding out of every
    # product, including the gradient products dq = dS k and dk = dS^T q.
    q32 = jnp.where(q_valid_all[:, None, None], q.astype(_COMPUTE_DTYPE), 0)[None]
    k32 = jnp.where(k_valid[:, None, None], k.astype(_COMPUTE_DTYPE), 0)[None]
    v32 = jnp.where(k_valid[:, None, None], v.astype(_COMPUTE_DTYPE), 0)[None]
    head_idx = jnp.arange(heads_q, dtype=jnp.int32).reshape(1, heads_q, 1, 1)

    def attend_rows(q_rows, row_idx):
        q_seq, q_local, q_valid = _locate_tokens(cu_seqlens_q, used_q, row_idx)
        offset = (used_k - used_q)[q_seq]
        visible = ((q_seq[:, None] == k_seq[None, :]) & q_valid[:, None] & k_valid[None, :]
                   & _band_visible(q_local[:, None], k_local[None, :], offset[:, None], left, right))
        visible = _and_mask_mod(visible, mask_mod, q_seq[None, None, :, None], head_idx,
                                q_local[None, None, :, None], k_local[None, None, None, :])
        return _attend(q_rows, k32, v32, visible, row_valid=q_valid[:, None], sinks=sinks, softmax_scale=softmax_scale,
                       softcap=softcap)

    out, lse = _map_query_chunks(attend_rows, q32, heads_q * total_k)
    return out[0].astype(q.dtype), lse[0]


def _packing_fits(cu_seqlens_q, cu_seqlens_k, total_q, total_k, hints):
    """Whether the per-sequence evaluation sees exactly what the all-pairs one does: offsets that start at 0 or
    later, never decrease and end inside the tokens (so each token belongs to the sequence whose slot holds it),
    and no slot longer than its hint."""
    def fits(cu, total, hint):
        lengths = cu[1:] - cu[:-1]
        return (cu[0] >= 0) & (cu[-1] <= total) & jnp.all(lengths >= 0) & jnp.all(lengths <= hint)
    return fits(cu_seqlens_q, total_q, hints[0]) & fits(cu_seqlens_k, total_k, hints[1])


def _varlen_by_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, *, hints, seqused_q, seqused_k, softmax_scale, causal,
                        window_size, sinks, softcap, mask_mod):
    """attention_varlen for offsets that _packing_fits: each sequence gathered into a [N, hint] slot of a dense
    batch, attended there with its own lengths and band, and scattered back to its packed rows."""
    max_q, max_k = hints
    total_q, heads_q, _ = q.shape
    left, right = _band_bounds(causal, window_size)
    used_q = _used_lengths(cu_seqlens_q, seqused_q)
    used_k = _used_lengths(cu_seqlens_k, seqused_k)

    def gather(x, cu, width, used):  # [T, H, D] -> [N, width, H, D] f32, zero past each sequence's used tokens
        padded = jnp.pad(x.astype(_COMPUTE_DTYPE), ((0, width), (0, 0), (0, 0)))
        local = jnp.arange(width, dtype=jnp.int32)
        rows = padded[cu[:-1, None] + local[None, :]]
        return jnp.where((local[None, :] < used[:, None])[..., None, None], rows, 0)

    q_slots = gather(q, cu_seqlens_q, max_q, used_q)
    k_slots, v_slots = gather(k, cu_seqlens_k, max_k, used_k), gather(v, cu_seqlens_k, max_k, used_k)
    seq_idx = jnp.arange(used_q.shape[0], dtype=jnp.int32).reshape(-1, 1, 1, 1)
    head_idx = jnp.arange(heads_q, dtype=jnp.int32).reshape(1, heads_q, 1, 1)
    kv_idx = jnp.arange(max_k, dtype=jnp.int32)[None, None, None, :]
    lengths_q, lengths_k = used_q.reshape(-1, 1, 1, 1), used_k.reshape(-1, 1, 1, 1)

    def attend_rows(q_rows, row_idx):
        rows = row_idx[None, None, :, None]
        row_valid = rows < lengths_q
        visible = (row_valid & (kv_idx < lengths_k)
                   & _band_visible(rows, kv_idx, lengths_k - lengths_q, left, right))
        visible = _and_mask_mod(visible, mask_mod, seq_idx, head_idx, rows, kv_idx)
        return _attend(q_rows, k_slots, v_slots, visible, row_valid=row_valid, sinks=sinks,
                       softmax_scale=softmax_scale, softcap=softcap)

    out_slots, lse_slots = _map_query_chunks(attend_rows, q_slots, heads_q * max_k)
    seq, local, valid = _locate_tokens(cu_seqlens_q, used_q, jnp.arange(total_q, dtype=jnp.int32))
    local = jnp.clip(local, 0, max_q - 1)
    out = jnp.where(valid[:, None, None], out_slots[seq, local], 0)
    lse = jnp.where(valid[None, :], lse_slots[seq, :, local].T, -jnp.inf)
    return out.astype(q.dtype), lse


def _band_bounds(causal: bool, window_size: tuple) -> tuple[int, int]:
    """(left, right) after folding causal in (§2.3); a negative bound means unbounded."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


def _band_visible(q_idx, kv_idx, offset, left: int, right: int):
    """Bottom-right aligned band: i + offset - left <= j <= i + offset + right."""
    diagonal = q_idx + offset
    visible = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx), jnp.shape(offset)), jnp.bool_)
    if right >= 0:
        visible = visible & (kv_idx <= diagonal + right)
    if left >= 0:
        visible = visible & (kv_idx >= diagonal - left)
    return visible


def _and_mask_mod(visible, mask_mod: MaskMod | None, b, h, q_idx, kv_idx):
    """visible AND the mod's predicate (taken as bool) at the given broadcasting raw indices."""
    if mask_mod is None:
        return visible
    return visible & jnp.asarray(mask_mod(b, h, q_idx, kv_idx)).astype(jnp.bool_)


def _used_lengths(cu_seqlens, seqused):
    """Tokens used per sequence: the slot length, or seqused clamped into [0, slot length]."""
    lengths = jnp.maximum(cu_seqlens[1:] - cu_seqlens[:-1], 0)
    if seqused is None:
        return lengths
    return jnp.clip(seqused.astype(lengths.dtype), 0, lengths)


def _locate_tokens(cu_seqlens, used, token_idx):
    """Per packed token: (sequence id clamped into range, sequence-local index, is a used token).

    With zero-length sequences cu_seqlens repeats values; searching on the right
    picks the last sequence starting at or before the token, the non-empty one.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    seq = jnp.searchsorted(cu_seqlens, token_idx, side="right").astype(jnp.int32) - 1
    in_range = (seq >= 0) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, num_seqs - 1)
    local = token_idx - cu_seqlens[seq]
    return seq, local, in_range & (local >= 0) & (local < used[seq])


def _map_query_chunks(attend_rows: _RowAttention, q, row_score_elems: int):
    """Applies ``attend_rows`` to all query rows of q [B, S, Hq, D], in chunks that fit the budget.

    ``row_score_elems`` is the score count of one query row for one batch entry.
    Padded rows of the last chunk are computed and dropped.
    """
    batch, seqlen_q, heads_q = q.shape[:3]
    row_bytes = 4 * batch * row_score_elems
    rows_per_chunk = max(1, _SCORE_BYTES_BUDGET // max(row_bytes, 1))
    if rows_per_chunk >= seqlen_q:
        return attend_rows(q, jnp.arange(seqlen_q, dtype=jnp.int32))
    num_chunks = math.ceil(seqlen_q / rows_per_chunk)
    padded = num_chunks * rows_per_chunk
    q_padded = jnp.pad(q, ((0, 0), (0, padded - seqlen_q), (0, 0), (0, 0)))
    q_chunks = q_padded.reshape(batch, num_chunks, rows_per_chunk, *q.shape[2:]).swapaxes(0, 1)
    row_chunks = jnp.arange(padded, dtype=jnp.int32).reshape(num_chunks, rows_per_chunk)
    out, lse = lax.map(lambda chunk: attend_rows(*chunk), (q_chunks, row_chunks))
    # out [chunks, B, C, Hq, Dv] -> [B, Sq, Hq, Dv]; lse [chunks, B, Hq, C] -> [B, Hq, Sq].
    out = out.swapaxes(0, 1).reshape(batch, padded, heads_q, out.shape[-1])[:, :seqlen_q]
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads_q, padded)[..., :seqlen_q]
    return out, lse


def _attend(q_rows, k, v, visible, *, row_valid, sinks, softmax_scale: float, softcap: float):
    """Softmax attention of a block of query rows against all keys, in f32.

    q_rows [B, C, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]; ``visible`` is a
    bool mask broadcastable to [B, Hq, C, Sk]; ``row_valid`` (broadcastable to
    [C, 1], or None for all rows) says which rows exist, and only those get the
    sink term. Returns out [B, C, Hq, Dv] and lse [B, Hq, C].
    """
    batch, rows, heads_q, head_dim = q_rows.shape
    heads_k = k.shape[2]
    group = heads_q // heads_k
    # Query head h = kv_head * group + g reads kv head h // group (§2.2).
    q_grouped = q_rows.reshape(batch, rows, heads_k, group, head_dim)
    scores = jnp.einsum("bchgd,bkhd->bhgck", q_grouped, k, precision=lax.Precision.HIGHEST)
    scores = softmax_scale * scores.reshape(batch, heads_q, rows, k.shape[1])
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    visible = jnp.broadcast_to(visible, scores.shape)

    row_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    has_key = jnp.any(visible, axis=-1, keepdims=True)
    sink_takes_all = None
    if sinks is not None:
        sink_logit = jnp.broadcast_to(sinks.astype(_COMPUTE_DTYPE)[None, :, None, None], row_max.shape)
        sink_present = jnp.broadcast_to(True if row_valid is None else row_valid, row_max.shape)
        # §2.4: a +inf sink takes all the weight (out 0, lse +inf). Such rows are computed as if they had no sink and
        # replaced at the end, so that no inf - inf forms in values or derivatives. A -inf sink is no sink; a NaN
        # sink flows through (jnp.maximum keeps NaN) into the denominator, so lse and out become NaN.
        sink_takes_all = sink_present & (sink_logit == jnp.inf)
        sink_logit = jnp.where(sink_present & ~sink_takes_all, sink_logit, -jnp.inf)
        row_max = jnp.maximum(row_max, sink_logit)
    # The shift only keeps exp in range; lse and out do not depend on it, so
    # no gradient flows through it. Empty rows (max = -inf) shift by 0.
    shift = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    # Masked entries go to exp(-inf) = 0, whose derivative is 0: no inf * 0.
    probs_unnormalized = jnp.exp(jnp.where(visible, scores - shift, -jnp.inf))
    denominator = jnp.sum(probs_unnormalized, axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + jnp.exp(sink_logit - shift)

    # Double where: rows with nothing in the denominator take log/divide of 1
    # so that no inf or NaN appears in either branch or its derivative. A NaN
    # denominator (a NaN sink or NaN scores) is not "nothing": its NaN reaches
    # lse as it reaches out. Rows with no visible key divide by 1 instead, so
    # their out stays 0 whatever the sink is (lse = the sink, §2.5).
    has_mass = ~(denominator <= 0)
    safe_denominator = jnp.where(has_mass, denominator, 1.0)
    lse = jnp.where(has_mass, shift + jnp.log(safe_denominator), -jnp.inf)
    probs = probs_unnormalized / jnp.where(has_key, safe_denominator, 1.0)
    if sink_takes_all is not None:
        # d lse / d sink = 1 in these rows (lse = sink), the limit of p_sink = 1 in §2.4's gradient.
        lse = jnp.where(sink_takes_all, sinks.astype(_COMPUTE_DTYPE)[None, :, None, None], lse)
        probs = jnp.where(sink_takes_all, 0.0, probs)

    probs = probs.reshape(batch, heads_k, group, rows, k.shape[1])
    out = jnp.einsum("bhgck,bkhd->bchgd", probs, v, precision=lax.Precision.HIGHEST)
    return out.reshape(batch, rows, heads_q, v.shape[-1]), lse[..., 0]
