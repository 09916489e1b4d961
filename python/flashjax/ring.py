"""Ring attention: the sequence split over a mesh axis, inside jax.shard_map (docs/sharding.md).

Each device keeps its queries; the key/value blocks go around the ring (lax.ppermute to the next device, n - 1
times) while each device runs flash_attn on the block in hand, so on a GPU every block is the kernels. The calls a
device makes at each step are planned at trace time (ring_plan.py); partial results merge through their lse, and
sinks join once, at the end. The backward (a custom_vjp) runs the ring again: each block's gradient comes from the
merged out and lse (the backward kernels' contract, reference.attention_vjp on the reference), dq stays home, and dk
and dv travel with their block and are passed on once more to arrive back home.

The K/V transfer of the next step depends on nothing the step computes, and the dK/dV transfer is needed only after
the next step's compute, so XLA may overlap both with the kernels (docs/sharding.md says what the schedule shows).
backend="reference" differentiates the same ring by autodiff instead (forward mode included).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import api, primitives, reference, ring_plan, sharding

_F32 = jnp.float32
# Backends whose ring is differentiated by autodiff (forward mode included), not by the ring backward (custom_vjp).
AUTODIFF_BACKENDS = ("reference",)


# ------------------------------------------------------------------------------------------------ merging partials
def _merge(a, b):
    """Two partial results (out f32 [B, S, H, Dv], lse [B, H, S]) of disjoint key sets, as one. Rows with no key in
    either stay out = 0, lse = -inf; differentiable (the shift is a constant, no division by zero)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - shift), jnp.exp(lse_b - shift)
    total = w_a + w_b
    has_mass = ~(total <= 0)  # NaN is mass: it reaches lse and out
    safe = jnp.where(has_mass, total, 1.0)
    lse = jnp.where(has_mass, shift + jnp.log(safe), -jnp.inf)

    def rows(x):  # [B, H, S] -> [B, S, H, 1]
        return jnp.swapaxes(x, 1, 2)[..., None]

    return (out_a * rows(w_a) + out_b * rows(w_b)) / rows(safe), lse


def _add_sinks(out, lse, sinks):
    """docs/design.md §2.4 applied to a merged result: lse = log(exp(lse) + exp(sink)), out scaled by
    exp(lse_before - lse). -inf is no sink, +inf takes all the weight (out 0, lse +inf, d lse / d sink = 1), NaN
    propagates except into rows with no key (out 0, lse the sink). Written with explicit wheres so that autodiff
    gives §2.4's gradients (jnp.logaddexp's derivative at infinities does not)."""
    sink = sinks.astype(_F32)[None, :, None]
    finite = jnp.where(jnp.isinf(sink), 0.0, sink)
    top = lax.stop_gradient(jnp.maximum(lse, finite))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    denominator = jnp.exp(lse - shift) + jnp.exp(finite - shift)
    merged = jnp.where(sink == -jnp.inf, lse, jnp.where(sink == jnp.inf, sink, shift + jnp.log(denominator)))
    weight = jnp.where(sink == -jnp.inf, 1.0, jnp.where(sink == jnp.inf, 0.0, jnp.exp(lse - shift) / denominator))
    scaled = out * jnp.swapaxes(weight, 1, 2)[..., None]
    return jnp.where(jnp.swapaxes(lse == -jnp.inf, 1, 2)[..., None], 0.0, scaled), merged


# ------------------------------------------------------------------------------------------------ one block
def _block_keywords(window, options):
    """flash_attn's keywords for one block: the ring's options with the block's own window."""
    return dict(window_size=window, softmax_scale=options.softmax_scale, softcap=options.softcap,
                deterministic=options.deterministic, backend=options.backend)


def _block_forward(q, k, v, window, options):
    """flash_attn of one block (out f32, lse), on whatever backend the call resolves to."""
    out, lse = api.flash_attn(q, k, v, return_lse=True, **_block_keywords(window, options))
    return out.astype(_F32), lse


def _block_grads(q, k, v, out, lse, d_out, d_lse, window, options):
    """(dq, dk, dv) f32 of one block whose rows belong to the merged (out, lse): the backward kernels read out and
    lse instead of recomputing them, so they give the block's share of the whole row's gradient; the reference
    does the same through reference.attention_vjp."""
    call = api._dense_call(q, k, v, return_lse=True, **_block_keywords(window, options))
    path, _, plan = api.choose(call)
    if path == "kernel":
        width = plan["head_dim"]
        pad = functools.partial(api._pad_last, width=width)
        left, right = window
        dq, dk, dv, _ = primitives.backward(
            pad(q), pad(k), pad(v), pad(out), lse, pad(d_out), d_lse, jnp.zeros((q.shape[2],), _F32),
            has_dlse=True, softmax_scale=options.softmax_scale, softcap=options.softcap, window_left=left,
            window_right=right, has_sinks=False, deterministic=options.deterministic)
        dq, dk, dv = dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    else:
        dq, dk, dv, _ = reference.attention_vjp(q, k, v, out, lse, d_out, d_lse, softmax_scale=options.softmax_scale,
                                                causal=False, window_size=window, sinks=None, softcap=options.softcap,
                                                mask_mod=None)
    return dq.astype(_F32), dk.astype(_F32), dv.astype(_F32)


