"""Traces a MaskMod's __call__ into a :class:`~flashjax.mask_graph.MaskGraph` (docs/mask_codegen.md).

``jax.make_jaxpr`` runs the mod on scalar int32 ``b, h, q_idx, kv_idx`` (one element of the grid a kernel thread
evaluates) with the mod's array fields as abstract inputs; static() fields and field shapes are Python values at
that point, so they land in the graph as constants. The jaxpr is then evaluated symbolically
(flashjax.mask_symbolic, with the primitive rules of flashjax.mask_rules), which computes exactly what XLA
computes; any other primitive, any float value and any loop raises :class:`MaskModCodegenError` while tracing,
naming it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from flashjax.mask_graph import INDEX_NAMES, FieldSpec, MaskGraph
from flashjax.mask_rules import RULES, UNSUPPORTED_HINTS, first_unsupported
from flashjax.mask_symbolic import Evaluator, SymArray, Unsupported, graph_dtype
from flashjax.masks import MaskMod

__all__ = ["MaskModCodegenError", "trace_mask_mod", "MAX_FIELDS", "MAX_FIELD_RANK"]

# The fixed layout of FlashjaxMaskFields (flashjax.mask_emit): one struct serves every mod, so the kernels can take
# it as an ordinary parameter before they know which mod they run.
MAX_FIELDS = 8
MAX_FIELD_RANK = 4


class MaskModCodegenError(NotImplementedError):
    """A mask mod uses something the kernels cannot compile (a primitive, a float value, a loop, a field layout).

    A NotImplementedError: the mod is valid, the reference runs it, only the kernel path lacks the construct; the
    dispatch catches it and falls back to the reference. ``mod_class`` and ``construct`` name the two.
    """

    def __init__(self, mod_class: str, construct: str, detail: str = ""):
        self.mod_class, self.construct = mod_class, construct
        detail = f" ({detail})" if detail else ""
        super().__init__(f"flashjax: mask mod {mod_class} uses '{construct}'{detail}, which the kernels cannot "
                         f'compile; use backend="reference"')


def _field_specs(mod: MaskMod, class_name: str):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(mod)
    specs = []
    for path, leaf in leaves_with_paths:
        name = jax.tree_util.keystr(path).lstrip(".")
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf))
        if graph_dtype(dtype) is None:
            raise MaskModCodegenError(class_name, f"field {name} of dtype {dtype}", "array fields must be int32 or bool")
        if np.ndim(leaf) > MAX_FIELD_RANK:
            raise MaskModCodegenError(class_name, f"field {name} of rank {np.ndim(leaf)}",
                                      f"the kernels take fields of rank <= {MAX_FIELD_RANK}")
        specs.append(FieldSpec(name, tuple(int(n) for n in np.shape(leaf)), graph_dtype(dtype)))
    if len(specs) > MAX_FIELDS:
        raise MaskModCodegenError(class_name, f"{len(specs)} array fields", f"the kernels take <= {MAX_FIELDS}")
    return specs, treedef


def trace_mask_mod(mod: MaskMod) -> MaskGraph:
    """The expression graph of ``mod(b, h, q_idx, kv_idx)`` for scalar int32 indices; raises MaskModCodegenError
    (naming the construct and the mod's class) where the kernels cannot compile the mod."""
    if not isinstance(mod, MaskMod):
        raise TypeError(f"trace_mask_mod takes a flashjax MaskMod, got {type(mod).__qualname__}")
    class_name = type(mod).__qualname__
    mod.static_key()  # static() fields must be hashable: they key the generated source's caches
    specs, treedef = _field_specs(mod, class_name)

    def predicate(leaves, b, h, q_idx, kv_idx):
        return jax.tree_util.tree_unflatten(treedef, leaves)(b, h, q_idx, kv_idx)

    index = jax.ShapeDtypeStruct((), jnp.int32)
    leaves = [jax.ShapeDtypeStruct(s.shape, jnp.bool_ if s.dtype == "bool" else jnp.int32) for s in specs]
    try:
        closed = jax.make_jaxpr(predicate)(leaves, index, index, index, index)
    except Exception as e:  # the reference passes broadcast index arrays; a mod may need those to trace
        raise MaskModCodegenError(class_name, "its __call__ on scalar indices",
                                  f"tracing it raised {type(e).__name__}: {e}") from e
    unsupported = first_unsupported(closed.jaxpr)
    if unsupported:
        raise MaskModCodegenError(class_name, unsupported, UNSUPPORTED_HINTS.get(unsupported, ""))

    ev = Evaluator(RULES)
    fields = [_field_input(ev, position, spec) for position, spec in enumerate(specs)]
    indices = [SymArray.scalar(ev.graph.index(name), "int32") for name in INDEX_NAMES]
    try:
        (result,) = ev.run(closed.jaxpr, closed.consts, fields + indices)
        output = _result_node(ev, result)
    except Unsupported as e:
        raise MaskModCodegenError(class_name, e.construct, e.detail) from None
    return MaskGraph(f"{type(mod).__module__}.{class_name}", tuple(specs), tuple(ev.graph.nodes), output)


def _field_input(ev: Evaluator, position: int, spec: FieldSpec) -> SymArray:
    read = lambda indices: ev.as_dtype(ev.graph.field(position, indices), spec.dtype)
    return SymArray(spec.shape, spec.dtype, read)


def _result_node(ev: Evaluator, result: SymArray) -> int:
    """The predicate's bool node; a one-element result broadcasts (as in the reference), an int result is taken as
    bool (as the reference's astype(bool) does)."""
    if math.prod(result.shape) != 1:
        raise Unsupported(f"a result of shape {result.shape}", "the predicate must give one value per index tuple")
    node = result.element(tuple(ev.int_const(0) for _ in result.shape))
    return ev.graph.op("to_bool", node) if ev.graph.dtype(node) == "int32" else node
