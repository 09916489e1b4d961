"""JAX primitives for the kernel path (docs/design.md §2.8 and §3).

    fwd(q, k, v, sinks[, mask_bits])                               -> (out, lse)
    tangent(q, k, v, sinks, out, lse; tq, tk, tv, ts[, mask_bits]) -> (t_out, t_lse)   linear in (tq, tk, tv, ts)
    bwd(q, k, v, out, lse, d_out, d_lse, sinks[, mask_bits])       -> (dq, dk, dv, dsinks)
    jvp(q, k, v, sinks, tq, tk, tv, ts)                            -> (out, lse, t_out, t_lse)   fwd and tangent fused

mask_bits (has_mask_bits=True): a mask mod's packed bits (flashjax.mask_bits; uint32 [Bm, Hm, Sq, ceil(Sk / 32)],
docs/design.md §2.6), computed once by the forward's caller and carried to the tangent and the backward as a residual.
The kernels AND them with the band (the flashjax_*_mask_mod targets); the reference lowerings unpack them
(`unpack_mask_bits`). They are integer data: never differentiated.

fwd's JVP rule emits `jvp` (calls without mask bits where fused_jvp_enabled) or `fwd` then `tangent`; tangent's
transpose rule runs `bwd`. `jvp` is the fused pass of plain jax.jvp (flashjax_jvp: out, lse and their tangents in one
kernel, S computed once; where the plan has no fused kernel for the call it lowers to the fwd + tangent pair). It
exists only where all four outputs are wanted at once: its partial-evaluation rule splits it back into a known `fwd`
and an unknown `tangent` whenever the tangent inputs are unknown (jax.linearize, jax.grad, which then transpose
`tangent` as before), so that the primal stays known. jax.grad therefore runs the forward and
backward kernels only, and jax.jvp evaluates `tangent` (the fused tangent kernel, flashjax_tangent: sm90 on Hopper,
sm80 elsewhere, where the plan has one for the call; with mask bits flashjax_tangent_mask_mod; the reference's
tangent otherwise). bwd's JVP rule (jvp of grad:
forward-over-reverse) takes the primal from the backward kernel and the tangent from the reference backward's JVP. Not
jax.custom_vjp, which would forbid forward mode. Inputs reach these primitives already validated
and padded to a compiled head width (api.py); `sinks` is always an f32 [Hq] array, zeros when has_sinks is False
(the CUDA lowering then leaves it out of the FFI call, as it does bwd's dlse when has_dlse is False). The
workspace of a kernel (the split forward's parts, the backward's accumulators) exists only inside the CUDA lowering,
sized by the library's plan of the call: autodiff, vmap and the reference lowering never see it.

Each primitive lowers through sharding.py's partitioning policy (batch and heads split over a mesh, no communication)
into a local twin (`*_local_p`) that each device runs: the FFI call on CUDA, the reference elsewhere. On one device the
twin is the whole call.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax._src.interpreters import partial_eval as pe  # custom_partial_eval_rules: no public spelling (jax 0.11)
from jax.interpreters import ad, batching, mlir

from . import _ffi, sharding

# Static parameters every primitive carries; they become FFI attributes of the exact C++ types. `deterministic` is a
# parameter too, but it picks the backward's FFI target instead of travelling as an attribute.
_ATTR_TYPES = {"softmax_scale": np.float32, "softcap": np.float32, "window_left": np.int32,
               "window_right": np.int32, "has_sinks": bool, "has_dlse": bool}
_TARGET_PARAMS = ("deterministic", "has_mask_bits")  # they pick the FFI target instead
# Where the optional mask bits sit among each primitive's operands (after the fixed ones).
MASK_BITS_INDEX = {"fwd": 4, "tangent": 10, "bwd": 8}

fwd_p = Primitive("flashjax_fwd")
tangent_p = Primitive("flashjax_tangent")
bwd_p = Primitive("flashjax_bwd")
jvp_p = Primitive("flashjax_jvp")
# What one device runs of each: the four above are partitioned into these when lowered (sharding.register below).
fwd_local_p = Primitive("flashjax_fwd_local")
tangent_local_p = Primitive("flashjax_tangent_local")
bwd_local_p = Primitive("flashjax_bwd_local")
jvp_local_p = Primitive("flashjax_jvp_local")
# Identity on its operands whose batching rule refuses vmap: varlen calls pass their arrays through it.
varlen_guard_p = Primitive("flashjax_varlen_guard")
for _p in (fwd_p, tangent_p, bwd_p, jvp_p, fwd_local_p, tangent_local_p, bwd_local_p, jvp_local_p, varlen_guard_p):
    _p.multiple_results = True


# ----------------------------------------------------------------------------------------------- abstract eval
def _out_avals(q, v):
    batch, seqlen_q, heads_q, _ = q.shape
    return (jax.core.ShapedArray(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.core.ShapedArray((batch, heads_q, seqlen_q), jnp.float32))


def _fwd_abstract(q, k, v, sinks, *mask_bits, **_):
    return _out_avals(q, v)


def _tangent_abstract(q, k, v, sinks, out, lse, tq, tk, tv, ts, *mask_bits, **_):
    return _out_avals(q, v)


def _jvp_abstract(q, k, v, sinks, tq, tk, tv, ts, **_):
    return _out_avals(q, v) * 2


def _bwd_abstract(q, k, v, out, lse, dout, dlse, sinks, *mask_bits, **_):
    return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
            jax.core.ShapedArray(v.shape, v.dtype), jax.core.ShapedArray(sinks.shape, jnp.float32))


def _eager_impl(prim):
    # Eager (outside jit) evaluation compiles the single primitive, like any jax.lax operation.
    def impl(*args, **params):
        return jax.jit(functools.partial(prim.bind, **params))(*args)
    return impl


for _p in (fwd_p, tangent_p, bwd_p, jvp_p, varlen_guard_p):
    _p.def_impl(_eager_impl(_p))
for _p, _local in ((fwd_p, fwd_local_p), (tangent_p, tangent_local_p), (bwd_p, bwd_local_p), (jvp_p, jvp_local_p)):
    _abstract = {fwd_p: _fwd_abstract, tangent_p: _tangent_abstract, bwd_p: _bwd_abstract, jvp_p: _jvp_abstract}[_p]
    _p.def_abstract_eval(_abstract)
    _local.def_abstract_eval(_abstract)
varlen_guard_p.def_abstract_eval(lambda *xs: xs)


# ---------------------------------------------------------------------------------------------------- lowering
def _attrs(params):
    return {name: _ATTR_TYPES[name](value) for name, value in params.items() if name not in _TARGET_PARAMS}


def lowering_plan(aval_q, aval_k, *, softcap, window_left, window_right, has_sinks, deterministic=False,
                  has_mask_bits=False, device_sm=None, **_) -> dict:
    """The library's plan of a call as lowered (q at the compiled head width): for the default GPU, with its SM
    count, which is what the split-keys rule needs. device_sm: another GPU to ask about (explain's); the SM count
    stays the default device's (0 off a GPU: no call splits by rule)."""
    device = _ffi.default_device()
    batch, seqlen_q, heads_q, head_dim = aval_q.shape
    return _ffi.plan(dtype=jnp.dtype(aval_q.dtype).name, batch=batch, seqlen_q=seqlen_q, seqlen_k=aval_k.shape[1],
                     heads_q=heads_q, heads_k=aval_k.shape[2], head_dim=head_dim, window_left=window_left,
                     window_right=window_right, softcap=float(softcap), has_sinks=has_sinks,
                     deterministic=deterministic, mask_mod=has_mask_bits,
                     device_sm=device_sm or (device[0] if device is not None else 0),
                     num_sms=device[1] if device is not None else 0)


def _workspace_avals(workspace):
    return [jax.core.ShapedArray(tuple(buffer["shape"]), jnp.dtype(buffer["dtype"]))
            for buffer in workspace]


def _ffi_call(target, ctx, args, optional, params, workspace=(), **extra):
    """The FFI call; `optional` maps operand positions to the has_* flag that says whether the kernel reads them.

    An operand whose flag is off is left out of the call (the handler finds the optional ones after the required
    ones, in order) rather than passed as the zero array the primitive carries: XLA would run a kernel of its own
    to fill that array before every call, and it would sit between back-to-back attention kernels. The workspace
    buffers are extra results of the call, dropped from the primitive's.
    """
    _ffi.register_targets()
    keep = [i for i in range(len(args)) if i not in optional or params[optional[i]]]
    n_out = len(ctx.avals_out)
    ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in keep], avals_out=[*ctx.avals_out, *workspace])
    results = jax.ffi.ffi_lowering(target)(ctx, *(args[i] for i in keep), **extra, **_attrs(params))
    return results[:n_out]


