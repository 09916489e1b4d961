"""The expression graph a mask mod traces into (docs/mask_codegen.md): scalar nodes in topological order.

Node kinds (``Node.op``):

- ``const``: an int32 or bool constant, ``attr`` its value;
- ``index``: one of the predicate's arguments, ``attr`` one of ``INDEX_NAMES``;
- ``field``: element ``args`` (int32 index nodes, one per axis) of the mod's array field number ``attr``, read as
  int32 (a bool field holds 0/1); each index is clamped into [0, extent), so no index expression can read outside
  the field (jnp's own indexing clamps the same way, and the graph carries jnp's explicit negative-index wrap);
- ``table``: the same read from a constant array baked into the graph (``attr`` a :class:`ConstTable`), e.g.
  ``jnp.asarray(self.some_static_tuple)[h]``;
- every name in :data:`flashjax.mask_ops.OPS`: an operation on the ``args`` nodes.

The builder interns nodes (equal nodes are one node), folds operations on constants with the same numpy code the
interpreter runs, and applies a few exact identities (x + 0, select on a constant predicate, ...), so the graph of
a built-in mask is as small as the expression a person would write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flashjax.mask_ops import OPS

__all__ = ["INDEX_NAMES", "Node", "FieldSpec", "ConstTable", "MaskGraph", "GraphBuilder", "OperandDtypeError"]

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
DTYPES = ("bool", "int32")


@dataclasses.dataclass(frozen=True)
class Node:
    op: str
    dtype: str  # "bool" or "int32"
    args: tuple[int, ...] = ()
    attr: Any = None


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One array field of the mod, in pytree-leaf order: its path in the mod (e.g. ``doc_ids``), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "int32" or "bool"; both travel to the kernels as int32


@dataclasses.dataclass(frozen=True)
class ConstTable:
    """A constant int32/bool array of the trace, row-major."""

    shape: tuple[int, ...]
    dtype: str
    values: tuple[int, ...]

    def array(self) -> np.ndarray:
        return np.asarray(self.values, dtype=np.bool_ if self.dtype == "bool" else np.int32).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class MaskGraph:
    """A mask mod's predicate: ``nodes[output]`` (bool) as a function of the indices and the fields."""

    mod_class: str  # module.qualname of the mod's class
    fields: tuple[FieldSpec, ...]
    nodes: tuple[Node, ...]
    output: int

    def reachable(self) -> list[int]:
        """The ids of the nodes the output depends on, in increasing (topological) order."""
        seen, stack = set(), [self.output]
        while stack:
            node_id = stack.pop()
            if node_id not in seen:
                seen.add(node_id)
                stack.extend(self.nodes[node_id].args)
        return sorted(seen)


def _numpy_value(node: Node) -> np.ndarray:
    return np.asarray(node.attr, dtype=np.bool_ if node.dtype == "bool" else np.int32)


class GraphBuilder:
    """Appends interned, folded nodes; ids are positions in ``nodes``."""

    def __init__(self):
        self.nodes: list[Node] = []
        self._ids: dict[Node, int] = {}

    def _intern(self, node: Node) -> int:
        node_id = self._ids.get(node)
        if node_id is None:
            node_id = self._ids[node] = len(self.nodes)
            self.nodes.append(node)
        return node_id

    def const(self, value, dtype: str) -> int:
        if dtype not in DTYPES:
            raise ValueError(f"graph constants are bool or int32, got {dtype}")
        return self._intern(Node("const", dtype, attr=bool(value) if dtype == "bool" else int(np.int32(value))))

    def index(self, name: str) -> int:
        return self._intern(Node("index", "int32", attr=name))

    def field(self, position: int, indices: tuple[int, ...]) -> int:
        return self._intern(Node("field", "int32", tuple(indices), position))

    def table(self, table: ConstTable, indices: tuple[int, ...]) -> int:
        if all(self.is_const(i) for i in indices):  # a constant position folds to the element
            position = tuple(min(max(self.value(i), 0), n - 1) for i, n in zip(indices, table.shape))
            return self.const(table.array()[position], table.dtype)
        return self._intern(Node("table", "int32", tuple(indices), table))

    def is_const(self, node_id: int) -> bool:
        return self.nodes[node_id].op == "const"

    def value(self, node_id: int):
        return self.nodes[node_id].attr

    def dtype(self, node_id: int) -> str:
        return self.nodes[node_id].dtype

    def op(self, name: str, *args: int) -> int:
        spec = OPS[name]
        if len(args) != spec.arity:
            raise ValueError(f"{name} takes {spec.arity} arguments, got {len(args)}")
        dtypes = tuple(self.dtype(a) for a in args)
        _check_operands(name, spec.operands, dtypes)
        result = {"bool": "bool", "int32": "int32", "same": dtypes[-1]}[spec.result]
        if all(self.is_const(a) for a in args):
            folded = spec.numpy(*(_numpy_value(self.nodes[a]) for a in args))
            return self.const(folded.item() if isinstance(folded, np.ndarray) else folded, result)
        simpler = self._identity(name, args)
        if simpler is not None:
            return simpler
        return self._intern(Node(name, result, tuple(args)))

    def _identity(self, name: str, args: tuple[int, ...]) -> int | None:
        """An argument the operation equals exactly (or a constant it always gives), else None."""
        def const_is(node_id, value):  # a bool constant compares as 0/1, for which the identities below hold too
            return self.is_const(node_id) and self.value(node_id) == value

        if name == "select":
            pred, on_false, on_true = args
            if self.is_const(pred):
                return on_true if self.value(pred) else on_false
            return on_true if on_false == on_true else None
        if name in ("min", "max", "and", "or") and args[0] == args[1]:
            return args[0]
        if name in ("add", "sub", "or", "xor", "shl", "shr_arithmetic", "shr_logical") and const_is(args[1], 0):
            return args[0]
        if name in ("add", "or", "xor") and const_is(args[0], 0):
            return args[1]
        if name == "mul":
            for mine, other in ((args[0], args[1]), (args[1], args[0])):
                if const_is(mine, 1):
                    return other
                if const_is(mine, 0):
                    return mine
        if name in ("and", "or") and self.dtype(args[0]) == "bool":
            absorbing = name == "or"  # x | True = True, x & False = False; the other constant is the identity
            for mine, other in ((args[0], args[1]), (args[1], args[0])):
                if self.is_const(mine):
                    return mine if self.value(mine) == absorbing else other
        return None


class OperandDtypeError(TypeError):
    """An operation given operand dtypes it does not take (e.g. add on bool)."""


def _check_operands(name: str, kind: str, dtypes: tuple[str, ...]) -> None:
    if kind == "select":
        ok = dtypes[0] == "bool" and dtypes[1] == dtypes[2]
    elif kind == "any":
        ok = len(set(dtypes)) == 1
    else:
        ok = all(d == kind for d in dtypes)
    if not ok:
        raise OperandDtypeError(f"graph op {name} does not take operands of dtypes {dtypes}")
