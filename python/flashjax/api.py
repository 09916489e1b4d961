"""The public functions: validation at trace time, backend choice, head-dim padding, and the call."""
from __future__ import annotations

import dataclasses
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, primitives, reference, sharding, varlen, varlen_kernel
from .mask_trace import MaskModCodegenError
from .masks import MaskMod

BACKENDS = ("auto", "kernel", "reference")
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Options:
    """The keywords shared by flash_attn and flash_attn_varlen, validated and resolved."""
    causal: bool
    window_size: tuple[int, int]
    softmax_scale: float
    softcap: float
    mask_mod: MaskMod | None
    deterministic: bool
    backend: str

    @property
    def window(self) -> tuple[int, int]:
        """(left, right) with causal folded in as right = 0 (docs/design.md §2.3); -1 = unbounded."""
        left, right = self.window_size
        return left, 0 if self.causal else right


# ------------------------------------------------------------------------------------------------ validation
def _fail(cls, name, value, expected):
    raise cls(f"flashjax: {name} must be {expected}, got {value!r}")


def _require_static(name, value, expected, convert="float(x)"):
    """Options fixed when the call is traced (compile-time constants of the kernels, the plan's inputs) must be Python
    values: a jax or numpy array, traced or not, gets a TypeError that says so instead of a complaint about its value.
    `convert` says how to turn a concrete array x into the Python value."""
    if isinstance(value, jax.core.Tracer):
        _fail(TypeError, name, value, f"{expected} (a static value: it is fixed when the call is traced, so it cannot "
              "be a traced value; pass a Python constant, e.g. through jax.jit's static_argnames)")
    if isinstance(value, (jax.Array, np.ndarray)):
        _fail(TypeError, name, value, f"{expected} (a static value, not an array: convert a concrete one with "
              f"{convert})")


def _shape_of(name, x, rank, what):
    shape = getattr(x, "shape", None)
    if shape is None:
        _fail(TypeError, name, type(x).__name__, "an array")
    if len(shape) != rank:
        _fail(ValueError, f"{name}.shape", tuple(shape), f"rank {rank} {what}")
    return tuple(shape)


def _check_qkv_dtypes(q, k, v, backend):
    # float32 is accepted by the reference alone (it computes in f32 anyway): tests and checks use it as the spec.
    allowed = _DTYPES + ((jnp.dtype(jnp.float32),) if backend == "reference" else ())
    if jnp.dtype(q.dtype) not in allowed:
        _fail(TypeError, "q.dtype", str(q.dtype),
              "bfloat16 or float16" + (" (or float32 with backend='reference')" if backend != "reference" else ""))
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
            _fail(TypeError, f"{name}.dtype", str(x.dtype), f"q's dtype {q.dtype}")


def _check_heads(q_heads, k_heads, v_heads, head_dim, k_head_dim, v_head_dim):
    if k_heads == 0 or q_heads % k_heads != 0:
        _fail(ValueError, "number of key heads", k_heads, f"a divisor of the query heads ({q_heads})")
    if v_heads != k_heads:
        _fail(ValueError, "number of value heads", v_heads, f"the key heads ({k_heads})")
    if k_head_dim != head_dim:
        _fail(ValueError, "k's head dim", k_head_dim, f"q's head dim ({head_dim})")
    # Any width runs: the kernel path zero-pads q, k and v to the next compiled width (docs/design.md §1).
    for name, d in (("q's head dim", head_dim), ("v's head dim", v_head_dim)):
        if d <= 0 or d > _MAX_HEAD_DIM:
            _fail(ValueError, name, d, f"between 1 and {_MAX_HEAD_DIM}")


