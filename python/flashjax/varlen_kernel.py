"""Varlen (packed sequences) on the kernels: the sm80 family's forward (csrc/kernels/sm80, docs/design.md §2.7).

    fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks) -> (out [Tq, Hq, Dv], lse [Hq, Tq])

q [Tq, Hq, D], k/v [Tk, Hk, D] at a compiled head width; the offsets are int32 [N + 1], seqused int32 [N] (zeros when
their flag is off: the CUDA lowering then leaves them out of the FFI call, as primitives.py does with sinks). The
token counts and N are the only shapes: no compile depends on the packing.

No backward kernel takes varlen yet, so gradients come from the reference's VJP of the same call (a jax.custom_vjp:
the forward's residuals are its inputs). That is the interim until the sm80 backward lands; it is the one place that
knows, and api.py's choice says so in its reason.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _ffi, primitives, reference

fwd_varlen_p = Primitive("flashjax_fwd_varlen")
fwd_varlen_p.multiple_results = True

_OPTIONAL = {5: "has_seqused_q", 6: "has_seqused_k", 7: "has_sinks"}  # operand position -> its flag


def _abstract(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, **_):
    return (jax.core.ShapedArray(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.core.ShapedArray((q.shape[1], q.shape[0]), jnp.float32))


def _cuda_lowering(ctx, *args, **params):
    return primitives._ffi_call(_ffi.FWD_VARLEN_TARGET, ctx, args, _OPTIONAL, params)


def _reference_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *, softmax_scale, softcap,
                  window_left, window_right, has_seqused_q, has_seqused_k, has_sinks, max_seqlen_q=None,
                  max_seqlen_k=None):
    return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      seqused_q=seqused_q if has_seqused_q else None,
                                      seqused_k=seqused_k if has_seqused_k else None, softmax_scale=softmax_scale,
                                      causal=False, window_size=(window_left, window_right),
                                      sinks=sinks if has_sinks else None, softcap=softcap, mask_mod=None,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


fwd_varlen_p.def_impl(primitives._eager_impl(fwd_varlen_p))
fwd_varlen_p.def_abstract_eval(_abstract)
mlir.register_lowering(fwd_varlen_p, _cuda_lowering, platform="cuda")
mlir.register_lowering(fwd_varlen_p, mlir.lower_fun(_reference_fn, multiple_results=True))
primitives._ATTR_TYPES.update(has_seqused_q=bool, has_seqused_k=bool)


def _offsets(x, n):
    return jnp.zeros((n,), jnp.int32) if x is None else x.astype(jnp.int32)


# params: the primitive's; hints: (max_seqlen_q, max_seqlen_k), which only the reference's gradients use (with both,
# it computes per sequence instead of over all Tq x Tk pairs).
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, params, hints):
    return tuple(fwd_varlen_p.bind(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, **dict(params)))


def _attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, params, hints):
    out = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, params, hints)
    return out, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks)


def _attention_bwd(params, hints, residuals, cotangents):
    q, k, v, cu_q, cu_k, used_q, used_k, sinks = residuals
    max_seqlen_q, max_seqlen_k = hints
    reference_call = lambda q, k, v, sinks: _reference_fn(q, k, v, cu_q, cu_k, used_q, used_k, sinks, **dict(params),
                                                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    _, vjp = jax.vjp(reference_call, q, k, v, sinks)
    dq, dk, dv, dsinks = vjp(cotangents)
    return dq, dk, dv, None, None, None, None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *, softmax_scale, softcap,
              window_left, window_right, max_seqlen_q=None, max_seqlen_k=None):
    """The varlen call on the kernel path, at q's (already padded) width: (out, lse). The max_seqlen hints (ints or
    None) reach only the reference's gradients."""
    n = cu_seqlens_q.shape[0] - 1
    has_sinks = sinks is not None
    params = (("softmax_scale", softmax_scale), ("softcap", softcap), ("window_left", window_left),
              ("window_right", window_right), ("has_seqused_q", seqused_q is not None),
              ("has_seqused_k", seqused_k is not None), ("has_sinks", has_sinks))
    sinks_arr = jnp.zeros((q.shape[1],), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return _attention(q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32),
                      _offsets(seqused_q, n), _offsets(seqused_k, n), sinks_arr, params, (max_seqlen_q, max_seqlen_k))