def _fwd_lowering(ctx, *args, **params):
    """The forward's FFI call; where the plan splits keys, the split target with its two workspace outputs
    (fwd_split_workspace_layout in csrc/include/flashjax/workspace.h). The split count is decided here, when the call
    is lowered, from its shapes and the default GPU's SM count: XLA allocates the workspace, so its size must be
    known now. The kernel takes the count as given, so the result is right on any device; only its speed depends on
    the guess."""
    fwd = lowering_plan(ctx.avals_in[0], ctx.avals_in[1], **params)["fwd"]
    if params.get("has_mask_bits"):
        # flashjax_fwd_mask_mod: q, k, v, the bits, then sinks; the tile-class workspace (mask-mod forwards never split).
        order = (0, 1, 2, 4, 3)
        ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in order])
        return _ffi_call(_ffi.FWD_MASK_MOD_TARGET, ctx, [args[i] for i in order], {4: "has_sinks"}, params,
                         workspace=_workspace_avals(fwd["workspace"]))
    if fwd["num_splits"] <= 1:
        return _ffi_call(_ffi.FWD_TARGET, ctx, args, {3: "has_sinks"}, params)
    return _ffi_call(_ffi.FWD_SPLIT_TARGET, ctx, args, {3: "has_sinks"}, params,
                     workspace=_workspace_avals(fwd["workspace"]), num_splits=np.int32(fwd["num_splits"]))


