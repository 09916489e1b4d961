"""A mask mod's packed bitmask, the operand the attention kernels read (docs/mask_codegen.md, "The mask-bits kernel").

    mask_bits_shape(mod, batch=B, heads=H, seqlen_q=Sq, seqlen_k=Sk)      # (Bm, Hm, Sq, ceil(Sk / 32))
    mask_bits_reference(mod, batch=B, heads=H, seqlen_q=Sq, seqlen_k=Sk)  # uint32, pure jnp: the oracle
    mask_bits(mod, batch=B, heads=H, seqlen_q=Sq, seqlen_k=Sk)            # uint32, the NVRTC kernel on a GPU

Bit j (1u << j) of word [b, h, q, w] is 1 iff mod(b, h, q, 32 * w + j) holds, with the raw (top-left) indices
MaskMod's __call__ sees; bits for kv >= Sk are 0. Bm is B when the mod's expression graph reads the index b, else
1; Hm likewise for the query head h. A kernel indexes the bitmask with stride 0 on an axis of extent 1.

mask_bits binds one primitive. Its CUDA lowering compiles the mod's generated source with the mask-bits kernel
(flashjax.mask_bits_emit.bits_kernel_source) by NVRTC, through the disk cache, for the compute capability of the GPU
jax runs on (PTX for compute_80 where the lowering sees no GPU, e.g. jax.export on a CPU host), and emits the FFI
call flashjax_mask_bits with the binary as an attribute: the call is self-contained, the handler loads the binary
at FFI instantiate time, and the execute stage only launches. The array fields are operands, so a new value
reuses everything; a new static() value is a new source, hence a new lowering and compile. Off CUDA the
primitive lowers to mask_bits_reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from flashjax import _ffi
from flashjax.kernel_cache import CachedBinary
from flashjax.mask_codegen import GeneratedMaskMod, compile_mask_mod, generate_mask_mod, mask_field_operands
from flashjax.mask_bits_emit import bits_kernel_source
from flashjax.mask_trace import MAX_FIELD_RANK, MaskModCodegenError
from flashjax.masks import MaskMod
from flashjax.nvrtc import NvrtcError

__all__ = ["mask_bits_shape", "mask_bits_reference", "mask_bits", "MaskModCodegenError", "TARGET",
           "bits_kernel_name", "compile_mask_bits", "lowering_stats"]

TARGET = _ffi.MASK_BITS_TARGET  # the FFI target (csrc/ffi/mask_bits_ffi.cpp): stable, for jax.export'ed calls
_STATE_TYPE = "flashjax_mask_bits_state"
_NO_GPU_ARCH = "compute_80"  # PTX the driver compiles for any GPU the library supports
_INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------------ shapes
def _check_sizes(batch, heads, seqlen_q, seqlen_k) -> None:
    for name, value, low, high in (("batch", batch, 1, _INT32_MAX), ("heads", heads, 1, _INT32_MAX),
                                   ("seqlen_q", seqlen_q, 0, _INT32_MAX - 16),
                                   ("seqlen_k", seqlen_k, 0, _INT32_MAX - 31)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"mask bits: {name} must be an int, got {type(value).__name__} {value!r}")
        if not low <= value <= high:
            raise ValueError(f"mask bits: {name} must be in [{low}, {high}], got {value}")
    if batch * heads > _INT32_MAX:
        raise ValueError(f"mask bits: batch * heads must be < 2^31, got {batch} * {heads}")


def _check_mod(mod) -> None:
    if not isinstance(mod, MaskMod):
        raise TypeError(f"mask bits: mod must be a flashjax MaskMod, got {type(mod).__qualname__}")


def _reads(generated: GeneratedMaskMod) -> set[str]:
    """The indices the mod's output depends on."""
    graph = generated.graph
    return {graph.nodes[i].attr for i in graph.reachable() if graph.nodes[i].op == "index"}


def _broadcast_extents(mod: MaskMod, batch: int, heads: int) -> tuple[int, int]:
    """(Bm, Hm): B and H where the graph reads b and h, else 1. A mod the tracer cannot express keeps both (the
    bitmask is then exact whatever it reads; such a mod never reaches the kernels anyway)."""
    try:
        reads = _reads(generate_mask_mod(mod))
    except MaskModCodegenError:
        return batch, heads
    return (batch if "b" in reads else 1), (heads if "h" in reads else 1)