# ------------------------------------------------------------------------------------------------ one step
def _run_step(step: ring_plan.Step, branch, axis_name, *operands):
    """branch(case, *operands) for the case this device runs at this step: one of the step's distinct cases, picked
    by the device's index on the ring (no conditional where every device runs the same case)."""
    if len(step.cases) == 1:
        return branch(step.cases[0], *operands)
    index = jnp.asarray(step.case_of, jnp.int32)[lax.axis_index(axis_name)]
    return lax.switch(index, [functools.partial(branch, case) for case in step.cases], *operands)


def _pad_rows(x, start, length):
    """x [B, rows, ...] at rows start.. of a [B, length, ...] array of zeros."""
    return jnp.pad(x, ((0, 0), (start, length - start - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def _filled(shape, value, operands):
    """jnp.full(shape, value) varying over the same manual mesh axes as the operands: lax.switch needs every case to
    return the same type, and a constant alone does not vary. The anchor is a sum over none of their elements."""
    anchor = sum(jnp.sum(x.reshape(-1)[:0].astype(_F32)) for x in operands)
    return jnp.full(shape, value, _F32) + anchor


def _forward_case(case, q, k, v, *, options):
    batch, len_q, heads, _ = q.shape
    part = (_filled((batch, len_q, heads, v.shape[-1]), 0.0, (q, k, v)),
            _filled((batch, heads, len_q), -jnp.inf, (q, k, v)))
    for call in case:
        out, lse = _block_forward(q[:, call.q_start:call.q_stop], k[:, call.k_start:call.k_stop],
                                  v[:, call.k_start:call.k_stop], call.window, options)
        lse = jnp.pad(lse, ((0, 0), (0, 0), (call.q_start, len_q - call.q_stop)), constant_values=-jnp.inf)
        part = _merge(part, (_pad_rows(out, call.q_start, len_q), lse))
    return part


def _backward_case(case, q, k, v, out, lse, d_out, d_lse, *, options):
    operands = (q, k, v, out, lse, d_out, d_lse)
    dq, dk, dv = (_filled(x.shape, 0.0, operands) for x in (q, k, v))
    for call in case:
        qs, ks = slice(call.q_start, call.q_stop), slice(call.k_start, call.k_stop)
        g_q, g_k, g_v = _block_grads(q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[..., qs], d_out[:, qs],
                                     d_lse[..., qs], call.window, options)
        dq = dq + _pad_rows(g_q, call.q_start, q.shape[1])
        dk, dv = dk + _pad_rows(g_k, call.k_start, k.shape[1]), dv + _pad_rows(g_v, call.k_start, k.shape[1])
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ the ring
def _shift(x, axis_name, ring_size):
    """Every device's x to the next device on the ring."""
    return lax.ppermute(x, axis_name, [(i, (i + 1) % ring_size) for i in range(ring_size)])


def _ring_forward(q, k, v, steps, axis_name, options):
    ring_size = len(steps)
    batch, len_q, heads, _ = q.shape
    result = (jnp.zeros((batch, len_q, heads, v.shape[-1]), _F32), jnp.full((batch, heads, len_q), -jnp.inf, _F32))
    block = (k, v)
    for t, step in enumerate(steps):
        # Sent before this step's compute, on which it does not depend: the transfer may overlap the kernels.
        following = _shift(block, axis_name, ring_size) if t + 1 < ring_size else None
        part = _run_step(step, functools.partial(_forward_case, options=options), axis_name, q, *block)
        result = _merge(result, part)
        block = following
    return result


def _ring_backward(residuals, cotangents, steps, axis_name, options):
    q, k, v, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = d_out.astype(q.dtype)  # what the backward kernels take, as from a single call
    ring_size = len(steps)
    dq = jnp.zeros(q.shape, _F32)
    # The barrier keeps XLA from merging these transfers with the forward's identical ones (CSE), which would keep
    # every block the forward received alive until the backward: the ring's memory would grow with its size.
    block, grads = lax.optimization_barrier((k, v)), (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    for t, step in enumerate(steps):
        following = _shift(block, axis_name, ring_size) if t + 1 < ring_size else None
        g_q, g_k, g_v = _run_step(step, functools.partial(_backward_case, options=options), axis_name, q, *block,
                                  out, lse, d_out, d_lse)
        dq = dq + g_q
        # dK/dV travel with their block; after the n-th pass they are back on the block's own device.
        grads = _shift((grads[0] + g_k, grads[1] + g_v), axis_name, ring_size)
        block = following
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, steps, axis_name, options):
    return _ring_forward(q, k, v, steps, axis_name, options)


def _ring_fwd(q, k, v, steps, axis_name, options):
    out, lse = _ring_forward(q, k, v, steps, axis_name, options)
    return (out, lse), (q, k, v, out.astype(q.dtype), lse)


def _ring_bwd(steps, axis_name, options, residuals, cotangents):
    return _ring_backward(residuals, cotangents, steps, axis_name, options)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------------------------------------ public API
def _ring_size(axis_name):
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(f"flashjax: ring_attention's axis_name {axis_name!r} is not a mesh axis bound here: call it "
                         "inside jax.shard_map over a mesh with that axis, with q, k and v split along their "
                         "sequence axis by it (docs/sharding.md)") from error


def ring_attention(q, k, v, *, axis_name, causal=False, window_size=(-1, -1), softmax_scale=None, sinks=None,
                   softcap=0.0, layout="contiguous", return_lse=False, deterministic=False, backend="auto"):
    """Attention over a sequence split along mesh axis `axis_name`, called inside jax.shard_map.

    Args:
      q: this device's queries [B, Lq, Hq, D]; the global query sequence is the n devices' pieces, n the size of
        the axis, Sq = n * Lq.
      k, v: this device's keys and values [B, Lk, Hk, D] / [B, Lk, Hk, Dv], Sk = n * Lk.
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      layout: "contiguous" (device i holds the i-th piece) or "zigzag" (the sequence cut into 2n chunks, device i
        holding chunks i and 2n-1-i: equal work per device under a causal mask; to_zigzag puts a sequence in that
        order, from_zigzag takes it back). Lq and Lk must be even for "zigzag".
      The other keywords are flash_attn's, with its semantics over the global sequences (the causal and window
      bands bottom-right aligned over Sq and Sk, sinks added once). backend="reference" differentiates the ring by
      autodiff (forward mode too); otherwise its backward is a ring of the backward kernels, and jax.jvp raises.

    Returns:
      out [B, Lq, Hq, Dv] for this device's queries, or (out, lse [B, Hq, Lq] float32) with return_lse=True.
    """
    call = api._dense_call(q, k, v, causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                           sinks=sinks, softcap=softcap, return_lse=return_lse, deterministic=deterministic,
                           backend=backend)
    if layout not in ring_plan.LAYOUTS:
        api._fail(ValueError, "layout", layout, f"one of {ring_plan.LAYOUTS}")
    if layout == "zigzag":
        for name, x in (("q", q), ("k", k)):
            if x.shape[1] % 2:
                api._fail(ValueError, f"{name}.shape[1]", x.shape[1],
                          "even with layout='zigzag' (each device holds two chunks of equal length)")
    steps = ring_plan.schedule(layout, _ring_size(axis_name), q.shape[1], k.shape[1], call.options.window)
    options = call.options
    if options.backend in AUTODIFF_BACKENDS:
        out, lse = _ring_forward(q, k, v, steps, axis_name, options)
    else:
        out, lse = _ring(q, k, v, steps, axis_name, options)
    if sinks is not None:
        out, lse = _add_sinks(out, lse, sinks)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def _zigzag_order(ring_size):
    return [chunk for i in range(ring_size) for chunk in (i, 2 * ring_size - 1 - i)]


def _reorder(x, ring_size, axis, order, name):
    if not isinstance(ring_size, int) or isinstance(ring_size, bool) or ring_size < 1:
        api._fail(ValueError, "ring_size", ring_size, "a positive int (the size of the ring's mesh axis)")
    length = x.shape[axis]
    if length % (2 * ring_size):
        api._fail(ValueError, f"{name}'s x.shape[{axis}]", length,
                  f"a multiple of 2 * ring_size = {2 * ring_size} (the zigzag layout cuts it into equal chunks)")

    def reorder(x):
        chunks = x.reshape(x.shape[:axis] + (2 * ring_size, length // (2 * ring_size)) + x.shape[axis + 1:])
        return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)

    return sharding.same_sharding(reorder, x)


def to_zigzag(x, ring_size: int, *, axis: int = 1):
    """A global sequence (along `axis`) in ring_attention's zigzag order for a ring of ring_size devices: cut into
    2 * ring_size chunks, device i's share (the i-th of ring_size equal pieces) being chunks i and 2n-1-i."""
    return _reorder(x, ring_size, axis, _zigzag_order(ring_size), "to_zigzag")


def from_zigzag(x, ring_size: int, *, axis: int = 1):
    """The inverse of to_zigzag: a zigzag-ordered sequence (e.g. ring_attention's output) in its natural order."""
    order = _zigzag_order(ring_size)
    return _reorder(x, ring_size, axis, [order.index(c) for c in range(2 * ring_size)], "from_zigzag")
