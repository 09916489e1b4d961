"""Varlen (packed sequences) on the kernels (docs/design.md §2.7): the forward and the backward on the newest family
whose kernels take packed sequences (sm90 on Hopper, csrc/kernels/sm90/{fwd,bwd}_varlen_*; the sm80 family elsewhere),
the tangent on the sm80 family's (csrc/kernels/sm80). Dispatch picks them; nothing here depends on which.

    fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks) -> (out [Tq, Hq, Dv], lse [Hq, Tq])
    tangent_varlen(q, k, v, cu_q, cu_k, seqused_q, seqused_k, sinks, out, lse; tq, tk, tv, ts) -> (t_out, t_lse)
        linear in (tq, tk, tv, ts)
    bwd_varlen(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks)
        -> (dq, dk, dv, dsinks)

With a mask mod (has_mask_bits=True) each primitive takes one more operand, last: the mod's bits over the N
sequences padded to the max_seqlen hints, uint32 [1 or N, 1 or Hq, max_seqlen_q, ceil(max_seqlen_k / 32)]
(flashjax.mask_bits with b the sequence and sequence-local indices; csrc/include/flashjax/mask_grid.h). The forward
and backward then call flashjax_fwd_varlen_mask_mod / flashjax_bwd_varlen_mask_mod (the sm80 kernels, with the tile
classes of the padded grid as workspace); the tangent is the reference's (no tangent kernel takes them).

q [Tq, Hq, D], k/v [Tk, Hk, D] at a compiled head width; the offsets are int32 [N + 1], seqused int32 [N] (zeros when
their flag is off: the CUDA lowering then leaves them out of the FFI call, as primitives.py does with sinks and
d_lse). The token counts and N are the only shapes: no compile depends on the packing. Operands are in the FFI
targets' order (flashjax_fwd_varlen, flashjax_bwd_varlen; the tangent's lowering reorders its own); the backward's
workspace exists only inside its lowering, sized by the library's plan (one slab per query head,
flashjax/workspace.h); so does the forward's tile counter where the plan walks at run time (the sm90 forward's
default, target flashjax_fwd_varlen_dynamic; FLASHJAX_SM90_VARLEN_WALK=0 or 1: a static walk, no counter).

Autodiff is primitives.py's scheme: fwd_varlen's JVP rule emits tangent_varlen (the sm80 tangent kernel,
flashjax_tangent_varlen) and its transpose runs bwd_varlen, so jax.grad runs the forward and backward kernels and
jax.jvp / jax.linearize the tangent kernel; bwd_varlen's JVP (jvp of grad) is the reference backward's. The lse
cotangent is left out of the backward's call when it is a symbolic zero (has_dlse). The packing is not a batch axis:
vmap is refused before these primitives (primitives.varlen_guard_p). Every primitive carries the max_seqlen hints,
which only the reference lowerings use (off CUDA: per sequence instead of all Tq x Tk pairs) and no FFI call sees.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from . import _ffi, primitives, reference

fwd_varlen_p = Primitive("flashjax_fwd_varlen")
tangent_varlen_p = Primitive("flashjax_tangent_varlen")
bwd_varlen_p = Primitive("flashjax_bwd_varlen")
for _p in (fwd_varlen_p, tangent_varlen_p, bwd_varlen_p):
    _p.multiple_results = True

_OPTIONAL = {5: "has_seqused_q", 6: "has_seqused_k", 7: "has_sinks"}  # operand position -> its flag
_BWD_OPTIONAL = {8: "has_seqused_q", 9: "has_seqused_k", 10: "has_dlse", 11: "has_sinks"}
# flashjax_tangent_varlen's operand order (q, k, v, out, lse, tq, tk, tv, the offsets, seqused_q, seqused_k, sinks,
# ts) as positions of the primitive's, and the optional ones among them.
_TANGENT_FFI_ORDER = (0, 1, 2, 8, 9, 10, 11, 12, 3, 4, 5, 6, 7, 13)
_TANGENT_OPTIONAL = {10: "has_seqused_q", 11: "has_seqused_k", 12: "has_sinks", 13: "has_sinks"}
_HINTS = ("max_seqlen_q", "max_seqlen_k")  # the reference lowerings' only: never FFI attributes
# The mask-mod targets' operand order: the bits right after the offsets, then the optional operands (positions of the
# primitive's operands, the bits last there), and the optional ones among them.
_FWD_MASK_FFI_ORDER = (0, 1, 2, 3, 4, 8, 5, 6, 7)
_FWD_MASK_OPTIONAL = {6: "has_seqused_q", 7: "has_seqused_k", 8: "has_sinks"}
_BWD_MASK_FFI_ORDER = (0, 1, 2, 3, 4, 5, 6, 7, 12, 8, 9, 10, 11)
_BWD_MASK_OPTIONAL = {9: "has_seqused_q", 10: "has_seqused_k", 11: "has_dlse", 12: "has_sinks"}
_N_PRIMALS = 8  # fwd_varlen's operands, which tangent_varlen's start with


def _abstract(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *_, **__):
    return (jax.core.ShapedArray(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.core.ShapedArray((q.shape[1], q.shape[0]), jnp.float32))


def _bwd_abstract(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks, *_,
                  **__):
    return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
            jax.core.ShapedArray(v.shape, v.dtype), jax.core.ShapedArray(sinks.shape, jnp.float32))


def _ffi_params(params):
    return {name: value for name, value in params.items() if name not in _HINTS}


def _plan(ctx, num_offsets, bits=None, *, softcap, window_left, window_right, has_sinks, **_):
    """The library's varlen plan of the call as lowered (the default GPU's, as the dense lowering asks it; the
    handlers check the buffers against their own). num_offsets: cu_seqlens_q's length, N + 1; bits: the mask bits'
    aval with a mask mod, whose padded grid sizes the tile classes."""
    q, k = ctx.avals_in[0], ctx.avals_in[1]
    device = _ffi.default_device()
    return _ffi.plan(dtype=jnp.dtype(q.dtype).name, batch=num_offsets - 1, seqlen_q=q.shape[0],
                     seqlen_k=k.shape[0], heads_q=q.shape[1], heads_k=k.shape[1], head_dim=q.shape[2],
                     window_left=window_left, window_right=window_right, softcap=float(softcap), has_sinks=has_sinks,
                     varlen=True, mask_mod=bits is not None,
                     mask_seqlen_q=0 if bits is None else bits.shape[2],
                     mask_seqlen_k=0 if bits is None else 32 * bits.shape[3],
                     device_sm=device[0] if device is not None else 0,
                     num_sms=device[1] if device is not None else 0)


def _cuda_lowering(ctx, *args, **params):
    """The forward's FFI call: with mask bits the mask-mod target (its tile classes as workspace); else the plain
    target, or where the plan hands tiles out at run time (the sm90 forward's default; FLASHJAX_SM90_VARLEN_WALK=0 or
    1 picks a static walk) the dynamic one with the counter its plan sizes as workspace."""
    if params.get("has_mask_bits"):
        plan = _plan(ctx, ctx.avals_in[3].shape[0], ctx.avals_in[8], **params)
        ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in _FWD_MASK_FFI_ORDER])
        return primitives._ffi_call(_ffi.FWD_VARLEN_MASK_MOD_TARGET, ctx, [args[i] for i in _FWD_MASK_FFI_ORDER],
                                    _FWD_MASK_OPTIONAL, _ffi_params(params),
                                    workspace=primitives._workspace_avals(plan["fwd"]["workspace"]))
    workspace = _plan(ctx, ctx.avals_in[3].shape[0], **params)["fwd"].get("workspace", [])
    if not workspace:
        return primitives._ffi_call(_ffi.FWD_VARLEN_TARGET, ctx, args, _OPTIONAL, _ffi_params(params))
    return primitives._ffi_call(_ffi.FWD_VARLEN_DYNAMIC_TARGET, ctx, args, _OPTIONAL, _ffi_params(params),
                                workspace=primitives._workspace_avals(workspace))


def _bwd_cuda_lowering(ctx, *args, **params):
    """The backward's FFI call with the workspace its plan sizes for these token counts and N (and, with a mask mod,
    the tile classes of the bits' padded grid)."""
    if not params.get("has_mask_bits"):
        plan = _plan(ctx, ctx.avals_in[6].shape[0], **params)
        return primitives._ffi_call(_ffi.BWD_VARLEN_TARGET, ctx, args, _BWD_OPTIONAL, _ffi_params(params),
                                    workspace=primitives._workspace_avals(plan["bwd"]["workspace"]))
    plan = _plan(ctx, ctx.avals_in[6].shape[0], ctx.avals_in[12], **params)
    ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in _BWD_MASK_FFI_ORDER])
    return primitives._ffi_call(_ffi.BWD_VARLEN_MASK_MOD_TARGET, ctx, [args[i] for i in _BWD_MASK_FFI_ORDER],
                                _BWD_MASK_OPTIONAL, _ffi_params(params),
                                workspace=primitives._workspace_avals(plan["bwd"]["workspace"]))