def _bwd_lowering(ctx, *args, **params):
    """The backward's FFI call, with the workspace its plan sizes (dq accumulator, per-row statistics); with
    deterministic=True the deterministic target, whose extra workspace holds the counters that order the dq sums."""
    bwd = lowering_plan(ctx.avals_in[0], ctx.avals_in[1], **params)["bwd"]
    if params.get("has_mask_bits"):
        # flashjax_bwd_mask_mod: the required operands, the bits, then dlse and sinks; the f32 workspace and the tile
        # classes (deterministic=True: its twin, with the dq counters between the two, as the plan lists them).
        order = (0, 1, 2, 3, 4, 5, 8, 6, 7)
        ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in order])
        target = _ffi.BWD_MASK_MOD_DETERMINISTIC_TARGET if params.get("deterministic") else _ffi.BWD_MASK_MOD_TARGET
        return _ffi_call(target, ctx, [args[i] for i in order], {7: "has_dlse", 8: "has_sinks"},
                         params, workspace=_workspace_avals(bwd["workspace"]))
    target = _ffi.BWD_DETERMINISTIC_TARGET if params.get("deterministic") else _ffi.BWD_TARGET
    return _ffi_call(target, ctx, args, {6: "has_dlse", 7: "has_sinks"}, params,
                     workspace=_workspace_avals(bwd["workspace"]))


# The FFI operand order of the tangent target: the required operands first, then the optional (sinks, tsinks).
_TANGENT_FFI_ORDER = (0, 1, 2, 4, 5, 6, 7, 8, 3, 9)  # q, k, v, out, lse, tq, tk, tv, sinks, ts
# The mask-mod tangent target's: the mask bits after the required operands, then the optional.
_TANGENT_MASK_MOD_FFI_ORDER = (0, 1, 2, 4, 5, 6, 7, 8, 10, 3, 9)  # ..., tv, mask_bits, sinks, ts


