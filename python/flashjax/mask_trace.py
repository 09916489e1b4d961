"""Traces a MaskMod's __call__ into a :class:`~flashjax.mask_graph.MaskGraph` (docs/mask_codegen.md).

``jax.make_jaxpr`` runs the mod on scalar int32 ``b, h, q_idx, kv_idx`` (one element of the grid a kernel thread
evaluates) with the mod's array fields as abstract inputs; static() fields and field shapes are Python values at
that point, so they land in the graph as constants. The jaxpr is then evaluated symbolically: every jaxpr value is
a :class:`_SymArray`, a shape plus a function from an element's position (index nodes) to a scalar graph node, so
array intermediates (``self.ids[b]``, ``self.ids * 2``, ``jnp.asarray(static_tuple)``) cost nothing until an
element is read, and only the elements the scalar result depends on become nodes.

Every primitive handled here computes exactly what XLA computes (flashjax.mask_ops says how, case by case); any
other primitive, any float value and any loop raises :class:`MaskModCodegenError` while tracing, naming it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from flashjax.mask_graph import INDEX_NAMES, ConstTable, FieldSpec, GraphBuilder, MaskGraph
from flashjax.masks import MaskMod

__all__ = ["MaskModCodegenError", "trace_mask_mod", "MAX_FIELDS", "MAX_FIELD_RANK", "MAX_UNROLLED_REDUCTION"]

# The fixed layout of FlashjaxMaskFields (flashjax.mask_emit): one struct serves every mod, so the kernels can take
# it as an ordinary parameter before they know which mod they run.
MAX_FIELDS = 8
MAX_FIELD_RANK = 4
# A reduction becomes a chain of nodes per element it reads; past this many it would bloat every kernel thread.
MAX_UNROLLED_REDUCTION = 256


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


class _Unsupported(Exception):
    """Raised inside the evaluation, turned into MaskModCodegenError with the mod's class name."""

    def __init__(self, construct: str, detail: str = ""):
        super().__init__(construct, detail)
        self.construct, self.detail = construct, detail


def _graph_dtype(dtype) -> str | None:
    dtype = np.dtype(dtype)
    return {np.dtype(np.bool_): "bool", np.dtype(np.int32): "int32"}.get(dtype)


class _SymArray:
    """A jaxpr value: ``element(position)`` gives the scalar node at a position (a tuple of int32 index nodes,
    always inside the shape). A scalar holds its node directly."""

    def __init__(self, shape: tuple[int, ...], dtype: str, element: Callable[[tuple[int, ...]], int]):
        self.shape, self.dtype = tuple(shape), dtype
        self._element, self._memo = element, {}
        self.node = element(()) if not self.shape else None

    @classmethod
    def scalar(cls, node: int, dtype: str) -> "_SymArray":
        return cls((), dtype, lambda position: node)

    def element(self, position: tuple[int, ...]) -> int:
        if not self.shape:
            return self.node
        node = self._memo.get(position)
        if node is None:
            node = self._memo[position] = self._element(position)
        return node


class _Evaluator:
    """Evaluates jaxprs over _SymArrays, appending nodes to one GraphBuilder."""

    def __init__(self):
        self.graph = GraphBuilder()

    # -- values ---------------------------------------------------------------------------------------------------

    def constant(self, value) -> _SymArray:
        array = np.asarray(value)
        dtype = _graph_dtype(array.dtype)
        if dtype is None:
            raise _Unsupported(f"a {array.dtype} constant", "the kernels compute on int32 and bool only")
        if array.ndim == 0:
            return _SymArray.scalar(self.graph.const(array.item(), dtype), dtype)
        table = ConstTable(array.shape, dtype, tuple(int(v) for v in array.reshape(-1)))
        read = lambda position: self._as_dtype(self.graph.table(table, position), dtype)
        return _SymArray(array.shape, dtype, read)

    def _as_dtype(self, int_node: int, dtype: str) -> int:
        return self.graph.op("to_bool", int_node) if dtype == "bool" and self.graph.dtype(int_node) == "int32" \
            else int_node

    def int_const(self, value: int) -> int:
        return self.graph.const(value, "int32")

    def clamp(self, node: int, low: int, high: int) -> int:
        return self.graph.op("min", self.graph.op("max", node, self.int_const(low)), self.int_const(high))

    def pointwise(self, shape, dtype, fn, *args: _SymArray) -> _SymArray:
        """fn applied to the elements at one position of every argument (rank-0 arguments broadcast)."""
        def element(position):
            return fn(*(a.element(position if a.shape else ()) for a in args))
        return _SymArray(shape, dtype, element)

    # -- jaxprs ---------------------------------------------------------------------------------------------------

    def run(self, jaxpr, consts, args: list[_SymArray]) -> list[_SymArray]:
        env = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = self.constant(value)
        for var, value in zip(jaxpr.invars, args):
            env[var] = value

        def read(atom):
            if isinstance(atom, jax.extend.core.Literal):  # its value may be a Python scalar: the aval has the dtype
                return self.constant(np.asarray(atom.val, dtype=atom.aval.dtype))
            return env[atom]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            for out in eqn.outvars:
                if _graph_dtype(out.aval.dtype) is None:
                    raise _Unsupported(name, f"it makes {out.aval.dtype} values; the kernels compute on int32 and "
                                             "bool only, and an int -> float -> int round trip is not exact for every "
                                             "int32")
            handler = _HANDLERS.get(name)
            if handler is None:
                raise _Unsupported(name, _UNSUPPORTED_HINTS.get(name, ""))
            try:
                outs = handler(self, eqn, [read(a) for a in eqn.invars])
            except TypeError as e:  # an operation given dtypes it does not take (e.g. add on bool)
                raise _Unsupported(name, str(e)) from e
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]