def _tangent_cuda_lowering(ctx, *args, **params):
    """The tangent's FFI call where the plan has a tangent kernel for the call; else the reference's tangent lowered
    in its place (as the dense tangent does), so that jax.jvp of a varlen call always runs."""
    bits = ctx.avals_in[14] if params.get("has_mask_bits") else None
    if _plan(ctx, ctx.avals_in[3].shape[0], bits, **params).get("tangent", {}).get("family") is None:
        return mlir.lower_fun(_reference_tangent, multiple_results=True)(ctx, *args, **params)
    ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in _TANGENT_FFI_ORDER])
    return primitives._ffi_call(_ffi.TANGENT_VARLEN_TARGET, ctx, [args[i] for i in _TANGENT_FFI_ORDER],
                                _TANGENT_OPTIONAL, _ffi_params(params))


def padded_bits_mask(bits):
    """The predicate the bits of a packed call hold, as reference.attention_varlen calls a mod (b the sequence,
    sequence-local indices): false past the padded grid's rows and words, where the kernels cut a sequence
    (flashjax/mask_grid.h); jnp indexing would clamp there instead."""
    rows, keys = bits.shape[2], 32 * bits.shape[3]

    def mod(b, h, q_idx, kv_idx):
        inside = (q_idx < rows) & (kv_idx < keys)
        return inside & primitives.unpack_mask_bits(bits, b, h, jnp.clip(q_idx, 0, max(rows - 1, 0)),
                                                    jnp.clip(kv_idx, 0, max(keys - 1, 0)))
    return mod