def _tangent_lowering(ctx, *args, **params):
    """The tangent's FFI call (flashjax_tangent: the sm90 or sm80 tangent kernel, design §3.6-3.7) where the plan has
    a tangent kernel for the call; else the reference's tangent, lowered in its place, so that jax.jvp of a kernel call
    always runs (the primal and the reverse mode stay on their kernels either way). With a mask mod's bits,
    flashjax_tangent_mask_mod, whose extra result is the tile-class workspace the plan sizes for the tangent kernel's
    own tiles."""
    plan = lowering_plan(ctx.avals_in[0], ctx.avals_in[1], **params)
    tangent = plan.get("tangent", {})
    if tangent.get("family") is None:
        return mlir.lower_fun(_reference_tangent, multiple_results=True)(ctx, *args, **params)
    if params.get("has_mask_bits"):
        order = _TANGENT_MASK_MOD_FFI_ORDER
        ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in order])
        return _ffi_call(_ffi.TANGENT_MASK_MOD_TARGET, ctx, [args[i] for i in order],
                         {9: "has_sinks", 10: "has_sinks"}, params, workspace=_workspace_avals(tangent["workspace"]))
    ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in _TANGENT_FFI_ORDER])
    return _ffi_call(_ffi.TANGENT_TARGET, ctx, [args[i] for i in _TANGENT_FFI_ORDER], {8: "has_sinks", 9: "has_sinks"},
                     params)


def _jvp_composed(q, k, v, sinks, tq, tk, tv, ts, **params):
    """What the fused pass computes, as the forward then the tangent: jvp_p's meaning wherever no fused kernel runs."""
    out, lse = fwd_local_p.bind(q, k, v, sinks, **params)
    t_out, t_lse = tangent_local_p.bind(q, k, v, sinks, out, lse, tq, tk, tv, ts, **params)
    return out, lse, t_out, t_lse


# The FFI operand order of the fused target: the required operands first, then the optional (sinks, tsinks).
_JVP_FFI_ORDER = (0, 1, 2, 4, 5, 6, 3, 7)  # q, k, v, tq, tk, tv, sinks, ts


def _jvp_lowering(ctx, *args, **params):
    """The fused pass's FFI call (flashjax_jvp: the sm90 fused jvp kernel, D <= 128, dense) where the plan has one
    for the call; else the forward and the tangent, each lowered as its own primitive is (their kernels, or the
    reference's tangent)."""
    plan = lowering_plan(ctx.avals_in[0], ctx.avals_in[1], **params)
    if plan.get("jvp", {}).get("family") is None:
        return mlir.lower_fun(_jvp_composed, multiple_results=True)(ctx, *args, **params)
    ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in _JVP_FFI_ORDER])
    return _ffi_call(_ffi.JVP_TARGET, ctx, [args[i] for i in _JVP_FFI_ORDER], {6: "has_sinks", 7: "has_sinks"}, params)


mlir.register_lowering(fwd_local_p, _fwd_lowering, platform="cuda")
mlir.register_lowering(bwd_local_p, _bwd_lowering, platform="cuda")
mlir.register_lowering(tangent_local_p, _tangent_lowering, platform="cuda")
mlir.register_lowering(jvp_local_p, _jvp_lowering, platform="cuda")
sharding.register(fwd_p, "fwd", fwd_local_p.bind)
sharding.register(tangent_p, "tangent", tangent_local_p.bind)
sharding.register(bwd_p, "bwd", bwd_local_p.bind)
sharding.register(jvp_p, "jvp", jvp_local_p.bind)
mlir.register_lowering(varlen_guard_p, lambda ctx, *xs: xs)


# ------------------------------------------------------------------------------------------------ autodiff
# The widest head dim whose fused pass measured faster than the forward + tangent pair it replaces (H100, same process:
# the jvp 12-16% faster at D 64, 1-2% slower at D 128, whose 32-key steps the registers impose:
# docs/performance.md 2.8). Wider calls fuse only where FLASHJAX_FUSED_JVP=1 asks.
_FUSED_JVP_DEFAULT_MAX_HEAD_DIM = 64


def fused_jvp_enabled(head_dim: int) -> bool:
    """Whether fwd's JVP rule binds the fused pass for this head dim (FLASHJAX_FUSED_JVP, read at trace time): "0"
    never, "1" wherever a fused kernel exists, unset where it is the faster (D <= 64). Otherwise jax.jvp runs the
    forward and then the tangent pass."""
    setting = os.environ.get("FLASHJAX_FUSED_JVP", "")
    if setting in ("0", "1"):
        return setting == "1"
    return head_dim <= _FUSED_JVP_DEFAULT_MAX_HEAD_DIM