_UNSUPPORTED_HINTS = {
    "while": "a loop", "scan": "a loop", "fori_loop": "a loop",
    "sort": "sorting", "cumsum": "a scan over an array", "argmax": "an arg-reduction", "argmin": "an arg-reduction",
    "scatter": "an array update", "scatter-add": "an array update", "dynamic_update_slice": "an array update",
}

# jax primitive -> graph op, for the elementwise primitives that map one to one.
_ELEMENTWISE = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "rem": "rem", "neg": "neg", "abs": "abs",
    "sign": "sign", "max": "max", "min": "min", "and": "and", "or": "or", "xor": "xor", "not": "not",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "shift_left": "shl", "shift_right_arithmetic": "shr_arithmetic", "shift_right_logical": "shr_logical",
}


def _out_shape(eqn, k: int = 0) -> tuple[int, ...]:
    return tuple(eqn.outvars[k].aval.shape)


def _out_dtype(eqn, k: int = 0) -> str:
    return _graph_dtype(eqn.outvars[k].aval.dtype)


def _elementwise(op: str):
    def handle(ev: _Evaluator, eqn, args):
        return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), lambda *nodes: ev.graph.op(op, *nodes), *args)]
    return handle


def _convert(ev: _Evaluator, eqn, args):
    (x,), target = args, _out_dtype(eqn)
    if x.dtype == target:
        return [x]
    op = "to_bool" if target == "bool" else "to_int32"
    return [ev.pointwise(x.shape, target, lambda node: ev.graph.op(op, node), x)]


def _select_case(ev: _Evaluator, which: int, cases: list[int], *, clamp: bool) -> int:
    """cases[which]. A bool `which` picks (false, true). An int32 one out of range picks the nearer end with
    clamp (select_n lowers to a tree of `which < k` tests) or else the last case (XLA's conditional)."""
    if len(cases) == 1:
        return cases[0]
    if ev.graph.dtype(which) == "bool":
        return ev.graph.op("select", which, cases[0], cases[1])
    if clamp:
        which = ev.clamp(which, 0, len(cases) - 1)
    result = cases[-1]
    for k in range(len(cases) - 2, -1, -1):
        result = ev.graph.op("select", ev.graph.op("eq", which, ev.int_const(k)), result, cases[k])
    return result


def _select_n(ev: _Evaluator, eqn, args):
    which, *cases = args
    return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), lambda w, *c: _select_case(ev, w, list(c), clamp=True),
                         which, *cases)]


def _clamp(ev: _Evaluator, eqn, args):  # lax.clamp(min, x, max) = min(max(x, min), max)
    def clamp(low, x, high):
        return ev.graph.op("min", ev.graph.op("max", x, low), high)
    return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), clamp, *args)]


def _integer_power(ev: _Evaluator, node: int, exponent: int) -> int:
    result, base = ev.int_const(1), node
    while exponent:  # square-and-multiply; wrapping products, as XLA's integer_pow
        if exponent & 1:
            result = ev.graph.op("mul", result, base)
        exponent >>= 1
        if exponent:
            base = ev.graph.op("mul", base, base)
    return result


