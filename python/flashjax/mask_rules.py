"""How each jax primitive a mask mod may use acts on symbolic values (docs/mask_codegen.md).

``RULES`` maps a primitive's name to ``rule(evaluator, eqn, argument SymArrays) -> output SymArrays``. Every rule
computes exactly what XLA computes for that primitive (flashjax.mask_ops says how for each scalar operation);
structural rules (slices, gathers, reshapes, broadcasts) only move positions, and every read position they produce
lies inside its array, as XLA's clamping makes it. A primitive without a rule, a float value and a loop are
:class:`~flashjax.mask_symbolic.Unsupported`.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import jax
import numpy as np

from flashjax.mask_symbolic import Evaluator, SymArray, Unsupported, graph_dtype

__all__ = ["RULES", "UNSUPPORTED_HINTS", "MAX_UNROLLED_REDUCTION", "first_unsupported"]

# A reduction becomes a chain of nodes per element it reads; past this many it would bloat every kernel thread.
MAX_UNROLLED_REDUCTION = 256

UNSUPPORTED_HINTS = {
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
    return graph_dtype(eqn.outvars[k].aval.dtype)


def _elementwise(op: str):
    def handle(ev: Evaluator, eqn, args):
        return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), lambda *nodes: ev.graph.op(op, *nodes), *args)]
    return handle


def _convert(ev: Evaluator, eqn, args):
    (x,), target = args, _out_dtype(eqn)
    if x.dtype == target:
        return [x]
    op = "to_bool" if target == "bool" else "to_int32"
    return [ev.pointwise(x.shape, target, lambda node: ev.graph.op(op, node), x)]


def _select_case(ev: Evaluator, which: int, cases: list[int], *, clamp: bool) -> int:
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


def _select_n(ev: Evaluator, eqn, args):
    which, *cases = args
    return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), lambda w, *c: _select_case(ev, w, list(c), clamp=True),
                         which, *cases)]


def _clamp(ev: Evaluator, eqn, args):  # lax.clamp(min, x, max) = min(max(x, min), max)
    def clamp(low, x, high):
        return ev.graph.op("min", ev.graph.op("max", x, low), high)
    return [ev.pointwise(_out_shape(eqn), _out_dtype(eqn), clamp, *args)]


def _integer_power(ev: Evaluator, node: int, exponent: int) -> int:
    result, base = ev.int_const(1), node
    while exponent:  # square-and-multiply; wrapping products, as XLA's integer_pow
        if exponent & 1:
            result = ev.graph.op("mul", result, base)
        exponent >>= 1
        if exponent:
            base = ev.graph.op("mul", base, base)
    return result


def _integer_pow(ev: Evaluator, eqn, args):
    exponent = eqn.params["y"]
    if exponent < 0:
        raise Unsupported("integer_pow", f"negative exponent {exponent}")
    return [ev.pointwise(_out_shape(eqn), "int32", lambda n: _integer_power(ev, n, exponent), args[0])]


def _square(ev: Evaluator, eqn, args):
    return [ev.pointwise(_out_shape(eqn), "int32", lambda n: ev.graph.op("mul", n, n), args[0])]


def _identity(ev: Evaluator, eqn, args):
    return list(args)


def _reindexed(ev: Evaluator, eqn, x: SymArray, to_operand: Callable[[tuple[int, ...]], tuple[int, ...]]):
    """The output element at a position is x's element at to_operand(position)."""
    return SymArray(_out_shape(eqn), x.dtype, lambda position: x.element(to_operand(position)))


def _squeeze(ev: Evaluator, eqn, args):
    (x,), dims = args, set(d % len(args[0].shape) for d in eqn.params["dimensions"])

    def to_operand(position):
        rest = iter(position)
        return tuple(ev.int_const(0) if d in dims else next(rest) for d in range(len(x.shape)))
    return [_reindexed(ev, eqn, x, to_operand)]


def _broadcast_in_dim(ev: Evaluator, eqn, args):
    x, dims = args[0], eqn.params["broadcast_dimensions"]
    if len(args) > 1:
        raise Unsupported("broadcast_in_dim", "to a dynamic shape")
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.int_const(0) if n == 1 else position[d] for d, n in zip(dims, x.shape)))]


def _row_major_strides(shape) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _reshape(ev: Evaluator, eqn, args):
    x, out_shape = args[0], _out_shape(eqn)
    if eqn.params.get("dimensions") is not None or len(args) > 1:
        raise Unsupported("reshape", "with a transposition or a dynamic shape")
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


def _transpose(ev: Evaluator, eqn, args):
    (x,), perm = args, eqn.params["permutation"]

    def to_operand(position):
        operand = [None] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            operand[in_axis] = position[out_axis]
        return tuple(operand)
    return [_reindexed(ev, eqn, x, to_operand)]


def _rev(ev: Evaluator, eqn, args):
    (x,), dims = args, set(eqn.params["dimensions"])
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("sub", ev.int_const(n - 1), p) if d in dims else p
        for d, (p, n) in enumerate(zip(position, x.shape))))]


def _slice(ev: Evaluator, eqn, args):
    x, starts = args[0], eqn.params["start_indices"]
    strides = eqn.params["strides"] or (1,) * len(starts)
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("add", ev.int_const(s), ev.graph.op("mul", p, ev.int_const(k)))
        for p, s, k in zip(position, starts, strides)))]