def _forward_then_tangent(q, k, v, sinks, tq, tk, tv, ts, *mask_bits, **params):
    """(out, lse, t_out, t_lse) as the forward and then the tangent pass: what the fused pass replaces."""
    out, lse = fwd_p.bind(q, k, v, sinks, *mask_bits, **params)
    t_out, t_lse = tangent_p.bind(q, k, v, sinks, out, lse, tq, tk, tv, ts, *mask_bits, **params)
    return out, lse, t_out, t_lse


def _fwd_jvp(primals, tangents, **params):
    q, k, v, sinks, *mask_bits = primals
    tq, tk, tv, ts = (ad.instantiate_zeros(t) for t in tangents[:4])
    fuse = not mask_bits and fused_jvp_enabled(q.shape[-1])
    out, lse, t_out, t_lse = (jvp_p.bind(q, k, v, sinks, tq, tk, tv, ts, **params) if fuse
                              else _forward_then_tangent(q, k, v, sinks, tq, tk, tv, ts, *mask_bits, **params))
    return (out, lse), (t_out, t_lse)


def _jvp_partial_eval(trace, *tracers, **params):
    """jvp_p under partial evaluation (jax.linearize, jax.grad: fwd's JVP rule traced with unknown tangents). Known
    inputs: the fused pass itself. Otherwise the pair it fuses, each partially evaluated on its own, so that the
    forward stays known wherever its inputs are (a fused primitive with unknown tangents would make out and lse unknown
    too) and the unknown tangent is the `tangent` primitive the transpose rule knows."""
    if all(t.pval.is_known() for t in tracers):
        return trace.default_process_primitive(jvp_p, tracers, params)
    q, k, v, sinks, tq, tk, tv, ts = tracers
    out, lse = trace.default_process_primitive(fwd_p, (q, k, v, sinks), params)
    t_out, t_lse = trace.default_process_primitive(tangent_p, (q, k, v, sinks, out, lse, tq, tk, tv, ts), params)
    return [out, lse, t_out, t_lse]


def _jvp_jvp(primals, tangents, **params):
    """jvp of the fused pass (jvp of jvp): that of the pair it fuses."""
    pair = functools.partial(_forward_then_tangent, **params)
    outs, t_outs = jax.jvp(pair, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))
    return outs, list(t_outs)


def _tangent_transpose(cts, q, k, v, sinks, out, lse, tq, tk, tv, ts, *mask_bits, **params):
    for residual in (q, k, v, sinks, out, lse, *mask_bits):
        if ad.is_undefined_primal(residual):
            raise ValueError("flashjax: the attention tangent is linear only in (tq, tk, tv, tsinks)")
    ct_out, ct_lse = cts
    if isinstance(ct_out, ad.Zero):
        ct_out = jnp.zeros(out.shape, out.dtype)
    has_dlse = not isinstance(ct_lse, ad.Zero)
    dlse = ct_lse if has_dlse else jnp.zeros(lse.shape, jnp.float32)
    dq, dk, dv, dsinks = backward(q, k, v, out, lse, ct_out, dlse, sinks, *mask_bits, has_dlse=has_dlse, **params)
    linear = (tq, tk, tv, ts)
    grads = (dq, dk, dv, dsinks)
    return ([None] * 6 + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, linear)]
            + [None] * len(mask_bits))


def _guard_jvp(primals, tangents):
    # The identity is its own tangent map; only the primal needs guarding against vmap.
    return varlen_guard_p.bind(*primals), list(tangents)


def _bwd_jvp(primals, tangents, **params):
    """jvp of the backward (jax.jvp of jax.grad: forward-over-reverse Hessian-vector products). The gradients are the
    backward kernel's; their tangent is the JVP of the reference backward (reference.attention_vjp, the kernels'
    contract on given out and lse), evaluated by XLA: no second-order kernel exists. The tangents of out and lse that
    reach it come from the tangent kernel (fwd's JVP rule)."""
    grads = bwd_p.bind(*primals, **params)
    primals, mask_bits = tuple(primals[:8]), tuple(primals[8:])  # the bits: integer data, no tangent
    tangents = [ad.instantiate_zeros(t) for t in tangents[:8]]
    _, t_grads = jax.jvp(lambda *p: _reference_bwd(*p, *mask_bits, **params), primals, tuple(tangents))
    return grads, list(t_grads)


