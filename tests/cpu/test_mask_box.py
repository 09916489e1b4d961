"""The box function of every example mask mod (flashjax.mask_box_emit): the emitted C++, compiled for the host under
AddressSanitizer and UndefinedBehaviorSanitizer, against the numpy interpreter at the box's points. It must be sound
(a box it settles holds that value at every point) for every mod, and exact (every box whose points agree is
settled) for the bands and the document mask, the ones the kernels' speed rests on."""

from __future__ import annotations

import numpy as np
import pytest

import host_mask_harness as host
import mask_mod_examples as examples
from flashjax.mask_box_emit import BOX_FALSE, BOX_MIXED, BOX_TRUE, emit_box_function
from flashjax.mask_codegen import evaluate_mask_graph, generate_mask_mod, mask_field_operands

pytestmark = pytest.mark.skipif(host.compiler() is None, reason="no g++ to compile the box functions for the host")

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
EXACT = ("causal", "sliding_window", "prefix_lm", "prefix_lm_one_row", "document", "document_one_row")
BOXES_PER_CASE = 300
ENUMERATED = 40  # a range this wide or narrower is checked at every point; a wider one at samples


def _ranges(rng: np.random.Generator, n: int, extremes: bool) -> np.ndarray:
    """[n, 2] int64 ranges [lo, hi] over and past the examples' sequences; at the int32 ends where asked."""
    lo = rng.integers(-40, examples.SEQLEN + 40, size=n)
    width = rng.choice([0, 1, 2, 4, 7, 15, 31, 39, 200], size=n)
    ranges = np.stack([lo, lo + width], axis=1)
    if extremes:
        ends = np.array([[INT32_MIN, INT32_MIN + 9], [INT32_MAX - 30, INT32_MAX], [INT32_MIN, INT32_MAX],
                         [-5, INT32_MAX], [INT32_MIN, 3]])
        ranges[rng.choice(n, size=len(ends), replace=False)] = ends
    return ranges


def _points(rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    if hi - lo < ENUMERATED:
        return np.arange(lo, hi + 1, dtype=np.int64)
    inside = rng.integers(lo, hi, size=ENUMERATED - 4, endpoint=True)
    return np.unique(np.concatenate([[lo, lo + 1, hi - 1, hi], inside]))


def _boxes(rng: np.random.Generator, extremes: bool) -> np.ndarray:
    b = rng.integers(-2, examples.BATCH + 2, size=BOXES_PER_CASE)
    h = rng.integers(-2, examples.HEADS + 2, size=BOXES_PER_CASE)
    q, kv = _ranges(rng, BOXES_PER_CASE, extremes), _ranges(rng, BOXES_PER_CASE, extremes)
    return np.stack([b, h, q[:, 0], q[:, 1], kv[:, 0], kv[:, 1]], axis=1).astype(np.int32)


def _box_cases(rng: np.random.Generator, prefix: str, boxes_of) -> list[tuple]:
    """(case, graph, fields, boxes, host.BoxCase) for every example mod; boxes_of(rng, case, graph, fields)."""
    built = []
    for k, case in enumerate(examples.CASES):
        mod = case.make(rng)
        name = f"{prefix}_{k}_{case.name}"
        generated = generate_mask_mod(mod, function_name=name)
        fields = tuple(np.asarray(x) for x in mask_field_operands(mod))
        boxes = boxes_of(rng, case)
        source = generated.source + emit_box_function(generated.graph, name)
        built.append((case, generated.graph, fields, boxes, host.BoxCase(source, name, fields, boxes)))
    return built


def test_box_classes_are_sound_and_exact_where_the_kernels_need_them(tmp_path):
    rng = np.random.default_rng(38)
    built = _box_cases(rng, "box", lambda rng, case: _boxes(rng, case.extremes))
    classes = host.run_boxes_on_host([b[-1] for b in built], tmp_path)
    settled_any = 0
    for (case, graph, fields, boxes, _), got in zip(built, classes):
        assert got.shape == (len(boxes),) and set(got) <= {BOX_FALSE, BOX_MIXED, BOX_TRUE}, case.name
        for box, klass in zip(boxes, got):
            b, h, q_lo, q_hi, kv_lo, kv_hi = (int(x) for x in box)
            qs, kvs = _points(rng, q_lo, q_hi), _points(rng, kv_lo, kv_hi)
            values = evaluate_mask_graph(graph, np.int32(b), np.int32(h), qs.astype(np.int32)[:, None],
                                         kvs.astype(np.int32)[None, :], list(fields))
            values = np.broadcast_to(values, (len(qs), len(kvs)))
            where = f"{case.name}: box {box.tolist()} classed {klass}"
            if klass == BOX_TRUE:
                assert values.all(), where + " but a point is false"
            elif klass == BOX_FALSE:
                assert not values.any(), where + " but a point is true"
            enumerated = q_hi - q_lo < ENUMERATED and kv_hi - kv_lo < ENUMERATED
            if case.name in EXACT and enumerated and (values.all() or not values.any()):
                assert klass != BOX_MIXED, where + " though its points agree"
            settled_any += klass != BOX_MIXED
    assert settled_any > len(examples.CASES) * BOXES_PER_CASE // 4  # the check above ran on settled boxes too


def test_a_box_of_one_point_is_the_predicate(tmp_path):
    """Where every index is a single value the box computes each node with the predicate's own C++: never mixed,
    and the predicate's value (int32 ends included)."""
    rng = np.random.default_rng(7)

    def single_points(rng, case):
        b, h, q, kv = (np.asarray(x).reshape(-1) for x in examples.index_grid(rng, case.extremes))
        points = np.stack([rng.choice(axis, size=120) for axis in (b, h, q, kv)], axis=1).astype(np.int32)
        return points[:, [0, 1, 2, 2, 3, 3]]

    built = _box_cases(rng, "point", single_points)
    for (case, graph, fields, boxes, _), got in zip(built, host.run_boxes_on_host([b[-1] for b in built], tmp_path)):
        truth = [bool(evaluate_mask_graph(graph, *(np.int32(x) for x in box[[0, 1, 2, 4]]), list(fields)))
                 for box in boxes]
        np.testing.assert_array_equal(got, np.where(truth, BOX_TRUE, BOX_FALSE), err_msg=case.name)
