"""Symbolic evaluation of a jaxpr into a mask-mod expression graph (docs/mask_codegen.md).

Every jaxpr value is a :class:`SymArray`: a shape plus a function from an element's position (a tuple of int32
index nodes) to a scalar graph node. Array intermediates (``self.ids[b]``, ``self.ids * 2``,
``jnp.asarray(static_tuple)``) therefore cost nothing until an element is read, and only the elements the scalar
result depends on become nodes. What each primitive does to SymArrays is in flashjax.mask_rules.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.extend
import numpy as np

from flashjax.mask_graph import ConstTable, GraphBuilder, OperandDtypeError

__all__ = ["Unsupported", "graph_dtype", "SymArray", "Evaluator", "MAX_TABLE_ELEMENTS"]

# A constant array read at a run-time position becomes a table in the generated source; a larger one belongs in an
# array field (run-time data), not in the code.
MAX_TABLE_ELEMENTS = 4096


class Unsupported(Exception):
    """A construct the kernels cannot compile, met while evaluating; flashjax.mask_trace turns it into a
    MaskModCodegenError naming the mod's class."""

    def __init__(self, construct: str, detail: str = ""):
        super().__init__(construct, detail)
        self.construct, self.detail = construct, detail


def graph_dtype(dtype) -> str | None:
    dtype = np.dtype(dtype)
    return {np.dtype(np.bool_): "bool", np.dtype(np.int32): "int32"}.get(dtype)


class SymArray:
    """A jaxpr value: ``element(position)`` gives the scalar node at a position (a tuple of int32 index nodes,
    always inside the shape). A scalar holds its node directly."""

    def __init__(self, shape: tuple[int, ...], dtype: str, element: Callable[[tuple[int, ...]], int]):
        self.shape, self.dtype = tuple(shape), dtype
        self._element, self._memo = element, {}
        self.node = element(()) if not self.shape else None

    @classmethod
    def scalar(cls, node: int, dtype: str) -> "SymArray":
        return cls((), dtype, lambda position: node)

    def element(self, position: tuple[int, ...]) -> int:
        if not self.shape:
            return self.node
        node = self._memo.get(position)
        if node is None:
            node = self._memo[position] = self._element(position)
        return node


class Evaluator:
    """Evaluates jaxprs over SymArrays, appending nodes to one GraphBuilder; ``rules`` maps a primitive's name to
    ``rule(evaluator, eqn, argument SymArrays) -> output SymArrays`` (flashjax.mask_rules)."""

    def __init__(self, rules: dict[str, Callable]):
        self.graph = GraphBuilder()
        self.rules = rules

    # -- values ---------------------------------------------------------------------------------------------------

    def constant(self, value) -> SymArray:
        array = np.asarray(value)
        dtype = graph_dtype(array.dtype)
        if dtype is None:
            raise Unsupported(f"a {array.dtype} constant", "the kernels compute on int32 and bool only")
        if array.ndim == 0:
            return SymArray.scalar(self.graph.const(array.item(), dtype), dtype)
        table = []  # the ConstTable, made on the first read

        def read(position):
            if array.size > MAX_TABLE_ELEMENTS and not all(self.graph.is_const(p) for p in position):
                raise Unsupported(f"a constant array of {array.size} elements",
                                  f"the generated code holds at most {MAX_TABLE_ELEMENTS}; pass it as an array field")
            if not table:
                table.append(ConstTable(array.shape, dtype, tuple(int(v) for v in array.reshape(-1))))
            return self.as_dtype(self.graph.table(table[0], position), dtype)
        return SymArray(array.shape, dtype, read)

    def as_dtype(self, int_node: int, dtype: str) -> int:
        return self.graph.op("to_bool", int_node) if dtype == "bool" and self.graph.dtype(int_node) == "int32" \
            else int_node

    def int_const(self, value: int) -> int:
        return self.graph.const(value, "int32")

    def clamp(self, node: int, low: int, high: int) -> int:
        return self.graph.op("min", self.graph.op("max", node, self.int_const(low)), self.int_const(high))

    def pointwise(self, shape, dtype, fn, *args: SymArray) -> SymArray:
        """fn applied to the elements at one position of every argument (rank-0 arguments broadcast)."""
        def element(position):
            return fn(*(a.element(position if a.shape else ()) for a in args))
        return SymArray(shape, dtype, element)

    # -- jaxprs ---------------------------------------------------------------------------------------------------

    def run(self, jaxpr, consts, args: list[SymArray]) -> list[SymArray]:
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
                if graph_dtype(out.aval.dtype) is None:
                    raise Unsupported(name, f"it makes {out.aval.dtype} values; the kernels compute on int32 and "
                                             "bool only, and an int -> float -> int round trip is not exact for every "
                                             "int32")
            handler = self.rules.get(name)
            if handler is None:
                raise Unsupported(name)
            try:
                outs = handler(self, eqn, [read(a) for a in eqn.invars])
            except OperandDtypeError as e:
                raise Unsupported(name, str(e)) from e
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]
