"""Mask mods as device code: MaskMod -> expression graph -> C++ predicate -> NVRTC binary (docs/mask_codegen.md).

    generated = generate_mask_mod(mod)          # trace + emit; MaskModCodegenError where the kernels cannot
    generated.source, generated.source_hash     # deterministic C++; sha256 over it and the flashjax version
    operands = mask_field_operands(mod)         # the array fields, int32, in the order f.field[k] reads them
    binary = compile_mask_mod(generated, arch="sm_90")   # NVRTC, through the disk cache

A mod's generated source depends on its class, its static() values and its fields' shapes, never on the fields'
values: new values reuse the compiled code, a new static value compiles new code. The pieces live in
flashjax.mask_trace (tracing, the error), mask_graph (the graph), mask_ops (each operation's exact meaning),
mask_emit (C++), mask_interpret (numpy evaluation, for tests), nvrtc and kernel_cache; mask_bits_emit and
mask_bits turn a mod into the bitmask the attention kernels read (the mask-bits kernel).
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp

from flashjax.kernel_cache import CachedBinary, compile_cached, flashjax_version
from flashjax.mask_emit import DEFAULT_FUNCTION_NAME, emit_mask_mod_source, probe_kernel_source
from flashjax.mask_graph import MaskGraph
from flashjax.mask_interpret import evaluate_mask_graph
from flashjax.mask_trace import MaskModCodegenError, trace_mask_mod
from flashjax.masks import MaskMod

__all__ = [
    "GeneratedMaskMod", "MaskModCodegenError", "generate_mask_mod", "mask_source_hash", "mask_field_operands",
    "compile_mask_mod", "trace_mask_mod", "emit_mask_mod_source", "evaluate_mask_graph", "probe_kernel_source",
]


@dataclasses.dataclass(frozen=True)
class GeneratedMaskMod:
    graph: MaskGraph
    function_name: str
    source: str  # the predicate and the field layout (flashjax.mask_emit)
    source_hash: str  # mask_source_hash(source): the key of everything compiled from it


def mask_source_hash(source: str, *, version: str | None = None) -> str:
    """sha256 (hex) of the flashjax version and a generated source: equal for equal code from equal releases."""
    version = flashjax_version() if version is None else version
    return hashlib.sha256(f"flashjax {version}\n{source}".encode()).hexdigest()


def _trace_key(mod: MaskMod) -> tuple:
    """What the generated source is a function of: the class object, its static values, the fields' shapes and
    dtypes. The class object, not its name, so a class redefined under the same name (a notebook) traces anew."""
    leaves, treedef = jax.tree_util.tree_flatten(mod)
    return type(mod), treedef, tuple((tuple(jnp.shape(x)), str(jnp.result_type(x))) for x in leaves)


_generated: dict[tuple, GeneratedMaskMod] = {}


def generate_mask_mod(mod: MaskMod, *, function_name: str = DEFAULT_FUNCTION_NAME) -> GeneratedMaskMod:
    """The traced graph and generated C++ of ``mod`` (cached per class, static values and field shapes). Raises
    MaskModCodegenError (a NotImplementedError naming the construct) where the kernels cannot compile the mod."""
    if not isinstance(mod, MaskMod):
        raise TypeError(f"generate_mask_mod takes a flashjax MaskMod, got {type(mod).__qualname__}")
    mod.static_key()  # unhashable static values raise their TypeError here, before they reach the cache key
    key = (_trace_key(mod), function_name)
    generated = _generated.get(key)
    if generated is None:
        graph = trace_mask_mod(mod)
        source = emit_mask_mod_source(graph, function_name=function_name)
        generated = _generated[key] = GeneratedMaskMod(graph, function_name, source, mask_source_hash(source))
    return generated


def mask_field_operands(mod: MaskMod) -> tuple[jax.Array, ...]:
    """The mod's array fields as int32 arrays (bool fields as 0 / 1), in the order of the graph's fields and of
    FlashjaxMaskFields::field: the extra operands a kernel call takes."""
    return tuple(jnp.asarray(leaf).astype(jnp.int32) for leaf in jax.tree_util.tree_leaves(mod))


def compile_mask_mod(generated: GeneratedMaskMod, *, arch: str = "sm_90", kernel_source: str | None = None,
                     options: tuple[str, ...] = ()) -> CachedBinary:
    """NVRTC's binary of the predicate followed by ``kernel_source`` (by default the probe kernel that evaluates
    it over an index grid), through the disk cache (flashjax.kernel_cache).

    Call it while lowering or instantiating the FFI handler, never from an execute handler: a cache miss runs
    NVRTC (tens to hundreds of ms).
    """
    tail = probe_kernel_source(generated.function_name) if kernel_source is None else kernel_source
    return compile_cached(generated.source + tail, arch=arch, options=options,
                          name=f"{generated.function_name}_{generated.source_hash[:12]}.cu")