def _check_options(*, causal, window_size, softmax_scale, sinks, softcap, mask_mod, return_lse, deterministic,
                   backend, head_dim, heads_q) -> Options:
    for name, value in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)):
        _require_static(name, value, "a Python bool", "bool(x)")
        if not isinstance(value, (bool, np.bool_)):
            _fail(TypeError, name, value, "a bool")
    _require_static("window_size", window_size, "a pair of Python ints (left, right)", "tuple(int(w) for w in x)")
    if isinstance(window_size, (tuple, list)):
        for side, w in zip(("left", "right"), window_size):
            _require_static(f"window_size's {side} bound", w, "a Python int >= -1", "int(x)")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        _fail(ValueError, "window_size", window_size, "a pair of ints (left, right)")
    if any(w < -1 for w in window_size):
        _fail(ValueError, "window_size", window_size, "ints >= -1 (-1 leaves that side unbounded)")
    if softmax_scale is None:
        softmax_scale = 1.0 / float(np.sqrt(head_dim))  # the caller's head dim, not the padded one
    else:
        _require_static("softmax_scale", softmax_scale, "a Python float > 0 or None")
        if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, (bool, np.bool_)):
            _fail(TypeError, "softmax_scale", softmax_scale, "a Python float (a static value) or None")
        if not np.isfinite(softmax_scale) or softmax_scale <= 0:
            # The kernels take the running max on unscaled scores, which is only order-preserving for a positive scale.
            _fail(ValueError, "softmax_scale", softmax_scale, "a finite float > 0")
    _require_static("softcap", softcap, "a Python float >= 0")
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, (bool, np.bool_)):
        _fail(TypeError, "softcap", softcap, "a Python float >= 0 (0 disables it), not a bool")
    if not np.isfinite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", softcap, "a finite float >= 0 (0 disables it)")
    if sinks is not None:
        _check_sinks(sinks, heads_q)
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        hint = ""
        if isinstance(mask_mod, type) and issubclass(mask_mod, MaskMod):
            hint = " (an instance: call the class)"
        elif callable(mask_mod) and getattr(mask_mod, "__module__", None) == "flashjax.masks":
            hint = f" (call the factory: mask_mod={mask_mod.__name__}(...))"
        _fail(TypeError, "mask_mod", type(mask_mod).__name__, f"a flashjax.MaskMod or None{hint}")
    if backend not in BACKENDS:
        _fail(ValueError, "backend", backend, f"one of {BACKENDS}")
    return Options(bool(causal), (int(window_size[0]), int(window_size[1])), float(softmax_scale), float(softcap),
                   mask_mod, bool(deterministic), backend)


def _check_sinks(sinks, heads_q):
    shape = getattr(sinks, "shape", None)
    if shape is None:
        _fail(TypeError, "sinks", type(sinks).__name__, "an array")
    if tuple(shape) != (heads_q,):
        _fail(ValueError, "sinks.shape", tuple(shape), f"({heads_q},), one logit per query head")
    if jnp.dtype(sinks.dtype) != jnp.dtype(jnp.float32):
        _fail(TypeError, "sinks.dtype", str(sinks.dtype), "float32")
    # Concrete sinks (not traced: eager calls, constants under jit) are read here, so a NaN is caught before
    # anything runs; a traced NaN propagates into its head's out and lse instead (docs/design.md §2.4).
    if (isinstance(sinks, (jax.Array, np.ndarray)) and not isinstance(sinks, jax.core.Tracer)
            and getattr(sinks, "is_fully_addressable", True)):
        nan_heads = np.flatnonzero(np.isnan(np.asarray(sinks)))
        if nan_heads.size:
            _fail(ValueError, f"sinks at query heads {nan_heads.tolist()}", np.asarray(sinks)[nan_heads].tolist(),
                  "logits that are not NaN (-inf: the head has no sink; +inf: all weight on the sink)")


def _check_mask_mod(mask_mod, *, batch, heads, seqlen_q, seqlen_k, index_shapes, target):
    """The mod's own shape checks (MaskMod.check_shapes), then its predicate evaluated abstractly on index arrays of
    the shapes the reference passes: it must return bool, broadcastable to `target`."""
    mask_mod.static_key()  # static() fields must be hashable (jit's cache keys on them): names the field if not
    mask_mod.check_shapes(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    name = f"mask_mod {type(mask_mod).__qualname__}"
    indices = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in index_shapes]
    result = jax.eval_shape(lambda mod, *idx: mod(*idx), mask_mod, *indices)
    if not isinstance(result, jax.ShapeDtypeStruct):
        _fail(TypeError, f"{name}'s result", type(result).__name__, "one bool array")
    expected = f"broadcastable to {tuple(target)} (b {index_shapes[0]}, h {index_shapes[1]}, q_idx " \
               f"{index_shapes[2]}, kv_idx {index_shapes[3]})"
    if jnp.dtype(result.dtype) != jnp.dtype(jnp.bool_):
        _fail(TypeError, f"{name}'s result dtype", str(result.dtype), "bool (a predicate: compare, e.g. kv_idx <= q_idx)")
    shape = tuple(result.shape)
    if len(shape) > len(target) or any(d not in (1, t) for d, t in zip(shape[::-1], target[::-1])):
        _fail(ValueError, f"{name}'s result shape", shape, expected)


