"""An independent float64 NumPy oracle for docs/design.md §2, written from its text.

It shares no code with ``flashjax.reference``: it works one softmax row at a
time, and handles varlen by slicing each sequence out of the packed arrays.
Gradients are the analytic ones, derived by hand below; the tests check them
against central finite differences of the forward.

Mask predicates are NumPy callables ``allow(b, h, q_idx, kv_idx)`` taking two
ints and two broadcasting index arrays (q_idx [Sq, 1], kv_idx [1, Sk]); in
varlen, b is the sequence index and the indices are sequence-local.
"""

from __future__ import annotations

import numpy as np


def band(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """bool [Sq, Sk]: the bottom-right aligned causal/window visibility of §2.3."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    visible = np.ones((seqlen_q, seqlen_k), bool)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible


def _row(q_row, keys, values, sink, scale, softcap, d_out, d_lse):
    """One softmax row over its visible keys: (out, lse, dq, dkeys, dvalues, dsink)."""
    if sink is not None and sink == -np.inf:  # §2.4: a -inf sink is no sink (its gradient is 0)
        return _row(q_row, keys, values, None, scale, softcap, d_out, d_lse)
    if sink is not None and sink == np.inf:  # all the weight on the sink: out 0, lse = sink, d lse / d sink = 1
        return (np.zeros(values.shape[1]), np.inf, np.zeros_like(q_row), np.zeros_like(keys),
                np.zeros_like(values), float(d_lse))
    if sink is not None and np.isnan(sink):  # NaN in the denominator: lse NaN; out NaN where a key is visible
        nan = np.nan if keys.shape[0] else 0.0
        return (np.full(values.shape[1], nan), np.nan, np.full_like(q_row, nan), np.full_like(keys, np.nan),
                np.full_like(values, np.nan), np.nan)
    raw = scale * (keys @ q_row)
    logits = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    all_logits = logits if sink is None else np.append(logits, sink)
    if all_logits.size == 0:
        return (np.zeros(values.shape[1]), -np.inf, np.zeros_like(q_row), np.zeros_like(keys),
                np.zeros_like(values), 0.0)
    peak = all_logits.max()
    weights = np.exp(all_logits - peak)
    total = weights.sum()
    probs = weights / total
    lse = peak + np.log(total)
    key_probs = probs[: logits.size]
    out = key_probs @ values

    # d lse / d logit = p, d out / d logit_j = p_j (v_j - out): the sink column
    # shares the first term and has no value, so it only sees -rowsum(dO o O).
    row_dot = d_out @ out
    d_logits = key_probs * (values @ d_out - row_dot + d_lse)
    d_sink = 0.0 if sink is None else probs[-1] * (d_lse - row_dot)
    if softcap > 0:
        d_logits = d_logits * (1.0 - np.tanh(raw / softcap) ** 2)
    d_q = scale * (d_logits @ keys)
    d_keys = scale * np.outer(d_logits, q_row)
    d_values = np.outer(key_probs, d_out)
    return out, lse, d_q, d_keys, d_values, d_sink


def attention_with_grads(q, k, v, *, scale, causal=False, window=(-1, -1), sinks=None, softcap=0.0, allow=None,
                         d_out=None, d_lse=None, batch_ids=None):
    """Dense attention, q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv], in float64.

    Returns (out, lse, dq, dk, dv, dsinks) where the gradients are those of
    sum(out * d_out) + sum(lse * d_lse) over the rows whose lse is finite
    (zero cotangents when d_out/d_lse are None). ``batch_ids`` renames the
    batch index seen by ``allow`` (varlen passes the sequence index).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    d_out = np.zeros(q.shape[:3] + (v.shape[-1],)) if d_out is None else np.asarray(d_out, np.float64)
    d_lse = np.zeros((batch, heads_q, seqlen_q)) if d_lse is None else np.asarray(d_lse, np.float64)
    sinks = None if sinks is None else np.asarray(sinks, np.float64)

    out = np.zeros(d_out.shape)
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(heads_q)
    visible_band = band(seqlen_q, seqlen_k, causal, window)
    for b in range(batch):
        mask_b = b if batch_ids is None else batch_ids[b]
        for h in range(heads_q):
            visible = visible_band
            if allow is not None:
                allowed = allow(mask_b, h, np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :])
                visible = visible & np.broadcast_to(allowed, visible.shape)
            kv_head = h // group
            for i in range(seqlen_q):
                cols = np.flatnonzero(visible[i])
                sink = None if sinks is None else sinks[h]
                o, l, g_q, g_k, g_v, g_sink = _row(q[b, i, h], k[b, cols, kv_head], v[b, cols, kv_head], sink,
                                                   scale, softcap, d_out[b, i, h], d_lse[b, h, i])
                out[b, i, h], lse[b, h, i] = o, l
                dq[b, i, h] += g_q
                dk[b, cols, kv_head] += g_k
                dv[b, cols, kv_head] += g_v
                dsinks[h] += g_sink
    return out, lse, dq, dk, dv, dsinks


def attention(q, k, v, **kwargs):
    """Dense attention forward only: (out, lse), float64."""
    return attention_with_grads(q, k, v, **kwargs)[:2]


def used_lengths(cu_seqlens, seqused):
    """Per sequence: the slot length, or seqused clamped into [0, slot length]."""
    lengths = np.diff(np.asarray(cu_seqlens))
    if seqused is None:
        return lengths
    return np.clip(np.asarray(seqused), 0, lengths)


def varlen_attention_with_grads(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None,
                                d_out=None, d_lse=None, **kwargs):
    """Packed attention by slicing every sequence out and running the dense oracle on it.

    q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv]. Rows outside every used range
    keep out = 0, lse = -inf and zero gradients. Returns (out [Tq, Hq, Dv],
    lse [Hq, Tq], dq, dk, dv, dsinks).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    total_q, heads_q, _ = q.shape
    d_out = np.zeros((total_q, heads_q, v.shape[-1])) if d_out is None else np.asarray(d_out, np.float64)
    d_lse = np.zeros((heads_q, total_q)) if d_lse is None else np.asarray(d_lse, np.float64)
    out, lse = np.zeros(d_out.shape), np.full((heads_q, total_q), -np.inf)
    dq, dk, dv, dsinks = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape), np.zeros(heads_q)
    used_q, used_k = used_lengths(cu_seqlens_q, seqused_q), used_lengths(cu_seqlens_k, seqused_k)
    for b in range(len(used_q)):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b] + used_q[b])
        cols = slice(cu_seqlens_k[b], cu_seqlens_k[b] + used_k[b])
        o, l, g_q, g_k, g_v, g_s = attention_with_grads(
            q[None, rows], k[None, cols], v[None, cols], d_out=d_out[None, rows], d_lse=d_lse[None, :, rows],
            batch_ids=[b], **kwargs)
        out[rows], lse[:, rows] = o[0], l[0]
        dq[rows] += g_q[0]
        dk[cols] += g_k[0]
        dv[cols] += g_v[0]
        dsinks += g_s
    return out, lse, dq, dk, dv, dsinks


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Packed attention forward only: (out, lse), float64."""
    return varlen_attention_with_grads(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)[:2]