def mask_bits_shape(mod: MaskMod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, ...]:
    """(Bm, Hm, Sq, Wk) of the mod's bitmask for a call of B x H (query heads) x Sq x Sk; Wk = ceil(Sk / 32)."""
    _check_mod(mod)
    _check_sizes(batch, heads, seqlen_q, seqlen_k)
    bm, hm = _broadcast_extents(mod, batch, heads)
    return bm, hm, seqlen_q, -(-seqlen_k // 32)


# --------------------------------------------------------------------------------------------------- reference
def _pack_rows(mod: MaskMod, b, h, seqlen_q: int, seqlen_k: int, words: int) -> jax.Array:
    """uint32 [Sq, words]: the mod at (b, h) (scalars) over every q and every kv < 32 * words, packed."""
    q_idx = jnp.arange(seqlen_q, dtype=jnp.int32).reshape(1, 1, seqlen_q, 1)
    kv_idx = jnp.arange(words * 32, dtype=jnp.int32).reshape(1, 1, 1, words * 32)
    allowed = jnp.asarray(mod(b.reshape(1, 1, 1, 1), h.reshape(1, 1, 1, 1), q_idx, kv_idx), dtype=jnp.bool_)
    allowed = jnp.broadcast_to(allowed, (1, 1, seqlen_q, words * 32))[0, 0] & (kv_idx[0, 0] < seqlen_k)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    return jnp.sum(allowed.reshape(seqlen_q, words, 32).astype(jnp.uint32) * weights, axis=-1, dtype=jnp.uint32)


def _reference(mod: MaskMod, bm: int, hm: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    words = -(-seqlen_k // 32)
    if seqlen_q == 0 or words == 0:
        return jnp.zeros((bm, hm, seqlen_q, words), jnp.uint32)
    mod = jax.tree_util.tree_map(jnp.asarray, mod)  # numpy fields are indexed by traced indices below
    bh = jnp.arange(bm * hm, dtype=jnp.int32)
    # One (b, h) at a time: O(Sq * Sk) memory, whatever B and H are.
    rows = jax.lax.map(lambda i: _pack_rows(mod, i // hm, i % hm, seqlen_q, seqlen_k, words), bh)
    return rows.reshape(bm, hm, seqlen_q, words)


def mask_bits_reference(mod: MaskMod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """The bitmask computed in jnp from the mod's own __call__ (broadcasting index arrays, as the reference
    attention evaluates it): the oracle of the kernel, on any backend."""
    bm, hm, _, _ = mask_bits_shape(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    return _reference(mod, bm, hm, seqlen_q, seqlen_k)


# ---------------------------------------------------------------------------------------------- the kernel path
def bits_kernel_name(generated: GeneratedMaskMod) -> str:
    """The mask-bits kernel's symbol: from the source hash, so two mods' kernels never share a name."""
    return f"flashjax_mask_bits_{generated.source_hash[:16]}"


@dataclasses.dataclass
class _Stats:
    lowerings: int = 0  # CUDA lowerings of the primitive (each one a jit-cache miss)
    nvrtc_compiles: int = 0  # binaries NVRTC produced (not served by the memory or disk cache)
    compile_seconds: float = 0.0  # NVRTC time of those


_stats = _Stats()
_stats_lock = threading.Lock()


def lowering_stats() -> dict:
    """What this process's CUDA lowerings of mask_bits did: {"lowerings", "nvrtc_compiles", "compile_seconds"}."""
    with _stats_lock:
        return {"lowerings": _stats.lowerings, "nvrtc_compiles": _stats.nvrtc_compiles,
                "compile_seconds": _stats.compile_seconds}


def compile_mask_bits(generated: GeneratedMaskMod, *, arch: str) -> CachedBinary:
    """NVRTC's binary of the mod's predicate and its mask-bits kernel, for arch (sm_XX: cubin, compute_XX: PTX),
    through the disk cache. Lowering time only: a cache miss runs NVRTC (about a tenth of a second)."""
    binary = compile_mask_mod(generated, arch=arch, kernel_source=bits_kernel_source(
        generated.graph, bits_kernel_name(generated), generated.function_name))
    with _stats_lock:
        if not binary.from_cache:
            _stats.nvrtc_compiles += 1
            _stats.compile_seconds += binary.seconds
    return binary


def _lowering_binary(generated: GeneratedMaskMod) -> CachedBinary:
    """A cubin for the default GPU's compute capability; PTX for compute_80 where the lowering sees no GPU, or
    where this NVRTC does not know the GPU's arch (an NVRTC older than the GPU): the driver compiles that PTX."""
    device = _ffi.default_device()
    if device is None:
        return compile_mask_bits(generated, arch=_NO_GPU_ARCH)
    try:
        return compile_mask_bits(generated, arch=f"sm_{device[0]}")
    except NvrtcError as error:
        try:
            return compile_mask_bits(generated, arch=_NO_GPU_ARCH)
        except NvrtcError:
            raise error from None


@functools.cache
def _register_target() -> None:
    """The state type, then the target. XLA refuses a handler whose state type it does not know yet, and
    registrations made before a backend starts are replayed targets first: so the backends start here, first."""
    jax.devices()
    lib = _ffi.library()
    for name in ("flashjax_mask_bits_state_type_id", "flashjax_mask_bits_state_type_info"):
        getattr(lib, name).restype = ctypes.c_void_p
    jax.ffi.register_ffi_type(_STATE_TYPE, {
        "type_id": jax.ffi.pycapsule(lib.flashjax_mask_bits_state_type_id()),
        "type_info": jax.ffi.pycapsule(lib.flashjax_mask_bits_state_type_info())}, platform="CUDA")
    jax.ffi.register_ffi_target(TARGET, {"instantiate": jax.ffi.pycapsule(lib.flashjax_mask_bits_instantiate),
                                         "execute": jax.ffi.pycapsule(lib.flashjax_mask_bits_execute)},
                                platform="CUDA")


mask_bits_p = Primitive("flashjax_mask_bits")


def _abstract(*fields, batch, heads, seqlen_q, seqlen_k, **_):
    return jax.core.ShapedArray((batch, heads, seqlen_q, -(-seqlen_k // 32)), jnp.uint32)


def _field_shapes(avals) -> np.ndarray:
    """[n, then per field: rank and its dims padded with 1 to MAX_FIELD_RANK] (the handler's field_shapes)."""
    values = [len(avals)]
    for aval in avals:
        values += [len(aval.shape), *aval.shape, *([1] * (MAX_FIELD_RANK - len(aval.shape)))]
    return np.asarray(values, np.int64)


class _Source:
    """The generated mod as a primitive parameter: equal and hashed by its source hash, as jit's cache needs."""

    def __init__(self, generated: GeneratedMaskMod):
        self.generated = generated

    def __eq__(self, other):
        return isinstance(other, _Source) and other.generated.source_hash == self.generated.source_hash

    def __hash__(self):
        return hash(self.generated.source_hash)

    def __repr__(self):
        return f"<{self.generated.graph.mod_class} {self.generated.source_hash[:12]}>"


def _cuda_lowering(ctx, *fields, batch, heads, seqlen_q, seqlen_k, source, **_):
    generated = source.generated
    binary = _lowering_binary(generated)
    with _stats_lock:
        _stats.lowerings += 1
    _register_target()
    return jax.ffi.ffi_lowering(TARGET)(
        ctx, *fields, batch=np.int32(batch), binary=np.frombuffer(binary.data, np.uint8),
        field_shapes=_field_shapes(ctx.avals_in), heads=np.int32(heads), kernel_name=bits_kernel_name(generated),
        seqlen_k=np.int32(seqlen_k), seqlen_q=np.int32(seqlen_q))


def _reference_lowering(ctx, *fields, batch, heads, seqlen_q, seqlen_k, treedef, dtypes, **_):
    def reference(*values):
        mod = jax.tree_util.tree_unflatten(treedef, [v.astype(d) for v, d in zip(values, dtypes)])
        return _reference(mod, batch, heads, seqlen_q, seqlen_k)
    return mlir.lower_fun(reference, multiple_results=False)(ctx, *fields)


@functools.lru_cache(maxsize=256)
def _eager(params: tuple) -> callable:
    # Outside jit the primitive runs as its own jitted call, one per static signature, so eager calls of one mod
    # lower and compile once.
    return jax.jit(functools.partial(mask_bits_p.bind, **dict(params)))


def _batching(fields, dims, **params):
    """vmap over a mod's fields (e.g. per-example document ids): the kernel once per mapped index under lax.map, the
    unmapped fields shared; the bits gain the mapped axis in front."""
    size = next(f.shape[d] for f, d in zip(fields, dims) if d is not None)
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        operands = list(fields)
        for i, x in zip(mapped, xs):
            operands[i] = x
        return mask_bits_p.bind(*operands, **params)

    xs = [batching.bdim_at_front(fields[i], dims[i], size) for i in mapped]
    return jax.lax.map(one, xs), 0


mask_bits_p.def_impl(lambda *fields, **params: _eager(tuple(sorted(params.items())))(*fields))
batching.primitive_batchers[mask_bits_p] = _batching
mask_bits_p.def_abstract_eval(_abstract)
mlir.register_lowering(mask_bits_p, _cuda_lowering, platform="cuda")
mlir.register_lowering(mask_bits_p, _reference_lowering)


def _bind_kernel(mod: MaskMod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """The primitive, whatever the backend (the CUDA lowering is the kernel): what mask_bits binds on a GPU."""
    _check_mod(mod)
    generated = generate_mask_mod(mod)  # MaskModCodegenError here, at trace time, for what cannot compile
    bm, hm, _, _ = mask_bits_shape(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    leaves, treedef = jax.tree_util.tree_flatten(mod)
    dtypes = tuple(str(jnp.result_type(leaf)) for leaf in leaves)
    return mask_bits_p.bind(*mask_field_operands(mod), batch=bm, heads=hm, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            source=_Source(generated), treedef=treedef, dtypes=dtypes)


def mask_bits(mod: MaskMod, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """The bitmask from the NVRTC-compiled mask-bits kernel (on a GPU; elsewhere mask_bits_reference). Works
    inside jit. Raises MaskModCodegenError (a NotImplementedError naming the construct) where the mod cannot be
    compiled; a new field value reuses the compiled kernel, a new static() value compiles a new one."""
    _check_mod(mod)
    generate_mask_mod(mod)  # what cannot compile raises on every backend, so CPU tests see what a GPU would
    if jax.default_backend() != "gpu":
        return mask_bits_reference(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    return _bind_kernel(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