def _check_offsets(name, x, length=None):
    if x is None:
        return None
    shape = getattr(x, "shape", None)
    if shape is None:
        _fail(TypeError, name, type(x).__name__, "an int32 array")
    if len(shape) != 1:
        _fail(ValueError, f"{name}.shape", tuple(shape), "rank 1")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        _fail(TypeError, f"{name}.dtype", str(x.dtype), "int32")
    if length is not None and shape[0] != length:
        _fail(ValueError, f"{name}.shape", tuple(shape), f"({length},)")
    return shape[0]


def _check_hint(name, value):
    if value is None:
        return
    _require_static(name, value, "a non-negative Python int or None", "int(x)")
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        _fail(ValueError, name, value, "a non-negative int or None")


# ------------------------------------------------------------------------------------------------ backend choice
@dataclasses.dataclass(frozen=True)
class Call:
    """A validated call: its sizes as the plan sees them (varlen: N sequences, the token counts), its options."""
    dtype: object
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int      # the larger of q's and v's
    head_dim_v: int
    has_sinks: bool
    varlen: bool
    options: Options


def _plan_of(call: Call, device_sm: int) -> dict:
    device = _ffi.default_device()
    left, right = call.options.window
    return _ffi.plan(dtype=jnp.dtype(call.dtype).name, batch=call.batch, seqlen_q=call.seqlen_q,
                     seqlen_k=call.seqlen_k, heads_q=call.heads_q, heads_k=call.heads_k, head_dim=call.head_dim,
                     window_left=left, window_right=right, softcap=call.options.softcap, has_sinks=call.has_sinks,
                     varlen=call.varlen, mask_mod=call.options.mask_mod is not None,
                     deterministic=call.options.deterministic, device_sm=device_sm,
                     num_sms=device[1] if device is not None else 0)


def choose(call: Call, *, device_sm: int | None = None):
    """Which implementation runs a call, and why: ("kernel" | "reference", reason, plan or None).

    The kernel question goes to the library's plan (csrc/ffi/plan.h), the function the FFI handlers use; it takes
    the kernels only where both passes have one, since the call may be differentiated later. device_sm asks about
    another GPU than the default device (explain's).
    """
    options = call.options
    if options.backend == "reference":
        return "reference", "backend='reference' was asked for", None
    plan = None
    if device_sm is None:
        device = _ffi.default_device()
        device_sm = None if device is None else device[0]
    if device_sm is None:
        reason = f"the default JAX device is {jax.devices()[0].platform!r}; the kernels need an NVIDIA GPU"
    elif not _ffi.available():
        reason = "the compiled library libflashjax.so is not installed"
    elif _ffi.cuda_environment()["problem"] is not None:
        reason = _ffi.cuda_environment()["problem"]
    else:
        plan = _plan_of(call, device_sm)
        codegen_error = _mask_mod_codegen_error(options.mask_mod) if plan["runs"] else None
        if plan["runs"] and codegen_error is None:
            return "kernel", plan["reason"], plan
        reason = plan["reason"] if codegen_error is None else str(codegen_error)
        if codegen_error is not None and options.backend == "kernel":
            raise codegen_error
    _fall_back(options, reason, stacklevel=4)
    return "reference", reason, plan


def _fall_back(options: Options, reason: str, *, stacklevel: int = 3) -> None:
    """No kernel runs the call: backend="kernel" raises ValueError with the reason, "auto" warns once per reason."""
    if options.backend == "kernel":
        raise ValueError(f"flashjax: backend='kernel' but no kernel runs this call: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashjax: using the pure-JAX reference because {reason}", stacklevel=stacklevel)


