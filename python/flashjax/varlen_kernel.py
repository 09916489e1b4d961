"""Varlen (packed sequences) on the kernels (docs/design.md §2.7): the forward on the newest family whose forward takes
packed sequences (sm90 on Hopper, csrc/kernels/sm90/fwd_varlen_*; the sm80 family elsewhere), the backward on the
sm80 family's (csrc/kernels/sm80). Dispatch picks them; nothing here depends on which.

    fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks) -> (out [Tq, Hq, Dv], lse [Hq, Tq])
    bwd_varlen(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks)
        -> (dq, dk, dv, dsinks)

q [Tq, Hq, D], k/v [Tk, Hk, D] at a compiled head width; the offsets are int32 [N + 1], seqused int32 [N] (zeros when
their flag is off: the CUDA lowering then leaves them out of the FFI call, as primitives.py does with sinks and
d_lse). The token counts and N are the only shapes: no compile depends on the packing. Operands are in the FFI
targets' order (flashjax_fwd_varlen, flashjax_bwd_varlen); the backward's workspace exists only inside its lowering,
sized by the library's plan (one slab per query head, flashjax/workspace.h).

The gradients are a jax.custom_vjp whose backward binds bwd_varlen (the packing is not a batch axis, so varlen has
no vmap or forward-mode rules to keep; primitives.py's fwd / tangent / bwd are the dense path's). The lse cotangent
is left out of the call when it is a symbolic zero (has_dlse), as the dense path does. Off CUDA both primitives lower
to the reference: bwd_varlen to the reference's VJP of the same call, with the max_seqlen hints.
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
bwd_varlen_p = Primitive("flashjax_bwd_varlen")
bwd_varlen_p.multiple_results = True

_OPTIONAL = {5: "has_seqused_q", 6: "has_seqused_k", 7: "has_sinks"}  # operand position -> its flag
_BWD_OPTIONAL = {8: "has_seqused_q", 9: "has_seqused_k", 10: "has_dlse", 11: "has_sinks"}
_HINTS = ("max_seqlen_q", "max_seqlen_k")  # bwd_varlen's reference lowering only: never FFI attributes


def _abstract(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, **_):
    return (jax.core.ShapedArray(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.core.ShapedArray((q.shape[1], q.shape[0]), jnp.float32))


def _bwd_abstract(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks, **_):
    return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
            jax.core.ShapedArray(v.shape, v.dtype), jax.core.ShapedArray(sinks.shape, jnp.float32))


def _cuda_lowering(ctx, *args, **params):
    return primitives._ffi_call(_ffi.FWD_VARLEN_TARGET, ctx, args, _OPTIONAL, params)


def _bwd_cuda_lowering(ctx, *args, softmax_scale, softcap, window_left, window_right, has_sinks, **params):
    """The backward's FFI call with the workspace its plan sizes for these token counts and N (the default GPU's plan,
    as the dense lowering asks it; the handler checks the buffers against its own)."""
    q, k = ctx.avals_in[0], ctx.avals_in[1]
    device = _ffi.default_device()
    plan = _ffi.plan(dtype=jnp.dtype(q.dtype).name, batch=ctx.avals_in[6].shape[0] - 1, seqlen_q=q.shape[0],
                     seqlen_k=k.shape[0], heads_q=q.shape[1], heads_k=k.shape[1], head_dim=q.shape[2],
                     window_left=window_left, window_right=window_right, softcap=float(softcap), has_sinks=has_sinks,
                     varlen=True, device_sm=device[0] if device is not None else 0,
                     num_sms=device[1] if device is not None else 0)
    attrs = dict(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left, window_right=window_right,
                 has_sinks=has_sinks, **{name: value for name, value in params.items() if name not in _HINTS})
    return primitives._ffi_call(_ffi.BWD_VARLEN_TARGET, ctx, args, _BWD_OPTIONAL, attrs,
                                workspace=primitives._workspace_avals(plan["bwd"]["workspace"]))


def _reference_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *, softmax_scale, softcap,
                  window_left, window_right, has_seqused_q, has_seqused_k, has_sinks, max_seqlen_q=None,
                  max_seqlen_k=None):
    return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      seqused_q=seqused_q if has_seqused_q else None,
                                      seqused_k=seqused_k if has_seqused_k else None, softmax_scale=softmax_scale,
                                      causal=False, window_size=(window_left, window_right),
                                      sinks=sinks if has_sinks else None, softcap=softcap, mask_mod=None,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _reference_bwd(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks, *,
                   has_dlse, **params):
    """The reference's VJP of the same call (it recomputes the forward; the kernel takes P from out and lse)."""
    call = lambda q, k, v, sinks: _reference_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks,
                                                **params)
    _, vjp = jax.vjp(call, q, k, v, sinks)
    dq, dk, dv, dsinks = vjp((d_out, d_lse if has_dlse else jnp.zeros_like(lse)))
    return dq, dk, dv, dsinks if params["has_sinks"] else jnp.zeros_like(sinks)