ad.primitive_jvps[fwd_p] = _fwd_jvp
ad.primitive_jvps[bwd_p] = _bwd_jvp
ad.primitive_jvps[jvp_p] = _jvp_jvp
pe.custom_partial_eval_rules[jvp_p] = _jvp_partial_eval
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[varlen_guard_p] = _guard_jvp


def backward(q, k, v, out, lse, dout, dlse, sinks, *mask_bits, has_dlse, **params):
    return tuple(bwd_p.bind(q, k, v, out, lse, dout, dlse, sinks, *mask_bits, has_dlse=has_dlse, **params))


# ------------------------------------------------------------------------------------------------ batching
def _fold_mask_bits(bits, dim, size, batch):
    """Mask bits [Bm, Hm, Sq, Wk] for the folded batch (size * batch): bits that broadcast over the batch and are not
    mapped stay as they are; per-batch ones repeat for every mapped index (folded index i * batch + b reads bits[b]);
    mapped ones take their example's bits, broadcast over its batch first where they broadcast."""
    if dim is None:
        return bits if bits.shape[0] == 1 else jnp.tile(bits, (size, 1, 1, 1))
    bits = batching.bdim_at_front(bits, dim, size)
    bits = jnp.broadcast_to(bits, (size, batch) + bits.shape[2:])
    return bits.reshape((size * batch,) + bits.shape[2:])