def _varlen_mask_grid(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The padded grid (rows, keys) a varlen call's mask bits are evaluated over (design §2.7: N sequences padded to
    the longest), or the reason there is none. The max_seqlen hints where given, else the longest sequence of
    concrete offsets; traced offsets without a hint leave the grid unknown: the kernels cannot take the mod. A hint
    smaller than a concrete sequence raises ValueError (the kernels would cut that sequence, mask_grid.h)."""
    grid = []
    for name, offsets, hint, side in (("max_seqlen_q", cu_seqlens_q, max_seqlen_q, "cu_seqlens_q"),
                                      ("max_seqlen_k", cu_seqlens_k, max_seqlen_k, "cu_seqlens_k")):
        if varlen._is_concrete(offsets):
            values = np.asarray(offsets).astype(np.int64)
            longest = int(np.max(values[1:] - values[:-1], initial=0))
            if hint is not None and hint < longest:
                _fail(ValueError, name, hint, f"at least the longest sequence in {side} ({longest} tokens): a mask "
                      "mod with varlen is evaluated over the sequences padded to it")
            grid.append(longest if hint is None else hint)
        elif hint is None:
            return (f"a mask mod with varlen (packed) attention needs max_seqlen_q and max_seqlen_k under jit: its "
                    f"bits cover the sequences padded to them ({name} is None and {side} is traced)")
        else:
            grid.append(hint)
    return max(grid[0], 1), max(grid[1], 1)


def _mask_mod_codegen_error(mask_mod):
    """None where the kernels can take the mod (its predicate traces into device code, docs/mask_codegen.md), else
    the MaskModCodegenError naming the construct: backend="auto" then falls back to the reference with the one-time
    warning, backend="kernel" raises it."""
    if mask_mod is None:
        return None
    from .mask_codegen import generate_mask_mod

    try:
        generate_mask_mod(mask_mod)
    except MaskModCodegenError as error:
        return error
    return None


# ------------------------------------------------------------------------------------------------ kernel path
def _pad_last(x, width):
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


# A +inf sink as the kernels see it: above any score a finite softmax_scale * q.k reaches, below float32's max after
# the kernels' log2(e) scaling.
_TAKES_ALL_SINK = 1e30


def _sinks_for_kernels(sinks):
    """Sinks as the kernels take them. design §2.4's +inf sink (all weight on the sink) reaches the kernels as a
    finite logit so large that every key's weight underflows to 0 (out 0, no q/k/v gradient) with no inf - inf in
    their arithmetic; lse then takes the sink itself (_lse_of_special_sinks), as it does for a NaN sink, whose NaN the
    kernels already carry into every row that sees a key."""
    return jnp.where(sinks == jnp.inf, _TAKES_ALL_SINK, sinks)


def _lse_of_special_sinks(lse, sinks, head_axis: int):
    """The kernels' lse with the rows of a head whose sink is +inf or NaN set to that sink (design §2.4). Only lse gets
    the where, and only if lse is used."""
    shape = [1] * lse.ndim
    shape[head_axis] = sinks.shape[0]
    sinks = sinks.reshape(shape)
    return jnp.where(jnp.isnan(sinks) | (sinks == jnp.inf), sinks, lse)


def _kernel_attention(q, k, v, sinks, options: Options, width: int):
    """Dense call on the kernel path: pad q/k/v to the plan's compiled width, run the primitive, slice v's back."""
    has_sinks = sinks is not None
    sinks_arr = _sinks_for_kernels(sinks) if has_sinks else jnp.zeros((q.shape[2],), jnp.float32)
    left, right = options.window
    # A mask mod runs as its packed bits (flashjax.mask_bits, evaluated once here); the backward gets the same
    # array as a residual (primitives.py). Field values are run-time data: a new value reuses everything compiled.
    mask_bits = ()
    if options.mask_mod is not None:
        from . import mask_bits as bits_module

        mask_bits = (bits_module.mask_bits(options.mask_mod, batch=q.shape[0], heads=q.shape[2],
                                           seqlen_q=q.shape[1], seqlen_k=k.shape[1]),)
    out, lse = primitives.forward(_pad_last(q, width), _pad_last(k, width), _pad_last(v, width), sinks_arr,
                                  *mask_bits, softmax_scale=options.softmax_scale, softcap=options.softcap,
                                  window_left=left, window_right=right, has_sinks=has_sinks,
                                  deterministic=options.deterministic, has_mask_bits=bool(mask_bits))
    if has_sinks:
        lse = _lse_of_special_sinks(lse, sinks, head_axis=1)  # lse [B, Hq, Sq]
    return out[..., :v.shape[-1]], lse


def _kernel_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, options: Options,
                             width: int, max_seqlen_q, max_seqlen_k, mask_grid=None):
    """Varlen call on the kernel path (varlen_kernel.py): padded as _kernel_attention pads, sinks as it treats them;
    the max_seqlen hints serve the backward's reference lowering (off CUDA). A mask mod runs as its bits over the N
    sequences padded to mask_grid = (rows, keys) (_varlen_mask_grid), b the sequence, indices local to it."""
    left, right = options.window
    mask_bits = None
    num_seqs = cu_seqlens_q.shape[0] - 1
    if options.mask_mod is not None and num_seqs > 0:  # no sequence: no row to mask (nor bits of batch 0)
        from . import mask_bits as bits_module

        mask_bits = bits_module.mask_bits(options.mask_mod, batch=num_seqs, heads=q.shape[1], seqlen_q=mask_grid[0],
                                          seqlen_k=mask_grid[1])
    out, lse = varlen_kernel.attention(_pad_last(q, width), _pad_last(k, width), _pad_last(v, width), cu_seqlens_q,
                                       cu_seqlens_k, seqused_q, seqused_k,
                                       None if sinks is None else _sinks_for_kernels(sinks),
                                       softmax_scale=options.softmax_scale, softcap=options.softcap,
                                       window_left=left, window_right=right, max_seqlen_q=max_seqlen_q,
                                       max_seqlen_k=max_seqlen_k, mask_bits=mask_bits)
    if sinks is not None:
        # Rows that see a key take the special sink as lse; unused rows keep -inf (the kernel's prefill).
        lse = jnp.where(lse > -jnp.inf, _lse_of_special_sinks(lse, sinks, head_axis=0), lse)  # lse [Hq, Tq]
    return out[..., :v.shape[-1]], lse


def _reference_kwargs(options: Options, sinks):
    return dict(softmax_scale=options.softmax_scale, causal=options.causal, window_size=options.window_size,
                sinks=sinks, softcap=options.softcap, mask_mod=options.mask_mod)


# ------------------------------------------------------------------------------------------------ validation of calls
def _dense_call(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, sinks=None, softcap=0.0,
                mask_mod=None, return_lse=False, deterministic=False, backend="auto") -> Call:
    """flash_attn's arguments checked (explain checks its arguments with this same function)."""
    q_shape = _shape_of("q", q, 4, "[B, Sq, Hq, D]")
    k_shape = _shape_of("k", k, 4, "[B, Sk, Hk, D]")
    v_shape = _shape_of("v", v, 4, "[B, Sk, Hk, Dv]")
    _check_qkv_dtypes(q, k, v, backend)
    if k_shape[0] != q_shape[0] or v_shape[0] != q_shape[0]:
        _fail(ValueError, "batch sizes of (q, k, v)", (q_shape[0], k_shape[0], v_shape[0]), "all equal")
    if v_shape[1] != k_shape[1]:
        _fail(ValueError, "v.shape[1]", v_shape[1], f"k's sequence length ({k_shape[1]})")
    _check_heads(q_shape[2], k_shape[2], v_shape[2], q_shape[3], k_shape[3], v_shape[3])
    options = _check_options(causal=causal, window_size=window_size, softmax_scale=softmax_scale, sinks=sinks,
                             softcap=softcap, mask_mod=mask_mod, return_lse=return_lse, deterministic=deterministic,
                             backend=backend, head_dim=q_shape[3], heads_q=q_shape[2])
    if mask_mod is not None:
        b, sq, h, sk = q_shape[0], q_shape[1], q_shape[2], k_shape[1]
        _check_mask_mod(mask_mod, batch=b, heads=h, seqlen_q=sq, seqlen_k=sk,
                        index_shapes=[(b, 1, 1, 1), (1, h, 1, 1), (1, 1, sq, 1), (1, 1, 1, sk)], target=(b, h, sq, sk))
    return Call(q.dtype, q_shape[0], q_shape[1], k_shape[1], q_shape[2], k_shape[2], max(q_shape[3], v_shape[3]),
                v_shape[3], sinks is not None, False, options)


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                 seqused_k=None, causal=False, window_size=(-1, -1), softmax_scale=None, sinks=None, softcap=0.0,
                 mask_mod=None, return_lse=False, deterministic=False, backend="auto") -> Call:
    """flash_attn_varlen's arguments checked (explain checks its arguments with this same function)."""
    q_shape = _shape_of("q", q, 3, "[Tq, Hq, D]")
    k_shape = _shape_of("k", k, 3, "[Tk, Hk, D]")
    v_shape = _shape_of("v", v, 3, "[Tk, Hk, Dv]")
    _check_qkv_dtypes(q, k, v, backend)
    if v_shape[0] != k_shape[0]:
        _fail(ValueError, "v.shape[0]", v_shape[0], f"k's token count ({k_shape[0]})")
    _check_heads(q_shape[1], k_shape[1], v_shape[1], q_shape[2], k_shape[2], v_shape[2])
    for name, offsets in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if offsets is None:
            _fail(TypeError, name, None, "an int32 array of shape [N + 1] (the offsets of the N packed sequences)")
    n_q = _check_offsets("cu_seqlens_q", cu_seqlens_q)
    n_k = _check_offsets("cu_seqlens_k", cu_seqlens_k)
    if n_q < 1:
        _fail(ValueError, "cu_seqlens_q", cu_seqlens_q, "an int32 [N + 1] array with N >= 0")
    if n_k != n_q:
        _fail(ValueError, "cu_seqlens_k.shape", (n_k,), f"cu_seqlens_q's shape ({n_q},)")
    _check_offsets("seqused_q", seqused_q, n_q - 1)
    _check_offsets("seqused_k", seqused_k, n_q - 1)
    _check_hint("max_seqlen_q", max_seqlen_q)
    _check_hint("max_seqlen_k", max_seqlen_k)
    options = _check_options(causal=causal, window_size=window_size, softmax_scale=softmax_scale, sinks=sinks,
                             softcap=softcap, mask_mod=mask_mod, return_lse=return_lse, deterministic=deterministic,
                             backend=backend, head_dim=q_shape[2], heads_q=q_shape[1])
    if mask_mod is not None:
        # Sequence-local indices, b = each row's sequence (reference.attention_varlen): the lengths are run-time data.
        tq, h, tk = q_shape[0], q_shape[1], k_shape[0]
        _check_mask_mod(mask_mod, batch=n_q - 1, heads=h, seqlen_q=None, seqlen_k=None,
                        index_shapes=[(1, 1, tq, 1), (1, h, 1, 1), (1, 1, tq, 1), (1, 1, 1, tk)], target=(1, h, tq, tk))
    return Call(q.dtype, n_q - 1, q_shape[0], k_shape[0], q_shape[1], k_shape[1], max(q_shape[2], v_shape[2]),
                v_shape[2], sinks is not None, True, options)