def _reference_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *mask_bits, softmax_scale,
                  softcap, window_left, window_right, has_seqused_q, has_seqused_k, has_sinks, max_seqlen_q=None,
                  max_seqlen_k=None, has_mask_bits=False):
    return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      seqused_q=seqused_q if has_seqused_q else None,
                                      seqused_k=seqused_k if has_seqused_k else None, softmax_scale=softmax_scale,
                                      causal=False, window_size=(window_left, window_right),
                                      sinks=sinks if has_sinks else None, softcap=softcap,
                                      mask_mod=padded_bits_mask(mask_bits[0]) if mask_bits else None,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _reference_tangent(q, k, v, cu_q, cu_k, used_q, used_k, sinks, out, lse, tq, tk, tv, ts, *mask_bits, **params):
    call = lambda q, k, v, sinks: _reference_fn(q, k, v, cu_q, cu_k, used_q, used_k, sinks, *mask_bits, **params)
    return jax.jvp(call, (q, k, v, sinks), (tq, tk, tv, ts))[1]


def _reference_bwd(q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, d_lse, sinks,
                   *mask_bits, has_dlse, **params):
    """The reference's VJP of the same call (it recomputes the forward; the kernel takes P from out and lse)."""
    call = lambda q, k, v, sinks: _reference_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks,
                                                *mask_bits, **params)
    _, vjp = jax.vjp(call, q, k, v, sinks)
    dq, dk, dv, dsinks = vjp((d_out, d_lse if has_dlse else jnp.zeros_like(lse)))
    return dq, dk, dv, dsinks if params["has_sinks"] else jnp.zeros_like(sinks)


for _p, _abstract_fn, _cuda, _ref in ((fwd_varlen_p, _abstract, _cuda_lowering, _reference_fn),
                                      (tangent_varlen_p, _abstract, _tangent_cuda_lowering, _reference_tangent),
                                      (bwd_varlen_p, _bwd_abstract, _bwd_cuda_lowering, _reference_bwd)):
    _p.def_impl(primitives._eager_impl(_p))
    _p.def_abstract_eval(_abstract_fn)
    mlir.register_lowering(_p, _cuda, platform="cuda")
    mlir.register_lowering(_p, mlir.lower_fun(_ref, multiple_results=True))