fwd_varlen_p.def_impl(primitives._eager_impl(fwd_varlen_p))
fwd_varlen_p.def_abstract_eval(_abstract)
mlir.register_lowering(fwd_varlen_p, _cuda_lowering, platform="cuda")
mlir.register_lowering(fwd_varlen_p, mlir.lower_fun(_reference_fn, multiple_results=True))
bwd_varlen_p.def_impl(primitives._eager_impl(bwd_varlen_p))
bwd_varlen_p.def_abstract_eval(_bwd_abstract)
mlir.register_lowering(bwd_varlen_p, _bwd_cuda_lowering, platform="cuda")
mlir.register_lowering(bwd_varlen_p, mlir.lower_fun(_reference_bwd, multiple_results=True))
primitives._ATTR_TYPES.update(has_seqused_q=bool, has_seqused_k=bool)


def _offsets(x, n):
    return jnp.zeros((n,), jnp.int32) if x is None else x.astype(jnp.int32)


# params: the primitives' static parameters; hints: (max_seqlen_q, max_seqlen_k), which only the reference lowering
# of the backward uses (with both, it computes per sequence instead of over all Tq x Tk pairs).
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, params, hints):
    return tuple(fwd_varlen_p.bind(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, **dict(params)))


def _attention_fwd(*primals):
    # symbolic_zeros: the differentiable primals arrive as CustomVJPPrimal (value, perturbed); params and hints
    # (nondiff_argnums) as they are.
    q, k, v, cu_q, cu_k, used_q, used_k, sinks = (getattr(p, "value", p) for p in primals[:8])
    params = primals[8]
    out, lse = fwd_varlen_p.bind(q, k, v, cu_q, cu_k, used_q, used_k, sinks, **dict(params))
    return (out, lse), (q, k, v, cu_q, cu_k, used_q, used_k, sinks, out, lse)


def _is_zero(cotangent):
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _attention_bwd(params, hints, residuals, cotangents):
    q, k, v, cu_q, cu_k, used_q, used_k, sinks, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = jnp.zeros(out.shape, out.dtype) if _is_zero(d_out) else d_out
    has_dlse = not _is_zero(d_lse)
    d_lse = d_lse if has_dlse else jnp.zeros(lse.shape, jnp.float32)
    max_seqlen_q, max_seqlen_k = hints
    dq, dk, dv, dsinks = bwd_varlen_p.bind(q, k, v, out, lse, d_out, cu_q, cu_k, used_q, used_k, d_lse, sinks,
                                           has_dlse=has_dlse, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                           **dict(params))
    return dq, dk, dv, None, None, None, None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *, softmax_scale, softcap,
              window_left, window_right, max_seqlen_q=None, max_seqlen_k=None):
    """The varlen call on the kernel path, at q's (already padded) width: (out, lse). The max_seqlen hints (ints or
    None) reach only the backward's reference lowering (off CUDA)."""
    n = cu_seqlens_q.shape[0] - 1
    has_sinks = sinks is not None
    params = (("softmax_scale", softmax_scale), ("softcap", softcap), ("window_left", window_left),
              ("window_right", window_right), ("has_seqused_q", seqused_q is not None),
              ("has_seqused_k", seqused_k is not None), ("has_sinks", has_sinks))
    sinks_arr = jnp.zeros((q.shape[1],), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return _attention(q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32),
                      _offsets(seqused_q, n), _offsets(seqused_k, n), sinks_arr, params, (max_seqlen_q, max_seqlen_k))