# ------------------------------------------------------------------------------------------------ public API
def flash_attn(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, sinks=None, softcap=0.0,
               mask_mod=None, return_lse=False, deterministic=False, backend="auto"):
    """Attention over dense batches, FlashAttention style.

    Args:
      q: [B, Sq, Hq, D] bfloat16 or float16 (float32 too with backend="reference").
      k: [B, Sk, Hk, D], same dtype; Hq must be a multiple of Hk (grouped-query attention).
      v: [B, Sk, Hk, Dv], same dtype. D and Dv are any widths from 1 to 256 (the kernels zero-pad them to the next
        compiled width, 64, 96, 128, 192 or 256, and slice the output back).
      causal: bottom-right aligned causal mask (the last query sees the last key).
      window_size: (left, right) local band, bottom-right aligned; -1 leaves a side unbounded. With causal=True
        the left bound is kept and right is forced to 0.
      softmax_scale: multiplies q·k (a finite Python float > 0); defaults to 1/sqrt(D).
      sinks: optional float32 [Hq]: one learned logit per query head joining every row's softmax denominator;
        -inf is no sink, +inf puts all the weight on the sink (out 0, lse +inf). A concrete NaN raises; a traced one
        makes its head's out and lse NaN.
      softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking.
      mask_mod: optional flashjax.MaskMod, evaluated on raw (top-left) indices and ANDed with causal/window.
      return_lse: also return the log-sum-exp [B, Hq, Sq] float32 (sink term included).
      deterministic: require a run-to-run bitwise reproducible backward.
      backend: "auto" (fastest kernel that runs the call, else the reference with a one-time warning saying why),
        "kernel" (raise if no kernel runs it) or "reference" (pure JAX, any platform).

    Returns:
      out [B, Sq, Hq, Dv] in q's dtype, or (out, lse) with return_lse=True. A query row with no visible key gets
      out = 0 and lse = -inf (= the sink logit with sinks) and zero gradients.
    """
    call = _dense_call(q, k, v, causal=causal, window_size=window_size, softmax_scale=softmax_scale, sinks=sinks,
                       softcap=softcap, mask_mod=mask_mod, return_lse=return_lse, deterministic=deterministic,
                       backend=backend)

    def run(q, k, v, sinks, mask_mod):
        path, _, plan = choose(call)
        options = dataclasses.replace(call.options, mask_mod=mask_mod)
        if path == "kernel":
            return _kernel_attention(q, k, v, sinks, options, plan["head_dim"])
        q, k, v = sharding.check("dense", q, k, v)
        return reference.attention(q, k, v, **_reference_kwargs(options, sinks))

    out, lse = _run_sharded(run, "dense", ("q", "rows"), q, k, v, sinks, mask_mod)
    return (out, lse) if return_lse else out


