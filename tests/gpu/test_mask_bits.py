"""The mask-bits kernel on the GPU (flashjax.mask_bits, docs/mask_codegen.md "The mask-bits kernel"): its words
equal the reference's for every example mod on fresh random fields, at ragged sizes, with the batch and head axes
broadcast and not; new field values reuse the compiled kernel and a new static value compiles another; a
jax.export artifact carries the binary; and a timing print of the B 4 x 4096 document mask."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))  # the example mods live with the CPU tests
import mask_mod_examples as examples  # noqa: E402
import flashjax  # noqa: E402
from flashjax import kernel_cache, masks  # noqa: E402
from flashjax import mask_bits as mb  # noqa: E402
from flashjax.mask_codegen import evaluate_mask_graph, generate_mask_mod, mask_field_operands  # noqa: E402

B, H = examples.BATCH, examples.HEADS
SIZES = [(1, 1), (1, 31), (31, 33), (33, 32), (17, 64), (8, 1000), (1000, 95), (129, 4097)]


def _oracle(case, mod, seqlen_q, seqlen_k) -> np.ndarray:
    """mask_bits_reference where the mod broadcasts; the numpy interpreter of its graph (checked against the mod's
    own jnp in tests/cpu) for the scalar-only mods, packed the same way."""
    if not case.scalar_only:
        return np.asarray(mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k))
    bm, hm, _, words = mb.mask_bits_shape(mod, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    allowed = evaluate_mask_graph(generate_mask_mod(mod).graph, np.arange(bm).reshape(-1, 1, 1, 1),
                                  np.arange(hm).reshape(1, -1, 1, 1), np.arange(seqlen_q).reshape(1, 1, -1, 1),
                                  np.arange(seqlen_k).reshape(1, 1, 1, -1),
                                  [np.asarray(x) for x in mask_field_operands(mod)])
    padded = np.zeros((bm, hm, seqlen_q, words * 32), bool)
    padded[..., :seqlen_k] = allowed
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    return (padded.reshape(bm, hm, seqlen_q, words, 32) * weights).sum(-1).astype(np.uint32)


def _kernel(mod, seqlen_q, seqlen_k):
    return jax.jit(lambda m: mb.mask_bits(m, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k))(mod)


@pytest.mark.parametrize("case", examples.CASES, ids=[c.name for c in examples.CASES])
def test_kernel_bits_equal_the_reference(case):
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    for seqlen_q, seqlen_k in SIZES:
        mod = case.make(rng)  # fresh field values at every size
        got = np.asarray(_kernel(mod, seqlen_q, seqlen_k))
        want = _oracle(case, mod, seqlen_q, seqlen_k)
        assert got.shape == want.shape and got.dtype == np.uint32
        if not np.array_equal(got, want):
            where = np.argwhere(got != want)[0]
            raise AssertionError(f"{case.name} Sq {seqlen_q} Sk {seqlen_k}: word {tuple(where)} is "
                                 f"{got[tuple(where)]:#010x}, the reference {want[tuple(where)]:#010x} "
                                 f"({len(np.argwhere(got != want))} words differ)")


@pytest.mark.parametrize("rows", [1, B])
def test_document_masks_at_real_lengths(rows):
    """Ids as long as the sequence, sorted into documents of random lengths, the batch axis broadcast or not."""
    rng = np.random.default_rng(rows)
    for seqlen in (1000, 2048 + 17):
        ids = np.sort(rng.integers(0, 9, (rows, seqlen)), axis=1).astype(np.int32)
        mod = masks.document_mask(ids)
        got = np.asarray(_kernel(mod, seqlen, seqlen))
        assert got.shape[0] == rows
        np.testing.assert_array_equal(got, mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=seqlen,
                                                                  seqlen_k=seqlen))


def test_eager_calls_match_and_empty_sizes_give_empty_bitmasks():
    mod = examples.HeadOffsets(np.random.default_rng(0).integers(-6, 6, (B, H)).astype(np.int32))
    np.testing.assert_array_equal(mb.mask_bits(mod, batch=B, heads=H, seqlen_q=50, seqlen_k=77),
                                  mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=50, seqlen_k=77))
    assert mb.mask_bits(mod, batch=B, heads=H, seqlen_q=0, seqlen_k=77).shape == (B, H, 0, 3)
    assert mb.mask_bits(mod, batch=B, heads=H, seqlen_q=5, seqlen_k=0).shape == (B, H, 5, 0)


def test_new_field_values_reuse_the_kernel_and_a_static_value_compiles_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_memory", {})
    rng = np.random.default_rng(9)
    call = jax.jit(lambda m: mb.mask_bits(m, batch=B, heads=H, seqlen_q=100, seqlen_k=100))

    def prefix_lm(window):
        return examples.PrefixLMWindow(rng.integers(0, 100, B).astype(np.int32), window=window)

    first = prefix_lm(4)
    np.testing.assert_array_equal(call(first), mb.mask_bits_reference(first, batch=B, heads=H, seqlen_q=100,
                                                                      seqlen_k=100))
    before = mb.lowering_stats()
    for _ in range(3):
        mod = prefix_lm(4)
        np.testing.assert_array_equal(call(mod), mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=100,
                                                                        seqlen_k=100))
    assert mb.lowering_stats() == before, "a new field value must not lower or compile anything"
    mod = prefix_lm(7)
    np.testing.assert_array_equal(call(mod), mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=100,
                                                                    seqlen_k=100))
    after = mb.lowering_stats()
    assert after["lowerings"] == before["lowerings"] + 1 and after["nvrtc_compiles"] == before["nvrtc_compiles"] + 1


def test_an_exported_call_carries_its_binary():
    """The artifact holds the NVRTC binary as an attribute: deserialized, it runs with new ids and no codegen."""
    from jax import export

    sizes = dict(batch=B, heads=H, seqlen_q=300, seqlen_k=300)
    ids = np.sort(np.random.default_rng(4).integers(0, 5, (B, 300)), axis=1).astype(np.int32)
    exported = export.export(jax.jit(lambda i: mb.mask_bits(masks.document_mask(i), **sizes)),
                             disabled_checks=flashjax.export_checks())(ids)
    assert "flashjax_mask_bits" in exported.mlir_module()
    restored = export.deserialize(exported.serialize())
    other = np.sort(np.random.default_rng(5).integers(0, 5, (B, 300)), axis=1).astype(np.int32)
    before = mb.lowering_stats()
    np.testing.assert_array_equal(restored.call(other), mb.mask_bits_reference(masks.document_mask(other), **sizes))
    assert mb.lowering_stats()["nvrtc_compiles"] == before["nvrtc_compiles"]


def _document_ids(batch, seqlen, documents, rng):
    cuts = np.sort(rng.choice(np.arange(1, seqlen), documents - 1, replace=False))
    return np.repeat(np.arange(documents), np.diff(np.concatenate([[0], cuts, [seqlen]])))[None].repeat(batch, 0)


def test_timing_of_the_b4_s4096_document_mask(capsys, tmp_path, monkeypatch):
    """Prints the first compile (NVRTC, cold cache) and the kernel's time per call: the marginal cost of one more
    call in an executable of 11 calls against one of 1, so dispatch overhead cancels."""
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_memory", {})
    rng = np.random.default_rng(0)
    batch, seqlen, heads = 4, 4096, 16
    ids = [jnp.asarray(_document_ids(batch, seqlen, 16, rng).astype(np.int32)) for _ in range(11)]
    sizes = dict(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen)
    compiled_before = mb.lowering_stats()["compile_seconds"]
    start = time.perf_counter()
    one = jax.jit(lambda i: mb.mask_bits(masks.document_mask(i), **sizes)).lower(ids[0]).compile()
    first_call = time.perf_counter() - start
    compile_seconds = mb.lowering_stats()["compile_seconds"] - compiled_before
    many = jax.jit(lambda *i: [mb.mask_bits(masks.document_mask(x), **sizes) for x in i]).lower(*ids).compile()
    np.testing.assert_array_equal(one(ids[0]), mb.mask_bits_reference(masks.document_mask(ids[0]), **sizes))

    def best(fn, *args, reps=50):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    per_call = (best(many, *ids) - best(one, ids[0])) / 10
    with capsys.disabled():
        print(f"\nmask-bits B{batch} S{seqlen} document mask (16 docs): {per_call * 1e6:.1f} us per call "
              f"(marginal, 11 vs 1 calls); first lowering + compile {first_call * 1e3:.0f} ms, of which NVRTC "
              f"{compile_seconds * 1e3:.0f} ms")
    assert per_call > 0