def _integer_pow(ev: _Evaluator, eqn, args):
    exponent = eqn.params["y"]
    if exponent < 0:
        raise _Unsupported("integer_pow", f"negative exponent {exponent}")
    return [ev.pointwise(_out_shape(eqn), "int32", lambda n: _integer_power(ev, n, exponent), args[0])]


def _square(ev: _Evaluator, eqn, args):
    return [ev.pointwise(_out_shape(eqn), "int32", lambda n: ev.graph.op("mul", n, n), args[0])]


def _identity(ev: _Evaluator, eqn, args):
    return list(args)


def _reindexed(ev: _Evaluator, eqn, x: _SymArray, to_operand: Callable[[tuple[int, ...]], tuple[int, ...]]):
    """The output element at a position is x's element at to_operand(position)."""
    return _SymArray(_out_shape(eqn), x.dtype, lambda position: x.element(to_operand(position)))


def _squeeze(ev: _Evaluator, eqn, args):
    (x,), dims = args, set(d % len(args[0].shape) for d in eqn.params["dimensions"])

    def to_operand(position):
        rest = iter(position)
        return tuple(ev.int_const(0) if d in dims else next(rest) for d in range(len(x.shape)))
    return [_reindexed(ev, eqn, x, to_operand)]


def _broadcast_in_dim(ev: _Evaluator, eqn, args):
    x, dims = args[0], eqn.params["broadcast_dimensions"]
    if len(args) > 1:
        raise _Unsupported("broadcast_in_dim", "to a dynamic shape")
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.int_const(0) if n == 1 else position[d] for d, n in zip(dims, x.shape)))]


def _row_major_strides(shape) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _reshape(ev: _Evaluator, eqn, args):
    x, out_shape = args[0], _out_shape(eqn)
    if eqn.params.get("dimensions") is not None or len(args) > 1:
        raise _Unsupported("reshape", "with a transposition or a dynamic shape")
    out_axes = [d for d, n in enumerate(out_shape) if n != 1]
    in_axes = [d for d, n in enumerate(x.shape) if n != 1]
    if [out_shape[d] for d in out_axes] == [x.shape[d] for d in in_axes]:  # only unit axes added or removed
        def to_operand(position):
            moved = dict(zip(in_axes, (position[d] for d in out_axes)))
            return tuple(moved.get(d, ev.int_const(0)) for d in range(len(x.shape)))
        return [_reindexed(ev, eqn, x, to_operand)]

    def linear_to_operand(position):  # row-major flat offset, split over the operand's axes (in range: exact)
        flat = ev.int_const(0)
        for node, stride in zip(position, _row_major_strides(out_shape)):
            flat = ev.graph.op("add", flat, ev.graph.op("mul", node, ev.int_const(stride)))
        return tuple(ev.graph.op("rem", ev.graph.op("div", flat, ev.int_const(stride)), ev.int_const(n))
                     for stride, n in zip(_row_major_strides(x.shape), x.shape))
    return [_reindexed(ev, eqn, x, linear_to_operand)]


def _transpose(ev: _Evaluator, eqn, args):
    (x,), perm = args, eqn.params["permutation"]

    def to_operand(position):
        operand = [None] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            operand[in_axis] = position[out_axis]
        return tuple(operand)
    return [_reindexed(ev, eqn, x, to_operand)]


def _rev(ev: _Evaluator, eqn, args):
    (x,), dims = args, set(eqn.params["dimensions"])
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("sub", ev.int_const(n - 1), p) if d in dims else p
        for d, (p, n) in enumerate(zip(position, x.shape))))]


def _slice(ev: _Evaluator, eqn, args):
    x, starts = args[0], eqn.params["start_indices"]
    strides = eqn.params["strides"] or (1,) * len(starts)
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("add", ev.int_const(s), ev.graph.op("mul", p, ev.int_const(k)))
        for p, s, k in zip(position, starts, strides)))]


def _dynamic_slice(ev: _Evaluator, eqn, args):
    x, *starts = args
    sizes = eqn.params["slice_sizes"]
    # XLA clamps each start so the slice fits: into [0, extent - size].
    clamped = [ev.clamp(s.node, 0, n - size) for s, n, size in zip(starts, x.shape, sizes)]
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("add", s, p) for s, p in zip(clamped, position)))]