def _run_sharded(run, kind, result_roles, q, k, v, *rest):
    """run(q, k, v, *rest) under sharding.py's policy: with explicitly sharded operands (jax.make_mesh's default mesh)
    the policy is applied now and the call runs with those axes made Auto, which the partitioner then splits by the
    same policy; otherwise as it is (the partitioner applies the policy when the call is compiled)."""
    found = sharding.explicit_split(kind, q, k, v)
    if found is None:
        return run(q, k, v, *rest)
    return sharding.run_explicit(run, *found, result_roles, q, k, v, *rest)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                      seqused_k=None, causal=False, window_size=(-1, -1), softmax_scale=None, sinks=None,
                      softcap=0.0, mask_mod=None, return_lse=False, deterministic=False, backend="auto"):
    """Attention over packed variable-length sequences.

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]; attention
    never crosses sequences and q and k may pack differently. Zero-length sequences are fine.

    Args:
      q: [Tq, Hq, D]; k: [Tk, Hk, D]; v: [Tk, Hk, Dv] (bfloat16 or float16, as flash_attn).
      cu_seqlens_q, cu_seqlens_k: int32 [N + 1] offsets: from 0, nondecreasing, ending at or before the token count
        (tokens past the end are padding). Concrete values are checked (ValueError naming the first bad entry);
        under jit they are runtime data, never read out of bounds whatever they hold (flashjax.check_varlen checks
        them there, through checkify).
      max_seqlen_q, max_seqlen_k: optional hints (ints); no compile depends on the packing. With both, the reference
        computes per sequence (cost ~ N x max_seqlen_q x max_seqlen_k) where they hold.
      seqused_q, seqused_k: optional int32 [N]: slot b uses only its first seqused[b] tokens (KV caches allocated
        larger than filled). Unused keys are invisible; unused query rows get out = 0 and zero gradients.
      The remaining keywords are those of flash_attn; causal/window are bottom-right aligned per sequence using the
      used lengths; mask_mod sees sequence-local indices with b = the sequence index.

    Returns:
      out [Tq, Hq, Dv], or (out, lse [Hq, Tq] float32) with return_lse=True. jax.vmap over this call is rejected:
      the packing is the batch.
    """
    call = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        seqused_q=seqused_q, seqused_k=seqused_k, causal=causal, window_size=window_size,
                        softmax_scale=softmax_scale, sinks=sinks, softcap=softcap, mask_mod=mask_mod,
                        return_lse=return_lse, deterministic=deterministic, backend=backend)
    varlen.check_concrete_call(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, q.shape[0], k.shape[0])
    given_offsets = (cu_seqlens_q, cu_seqlens_k)  # as passed (concrete outside jit): a mask mod's grid reads them
    operands = [q, k, v, cu_seqlens_q, cu_seqlens_k] + [x for x in (seqused_q, seqused_k, sinks) if x is not None]
    guarded = iter(primitives.varlen_guard_p.bind(*operands))
    q, k, v, cu_seqlens_q, cu_seqlens_k = (next(guarded) for _ in range(5))
    seqused_q, seqused_k, sinks = (None if x is None else next(guarded) for x in (seqused_q, seqused_k, sinks))

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, mask_mod):
        backend, _, plan = choose(call)
        mask_grid = None
        if backend == "kernel" and mask_mod is not None:
            # The bits' padded grid, from the hints or the given offsets; a str: why the kernels cannot take the mod.
            # Only the kernel path asks (the reference takes any hint).
            mask_grid = _varlen_mask_grid(*given_offsets, max_seqlen_q, max_seqlen_k)
            if isinstance(mask_grid, str):
                _fall_back(call.options, mask_grid, stacklevel=5)
                backend = "reference"
        options = dataclasses.replace(call.options, mask_mod=mask_mod)
        q, k, v = sharding.check("varlen", q, k, v)
        if backend == "kernel":
            return _kernel_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks,
                                            options, plan["head_dim"], max_seqlen_q, max_seqlen_k, mask_grid)
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q,
                                          seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                          **_reference_kwargs(options, sinks))

    out, lse = _run_sharded(run, "varlen", ("packed_q", "packed_rows"), q, k, v, cu_seqlens_q, cu_seqlens_k,
                            seqused_q, seqused_k, sinks, mask_mod)
    return (out, lse) if return_lse else out