primitives._ATTR_TYPES.update(has_seqused_q=bool, has_seqused_k=bool)  # has_mask_bits picks the target instead


# ------------------------------------------------------------------------------------------------ autodiff
def _fwd_jvp(primals, tangents, **params):
    out, lse = fwd_varlen_p.bind(*primals, **params)
    tq, tk, tv, ts = (ad.instantiate_zeros(tangents[i]) for i in (0, 1, 2, 7))  # the offsets and bits have none
    t_out, t_lse = tangent_varlen_p.bind(*primals[:_N_PRIMALS], out, lse, tq, tk, tv, ts, *primals[_N_PRIMALS:],
                                         **params)
    return (out, lse), (t_out, t_lse)


def _tangent_transpose(cts, *operands, **params):
    residuals, linear = operands[:_N_PRIMALS + 2], operands[_N_PRIMALS + 2:_N_PRIMALS + 6]
    mask_bits = operands[_N_PRIMALS + 6:]  # integer data, like the offsets
    if any(ad.is_undefined_primal(r) for r in (*residuals, *mask_bits)):
        raise ValueError("flashjax: the varlen attention tangent is linear only in (tq, tk, tv, tsinks)")
    q, k, v, cu_q, cu_k, used_q, used_k, sinks, out, lse = residuals
    ct_out, ct_lse = cts
    if isinstance(ct_out, ad.Zero):
        ct_out = jnp.zeros(out.shape, out.dtype)
    has_dlse = not isinstance(ct_lse, ad.Zero)
    d_lse = ct_lse if has_dlse else jnp.zeros(lse.shape, jnp.float32)
    grads = bwd_varlen_p.bind(q, k, v, out, lse, ct_out, cu_q, cu_k, used_q, used_k, d_lse, sinks, *mask_bits,
                              has_dlse=has_dlse, **params)
    return ([None] * len(residuals) + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, linear)]
            + [None] * len(mask_bits))


_BWD_DIFFERENTIABLE = (0, 1, 2, 3, 4, 5, 10, 11)  # q, k, v, out, lse, d_out, d_lse, sinks (not offsets, bits)


def _bwd_jvp(primals, tangents, **params):
    """jvp of the backward (jvp of grad): the gradients are the backward kernel's, their tangent the JVP of the
    reference backward (as primitives._bwd_jvp does for the dense call), the offsets held fixed."""
    grads = bwd_varlen_p.bind(*primals, **params)

    def reference_bwd(*differentiable):
        operands = list(primals)
        for i, x in zip(_BWD_DIFFERENTIABLE, differentiable):
            operands[i] = x
        return _reference_bwd(*operands, **params)

    _, t_grads = jax.jvp(reference_bwd, tuple(primals[i] for i in _BWD_DIFFERENTIABLE),
                         tuple(ad.instantiate_zeros(tangents[i]) for i in _BWD_DIFFERENTIABLE))
    return grads, list(t_grads)


ad.primitive_jvps[fwd_varlen_p] = _fwd_jvp
ad.primitive_transposes[tangent_varlen_p] = _tangent_transpose
ad.primitive_jvps[bwd_varlen_p] = _bwd_jvp


def _offsets(x, n):
    return jnp.zeros((n,), jnp.int32) if x is None else x.astype(jnp.int32)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, *, softmax_scale, softcap,
              window_left, window_right, max_seqlen_q=None, max_seqlen_k=None, mask_bits=None):
    """The varlen call on the kernel path, at q's (already padded) width: (out, lse). The max_seqlen hints (ints or
    None) reach only the reference lowerings (off CUDA). mask_bits: a mask mod's bits over the padded sequences
    (the module docstring), or None."""
    n = cu_seqlens_q.shape[0] - 1
    sinks_arr = jnp.zeros((q.shape[1],), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    bits = () if mask_bits is None else (mask_bits,)
    return tuple(fwd_varlen_p.bind(
        q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32), _offsets(seqused_q, n),
        _offsets(seqused_k, n), sinks_arr, *bits, softmax_scale=softmax_scale, softcap=softcap,
        window_left=window_left, window_right=window_right, has_seqused_q=seqused_q is not None,
        has_seqused_k=seqused_k is not None, has_sinks=sinks is not None, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, has_mask_bits=bool(bits)))