def _batching_rule(prim, per_head_args, mask_index):
    """vmap folds the mapped axis into the batch axis (a free reshape of the leading axes).

    Per-head operands ([Hq] sinks and their tangents) cannot be folded; when one of them is mapped, or when the
    backward must return per-example dsinks, the primitive runs once per mapped index under lax.map instead. Mask
    bits (operand mask_index, when given) fold by _fold_mask_bits.
    """

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        per_example = any(dims[i] is not None for i in per_head_args) or (
            prim is bwd_p and params["has_sinks"])
        if per_example:
            mapped = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
            outs = jax.lax.map(lambda xs: prim.bind(*xs, **params), mapped)
            return outs, [0] * len(outs)
        folded = []
        q_shape = [n for axis, n in enumerate(args[0].shape) if axis != dims[0]]  # q without the mapped axis
        batch = q_shape[0]
        for i, (a, d) in enumerate(zip(args, dims)):
            if i in per_head_args:
                folded.append(a)
                continue
            if i == mask_index:
                folded.append(_fold_mask_bits(a, d, size, batch))
                continue
            a = batching.bdim_at_front(a, d, size)
            folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        outs = prim.bind(*folded, **params)
        unfolded, out_dims = [], []
        for o in outs:
            if prim is bwd_p and o.ndim == 1:  # dsinks: zeros when has_sinks is False, the same for every example
                unfolded.append(o)
                out_dims.append(None)  # not mapped
            else:
                unfolded.append(o.reshape((size, o.shape[0] // size) + o.shape[1:]))
                out_dims.append(0)
        return unfolded, out_dims

    return rule


def _guard_batching(args, dims):
    raise ValueError("flashjax: jax.vmap over flash_attn_varlen is not supported: the packing is the batch "
                     "(concatenate the sequences and extend cu_seqlens instead)")


batching.primitive_batchers[fwd_p] = _batching_rule(fwd_p, per_head_args=(3,), mask_index=MASK_BITS_INDEX["fwd"])
_tangent_batching = _batching_rule(tangent_p, per_head_args=(3, 9), mask_index=MASK_BITS_INDEX["tangent"])
batching.primitive_batchers[tangent_p] = _tangent_batching
batching.primitive_batchers[bwd_p] = _batching_rule(bwd_p, per_head_args=(7,), mask_index=MASK_BITS_INDEX["bwd"])
_fused_jvp_batching = _batching_rule(jvp_p, per_head_args=(3, 7), mask_index=None)


def _jvp_batching(args, dims, **params):
    """vmap of the fused pass. Where only the tangents are mapped (jax.jacfwd pushes a batch of tangents through one
    primal) the primal outputs must stay unmapped: the forward runs once and the tangent pass takes the mapped
    tangents. Otherwise the fused pass folds the mapped axis into the batch like the other primitives."""
    if any(d is not None for d in dims[:4]):
        return _fused_jvp_batching(args, dims, **params)
    q, k, v, sinks, tq, tk, tv, ts = args
    out, lse = fwd_p.bind(q, k, v, sinks, **params)
    t_outs, t_dims = _tangent_batching((q, k, v, sinks, out, lse, tq, tk, tv, ts), (None,) * 6 + tuple(dims[4:]),
                                       **params)
    return [out, lse, *t_outs], [None, None, *t_dims]


batching.primitive_batchers[jvp_p] = _jvp_batching
batching.primitive_batchers[varlen_guard_p] = _guard_batching


def forward(q, k, v, sinks, *mask_bits, **params):
    return fwd_p.bind(q, k, v, sinks, *mask_bits, **params)


# ------------------------------------------------------------------------------ reference lowering (not CUDA)
# On every platform but CUDA the primitives lower to the pure-JAX reference with the same outputs. That lets the
# CPU tests check the primitive wiring (JVP, transpose, batching, workspace shapes) numerically without a GPU.
def unpack_mask_bits(bits, b, h, q_idx, kv_idx):
    """The predicate packed mask bits hold (layout in flashjax/mask_bits.py), at broadcasting int32 indices; b and h
    collapse to 0 where the bits broadcast over them. The reference lowerings' mask for calls that carry bits."""
    b = b if bits.shape[0] > 1 else jnp.zeros_like(b)
    h = h if bits.shape[1] > 1 else jnp.zeros_like(h)
    word = bits[b, h, q_idx, kv_idx // 32]
    return ((word >> (kv_idx % 32).astype(jnp.uint32)) & 1) == 1


def _bits_mask(mask_bits):
    return functools.partial(unpack_mask_bits, mask_bits[0]) if mask_bits else None


def _reference_fn(q, k, v, sinks, *mask_bits, softmax_scale, softcap, window_left, window_right, has_sinks,
                  deterministic=False, has_mask_bits=False):
    from . import reference

    return reference.attention(q, k, v, softmax_scale=softmax_scale, causal=False,
                               window_size=(window_left, window_right), sinks=sinks if has_sinks else None,
                               softcap=softcap, mask_mod=_bits_mask(mask_bits))


def _reference_tangent(q, k, v, sinks, out, lse, tq, tk, tv, ts, *mask_bits, **params):
    _, tangents = jax.jvp(lambda *p: _reference_fn(*p, *mask_bits, **params), (q, k, v, sinks), (tq, tk, tv, ts))
    return tangents


def _reference_bwd(q, k, v, out, lse, dout, dlse, sinks, *mask_bits, softmax_scale, softcap, window_left,
                   window_right, has_sinks, has_dlse, deterministic=False, has_mask_bits=False):
    # The kernels' contract: P and D from the given out and lse, which may be those of longer rows (ring.py).
    from . import reference

    dq, dk, dv, dsinks = reference.attention_vjp(
        q, k, v, out, lse, dout, dlse, softmax_scale=softmax_scale, causal=False,
        window_size=(window_left, window_right), sinks=sinks if has_sinks else None, softcap=softcap,
        mask_mod=_bits_mask(mask_bits))
    return dq, dk, dv, jnp.zeros_like(sinks) if dsinks is None else dsinks


mlir.register_lowering(fwd_local_p, mlir.lower_fun(_reference_fn, multiple_results=True))
mlir.register_lowering(tangent_local_p, mlir.lower_fun(_reference_tangent, multiple_results=True))
mlir.register_lowering(bwd_local_p, mlir.lower_fun(_reference_bwd, multiple_results=True))
mlir.register_lowering(jvp_local_p, mlir.lower_fun(_jvp_composed, multiple_results=True))