def flash_mha(query, key, value, *, is_causal=False, window_size=(-1, -1), sinks=None, softmax_scale=None):
    """dew-flash-attn's name for flash_attn: [B, S, H, D] inputs, same semantics (a thin wrapper)."""
    return flash_attn(query, key, value, causal=is_causal, window_size=window_size, sinks=sinks,
                      softmax_scale=softmax_scale)


def flash_mha_varlen(query, key, value, cu_seqlens, max_seqlen, *, is_causal=False, window_size=(-1, -1),
                     sinks=None):
    """dew-flash-attn's name for flash_attn_varlen with one cu_seqlens for queries and keys (a thin wrapper)."""
    return flash_attn_varlen(query, key, value, cu_seqlens, cu_seqlens, max_seqlen_q=max_seqlen,
                             max_seqlen_k=max_seqlen, causal=is_causal, window_size=window_size, sinks=sinks)


def explain(q, k, v, *args, varlen=False, device_sm=None, **keywords) -> str:
    """Say which implementation a call with these arguments would run, and why, without running it.

    explain(q, k, v, **flash_attn_keywords) for a dense call, explain(q, k, v, cu_seqlens_q, cu_seqlens_k,
    **flash_attn_varlen_keywords) for a varlen one: the arguments are checked exactly as the call checks them (the
    same errors). q, k, v (and the offsets) may be arrays or jax.ShapeDtypeStruct. varlen=True without offsets
    asks about a varlen call of one sequence. device_sm (e.g. 90) asks about another GPU than the default device.
    Returns the explanation (and prints nothing).
    """
    if args or varlen:
        if not args:
            args = (jax.ShapeDtypeStruct((2,), jnp.int32),) * 2
        call = _varlen_call(q, k, v, *args, **keywords)
    else:
        call = _dense_call(q, k, v, **keywords)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path, reason, plan = choose(call, device_sm=device_sm)
        if path == "kernel" and call.varlen and call.options.mask_mod is not None:
            grid = _varlen_mask_grid(args[0], args[1], keywords.get("max_seqlen_q"), keywords.get("max_seqlen_k"))
            if isinstance(grid, str):
                _fall_back(call.options, grid)
                path, reason, plan = "reference", grid, None
    shape = f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {jnp.dtype(q.dtype).name}"
    details = ""
    if path == "kernel":
        # The forward as the lowering plans it: the same shapes, the default device's SM count.
        fwd = plan["fwd"]
        details = f", head dim padded to {plan['head_dim']}"
        if fwd["pack_group"] > 1:
            details += f"; GQA packed: {fwd['packing_reason']}"
        if fwd["num_splits"] > 1:
            details += f"; keys split: {fwd['split_reason']}"
        bwd = plan["bwd"]
        details += f"; forward {fwd['tile_reason']}; backward: {bwd['reason']}"
        details += f", {bwd['tile_reason']}" if bwd["tile_reason"] else ""
        tangent = plan.get("tangent")
        if tangent is not None:  # forward mode: the reference's tangent where no kernel has it (primitives.py)
            details += (f"; tangent (jax.jvp): {tangent['reason']}, {tangent['tile_reason']}" if tangent["family"]
                        else f"; tangent (jax.jvp): the reference's ({tangent['reason']})")
        jvp = plan.get("jvp")
        if jvp is not None and jvp["family"]:  # plain jax.jvp's fused pass (primitives.py); else forward + tangent
            details += f"; fused jvp (plain jax.jvp): {jvp['reason']}, {jvp['tile_reason']}"
    return f"{shape}: {path} ({reason}{details})"