def _dynamic_slice(ev: Evaluator, eqn, args):
    x, *starts = args
    sizes = eqn.params["slice_sizes"]
    # XLA clamps each start so the slice fits: into [0, extent - size].
    clamped = [ev.clamp(s.node, 0, n - size) for s, n, size in zip(starts, x.shape, sizes)]
    return [_reindexed(ev, eqn, x, lambda position: tuple(
        ev.graph.op("add", s, p) for s, p in zip(clamped, position)))]


def _gather(ev: Evaluator, eqn, args):
    """XLA gather for jax's layout (index vector last), in clip / promise_in_bounds mode (starts clamped so the
    slice fits) or fill mode (a slice that does not fit reads the fill value)."""
    operand, indices = args
    dnums, sizes, mode = eqn.params["dimension_numbers"], eqn.params["slice_sizes"], eqn.params["mode"]
    if dnums.operand_batching_dims or dnums.start_indices_batching_dims:
        raise Unsupported("gather", "with batching dimensions")
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
    return [SymArray(_out_shape(eqn), operand.dtype, element)]


def _concatenate(ev: Evaluator, eqn, args):
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
    return [SymArray(_out_shape(eqn), _out_dtype(eqn), element)]


def _iota(ev: Evaluator, eqn, args):
    if _out_dtype(eqn) != "int32":
        raise Unsupported("iota", f"of dtype {eqn.params['dtype']}")
    dimension = eqn.params["dimension"]
    return [SymArray(_out_shape(eqn), "int32", lambda position: position[dimension])]


def _reduction(op: str):
    def handle(ev: Evaluator, eqn, args):
        (x,), axes = args, tuple(eqn.params["axes"])
        count = math.prod(x.shape[a] for a in axes)
        if count > MAX_UNROLLED_REDUCTION:
            raise Unsupported(eqn.primitive.name, f"over {count} elements; the kernels unroll reductions of at most "
                                                   f"{MAX_UNROLLED_REDUCTION}")
        if count == 0:
            raise Unsupported(eqn.primitive.name, "over an empty axis")
        kept = [d for d in range(len(x.shape)) if d not in axes]

        def element(position):
            result = None
            for reduced in itertools.product(*(range(x.shape[a]) for a in axes)):
                full = dict(zip(kept, position)) | {a: ev.int_const(i) for a, i in zip(axes, reduced)}
                value = x.element(tuple(full[d] for d in range(len(x.shape))))
                result = value if result is None else ev.graph.op(op, result, value)
            return result
        return [SymArray(_out_shape(eqn), _out_dtype(eqn), element)]
    return handle


def _open(jaxpr_like):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    return (jaxpr_like.jaxpr, jaxpr_like.consts) if hasattr(jaxpr_like, "consts") else (jaxpr_like, ())


def _call(param: str):
    def handle(ev: Evaluator, eqn, args):
        jaxpr, consts = _open(eqn.params[param])
        return ev.run(jaxpr, consts, args)
    return handle


def _cond(ev: Evaluator, eqn, args):
    """Every branch is evaluated (they are pure, and field reads are clamped) and the index picks the outputs."""
    which, *operands = args
    branch_outs = [ev.run(*_open(branch), operands) for branch in eqn.params["branches"]]
    pick = lambda w, *c: _select_case(ev, w, list(c), clamp=False)
    return [ev.pointwise(_out_shape(eqn, k), _out_dtype(eqn, k), pick, which, *(outs[k] for outs in branch_outs))
            for k in range(len(eqn.outvars))]


RULES: dict[str, Callable] = {name: _elementwise(op) for name, op in _ELEMENTWISE.items()} | {
    "convert_element_type": _convert, "select_n": _select_n, "clamp": _clamp, "integer_pow": _integer_pow,
    "square": _square, "copy": _identity, "copy_p": _identity, "optimization_barrier": _identity,
    "squeeze": _squeeze, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "transpose": _transpose,
    "rev": _rev, "slice": _slice, "dynamic_slice": _dynamic_slice, "gather": _gather, "concatenate": _concatenate,
    "iota": _iota,
    "reduce_and": _reduction("and"), "reduce_or": _reduction("or"), "reduce_max": _reduction("max"),
    "reduce_min": _reduction("min"), "reduce_sum": _reduction("add"),
    "jit": _call("jaxpr"), "pjit": _call("jaxpr"), "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"), "custom_jvp_call": _call("call_jaxpr"), "custom_vjp_call": _call("call_jaxpr"),
    "custom_vjp_call_jaxpr": _call("fun_jaxpr"), "checkpoint": _call("jaxpr"), "remat2": _call("jaxpr"),
    "cond": _cond,
}


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple) else (value,):
            if hasattr(item, "eqns") or hasattr(item, "consts"):
                yield _open(item)[0]


def first_unsupported(jaxpr) -> str | None:
    """The first primitive (depth first, in program order) that has no handler: named before evaluation starts,
    so `jnp.sin(q_idx)` reports 'sin' rather than the int -> float conversion in front of it."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name not in RULES:
            return name
        for sub in _sub_jaxprs(eqn):
            found = first_unsupported(sub)
            if found:
                return found
    return None