def _gather(ev: _Evaluator, eqn, args):
    """XLA gather for jax's layout (index vector last), in clip / promise_in_bounds mode (starts clamped so the
    slice fits) or fill mode (a slice that does not fit reads the fill value)."""
    operand, indices = args
    dnums, sizes, mode = eqn.params["dimension_numbers"], eqn.params["slice_sizes"], eqn.params["mode"]
    if dnums.operand_batching_dims or dnums.start_indices_batching_dims:
        raise _Unsupported("gather", "with batching dimensions")
    out_rank = len(_out_shape(eqn))
    batch_axes = [d for d in range(out_rank) if d not in dnums.offset_dims]
    window_axes = [d for d in range(len(operand.shape)) if d not in dnums.collapsed_slice_dims]
    fill = mode == jax.lax.GatherScatterMode.FILL_OR_DROP
    if fill:
        fill_value = eqn.params["fill_value"]
        if fill_value is None:  # jax's default fill: the dtype's minimum for int32, True for bool
            fill_value = True if operand.dtype == "bool" else np.iinfo(np.int32).min
        fill_node = ev.graph.const(fill_value, operand.dtype)

    def element(position):
        batch = tuple(position[d] for d in batch_axes)
        starts = [ev.int_const(0)] * len(operand.shape)
        in_bounds = ev.graph.const(True, "bool")
        for k, axis in enumerate(dnums.start_index_map):
            start = indices.element(batch + (ev.int_const(k),))
            high = operand.shape[axis] - sizes[axis]
            if fill:
                fits = ev.graph.op("and", ev.graph.op("ge", start, ev.int_const(0)),
                                   ev.graph.op("le", start, ev.int_const(high)))
                in_bounds = ev.graph.op("and", in_bounds, fits)
            starts[axis] = ev.clamp(start, 0, high)
        for axis, out_axis in zip(window_axes, dnums.offset_dims):
            starts[axis] = ev.graph.op("add", starts[axis], position[out_axis])
        value = operand.element(tuple(starts))
        return ev.graph.op("select", in_bounds, fill_node, value) if fill else value
    return [_SymArray(_out_shape(eqn), operand.dtype, element)]


def _concatenate(ev: _Evaluator, eqn, args):
    axis = eqn.params["dimension"]
    offsets = list(itertools.accumulate((a.shape[axis] for a in args), initial=0))

    def element(position):
        def part(k):
            local = ev.clamp(ev.graph.op("sub", position[axis], ev.int_const(offsets[k])), 0, args[k].shape[axis] - 1)
            return args[k].element(position[:axis] + (local,) + position[axis + 1:])
        result = part(len(args) - 1)
        for k in range(len(args) - 2, -1, -1):
            result = ev.graph.op("select", ev.graph.op("lt", position[axis], ev.int_const(offsets[k + 1])),
                                 result, part(k))
        return result
    return [_SymArray(_out_shape(eqn), _out_dtype(eqn), element)]


def _iota(ev: _Evaluator, eqn, args):
    if _out_dtype(eqn) != "int32":
        raise _Unsupported("iota", f"of dtype {eqn.params['dtype']}")
    dimension = eqn.params["dimension"]
    return [_SymArray(_out_shape(eqn), "int32", lambda position: position[dimension])]


def _reduction(op: str):
    def handle(ev: _Evaluator, eqn, args):
        (x,), axes = args, tuple(eqn.params["axes"])
        count = math.prod(x.shape[a] for a in axes)
        if count > MAX_UNROLLED_REDUCTION:
            raise _Unsupported(eqn.primitive.name, f"over {count} elements; the kernels unroll reductions of at most "
                                                   f"{MAX_UNROLLED_REDUCTION}")
        if count == 0:
            raise _Unsupported(eqn.primitive.name, "over an empty axis")
        kept = [d for d in range(len(x.shape)) if d not in axes]

        def element(position):
            result = None
            for reduced in itertools.product(*(range(x.shape[a]) for a in axes)):
                full = dict(zip(kept, position)) | {a: ev.int_const(i) for a, i in zip(axes, reduced)}
                value = x.element(tuple(full[d] for d in range(len(x.shape))))
                result = value if result is None else ev.graph.op(op, result, value)
            return result
        return [_SymArray(_out_shape(eqn), _out_dtype(eqn), element)]
    return handle


def _open(jaxpr_like):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    return (jaxpr_like.jaxpr, jaxpr_like.consts) if hasattr(jaxpr_like, "consts") else (jaxpr_like, ())


def _call(param: str):
    def handle(ev: _Evaluator, eqn, args):
        jaxpr, consts = _open(eqn.params[param])
        return ev.run(jaxpr, consts, args)
    return handle


