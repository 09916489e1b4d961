"""Evaluates a mask mod's expression graph in numpy: the tests' independent check of the tracer (docs/mask_codegen.md).

It runs the same numpy definitions of the operations (flashjax.mask_ops) that constant folding used, over
broadcasting index arrays, so its result can be compared element for element with the mod's own jnp evaluation.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from flashjax.mask_graph import INDEX_NAMES, MaskGraph
from flashjax.mask_ops import OPS

__all__ = ["evaluate_mask_graph"]


def _read_clamped(array: np.ndarray, indices: list[np.ndarray]) -> np.ndarray:
    """array[indices] with every index clamped into its axis, as the device read (fjm_read) does."""
    if array.size == 0:  # no element to read: the device read gives 0 as well
        return np.zeros(np.broadcast_shapes(*(np.shape(i) for i in indices)), np.int32)
    clamped = tuple(np.clip(i, 0, n - 1) for i, n in zip(indices, array.shape))
    return np.asarray(array, dtype=np.int32)[clamped]


def evaluate_mask_graph(graph: MaskGraph, b, h, q_idx, kv_idx, fields: Sequence) -> np.ndarray:
    """The predicate at broadcasting int32 index arrays: bool, of their broadcast shape.

    ``fields`` are the mod's array fields in graph order (flashjax.mask_codegen.mask_field_operands(mod) gives
    them); each must have the shape the graph was traced with.
    """
    if len(fields) != len(graph.fields):
        raise ValueError(f"{graph.mod_class} has {len(graph.fields)} array fields, got {len(fields)} values")
    field_values = []
    for spec, value in zip(graph.fields, fields):
        value = np.asarray(value)
        if value.shape != spec.shape:
            raise ValueError(f"field {spec.name} was traced with shape {spec.shape}, got {value.shape}")
        field_values.append(value.astype(np.int32))
    index_values = dict(zip(INDEX_NAMES, (np.asarray(i, dtype=np.int32) for i in (b, h, q_idx, kv_idx))))
    values: dict[int, np.ndarray] = {}
    with np.errstate(over="ignore"):  # int32 arithmetic wraps, as on the device
        for node_id in graph.reachable():
            node = graph.nodes[node_id]
            args = [values[a] for a in node.args]
            if node.op == "const":
                value = np.asarray(node.attr, dtype=np.bool_ if node.dtype == "bool" else np.int32)
            elif node.op == "index":
                value = index_values[node.attr]
            elif node.op == "field":
                value = _read_clamped(field_values[node.attr], args)
            elif node.op == "table":
                value = _read_clamped(node.attr.array(), args)
            else:
                value = np.asarray(OPS[node.op].numpy(*args))
            values[node_id] = value
    shape = np.broadcast_shapes(*(v.shape for v in index_values.values()))
    return np.broadcast_to(values[graph.output], shape).astype(np.bool_)