def _cond(ev: _Evaluator, eqn, args):
    """Every branch is evaluated (they are pure, and field reads are clamped) and the index picks the outputs."""
    which, *operands = args
    branch_outs = [ev.run(*_open(branch), operands) for branch in eqn.params["branches"]]
    pick = lambda w, *c: _select_case(ev, w, list(c), clamp=False)
    return [ev.pointwise(_out_shape(eqn, k), _out_dtype(eqn, k), pick, which, *(outs[k] for outs in branch_outs))
            for k in range(len(eqn.outvars))]


_HANDLERS: dict[str, Callable] = {name: _elementwise(op) for name, op in _ELEMENTWISE.items()} | {
    "convert_element_type": _convert, "select_n": _select_n, "clamp": _clamp, "integer_pow": _integer_pow,
    "square": _square, "copy": _identity, "copy_p": _identity, "optimization_barrier": _identity,
    "squeeze": _squeeze, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "transpose": _transpose,
    "rev": _rev, "slice": _slice, "dynamic_slice": _dynamic_slice, "gather": _gather, "concatenate": _concatenate,
    "iota": _iota,
    "reduce_and": _reduction("and"), "reduce_or": _reduction("or"), "reduce_max": _reduction("max"),
    "reduce_min": _reduction("min"), "reduce_sum": _reduction("add"),
    "jit": _call("jaxpr"), "pjit": _call("jaxpr"), "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"), "custom_jvp_call": _call("call_jaxpr"), "custom_vjp_call": _call("call_jaxpr"),
    "custom_vjp_call_jaxpr": _call("fun_jaxpr"), "checkpoint": _call("jaxpr"), "remat": _call("jaxpr"),
    "cond": _cond,
}


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple) else (value,):
            if hasattr(item, "eqns") or hasattr(item, "consts"):
                yield _open(item)[0]


def _first_unsupported(jaxpr) -> str | None:
    """The first primitive (depth first, in program order) that has no handler: named before evaluation starts,
    so `jnp.sin(q_idx)` reports 'sin' rather than the int -> float conversion in front of it."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name not in _HANDLERS:
            return name
        for sub in _sub_jaxprs(eqn):
            found = _first_unsupported(sub)
            if found:
                return found
    return None


def _field_specs(mod: MaskMod, class_name: str):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(mod)
    specs = []
    for path, leaf in leaves_with_paths:
        name = jax.tree_util.keystr(path).lstrip(".")
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf))
        if _graph_dtype(dtype) is None:
            raise MaskModCodegenError(class_name, f"field {name} of dtype {dtype}", "array fields must be int32 or bool")
        if np.ndim(leaf) > MAX_FIELD_RANK:
            raise MaskModCodegenError(class_name, f"field {name} of rank {np.ndim(leaf)}",
                                      f"the kernels take fields of rank <= {MAX_FIELD_RANK}")
        specs.append(FieldSpec(name, tuple(int(n) for n in np.shape(leaf)), _graph_dtype(dtype)))
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
    unsupported = _first_unsupported(closed.jaxpr)
    if unsupported:
        raise MaskModCodegenError(class_name, unsupported, _UNSUPPORTED_HINTS.get(unsupported, ""))

    ev = _Evaluator()
    fields = [_field_input(ev, position, spec) for position, spec in enumerate(specs)]
    indices = [_SymArray.scalar(ev.graph.index(name), "int32") for name in INDEX_NAMES]
    try:
        (result,) = ev.run(closed.jaxpr, closed.consts, fields + indices)
        output = _result_node(ev, result)
    except _Unsupported as e:
        raise MaskModCodegenError(class_name, e.construct, e.detail) from None
    return MaskGraph(f"{type(mod).__module__}.{class_name}", tuple(specs), tuple(ev.graph.nodes), output)


def _field_input(ev: _Evaluator, position: int, spec: FieldSpec) -> _SymArray:
    read = lambda indices: ev._as_dtype(ev.graph.field(position, indices), spec.dtype)
    return _SymArray(spec.shape, spec.dtype, read)


def _result_node(ev: _Evaluator, result: _SymArray) -> int:
    """The predicate's bool node; a one-element result broadcasts (as in the reference), an int result is taken as
    bool (as the reference's astype(bool) does)."""
    if math.prod(result.shape) != 1:
        raise _Unsupported(f"a result of shape {result.shape}", "the predicate must give one value per index tuple")
    node = result.element(tuple(ev.int_const(0) for _ in result.shape))
    return ev.graph.op("to_bool", node) if ev.graph.dtype(node) == "int32" else node
