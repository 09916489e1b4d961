"""The mask-bits path on a machine without a GPU (flashjax.mask_bits, docs/mask_codegen.md "The mask-bits kernel"):
the bitmask's shape rules, mask_bits_reference against the numpy interpreter and the mod's own jnp, the split
predicate the kernel evaluates (compiled for the host under the sanitizers), NVRTC compiling the kernel, and the
FFI call the CUDA lowering emits."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import host_bits_harness
import host_mask_harness as host
import mask_mod_examples as examples
from flashjax import kernel_cache, masks
from flashjax import mask_bits as mb
from flashjax.mask_bits_emit import bits_kernel_source, emit_split_predicate
from flashjax.mask_codegen import MaskModCodegenError, evaluate_mask_graph, generate_mask_mod, mask_field_operands
from flashjax.masks import MaskMod
from flashjax.nvrtc import nvrtc_library_path
from test_mask_codegen import _jnp_truth

B, H = examples.BATCH, examples.HEADS
BROADCASTING = [case for case in examples.CASES if not case.scalar_only]  # what mask_bits_reference evaluates


def _pack(allowed: np.ndarray, seqlen_k: int) -> np.ndarray:
    """bool [..., Sk] -> uint32 [..., ceil(Sk / 32)], bit j of word w = allowed[32 w + j] (the contract)."""
    words = -(-seqlen_k // 32)
    padded = np.zeros(allowed.shape[:-1] + (words * 32,), bool)
    padded[..., :seqlen_k] = allowed
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
    return (padded.reshape(*allowed.shape[:-1], words, 32) * weights).sum(-1).astype(np.uint32)


def _interpreted_bits(mod, bm, hm, seqlen_q, seqlen_k) -> np.ndarray:
    graph = generate_mask_mod(mod).graph
    allowed = evaluate_mask_graph(graph, np.arange(bm).reshape(-1, 1, 1, 1), np.arange(hm).reshape(1, -1, 1, 1),
                                  np.arange(seqlen_q).reshape(1, 1, -1, 1), np.arange(seqlen_k).reshape(1, 1, 1, -1),
                                  [np.asarray(x) for x in mask_field_operands(mod)])
    return _pack(allowed, seqlen_k)


# ------------------------------------------------------------------------------------------------ shape rules
@pytest.mark.parametrize("mod, expected", [
    (masks.causal_mask(), (1, 1)),
    (masks.sliding_window_mask(4, 0), (1, 1)),
    (masks.document_mask(np.zeros((B, 40), np.int32)), (B, 1)),
    (masks.document_mask(np.zeros((1, 40), np.int32)), (1, 1)),  # one row serves every b: b is never read
    (masks.prefix_lm_mask(np.zeros((B,), np.int32)), (B, 1)),
    (examples.HeadOffsets(np.zeros((B, H), np.int32)), (B, H)),
    (examples.HeadOffsets(np.zeros((1, H), np.int32)), (1, H)),
    (examples.FloorDivMod(np.array([1, 2, 3, 4], np.int32), block=5), (1, H)),
], ids=["causal", "window", "document", "document_one_row", "prefix_lm", "head_offsets", "head_offsets_one_row",
        "floor_div_mod"])
def test_broadcast_axes_follow_what_the_graph_reads(mod, expected):
    for seqlen_q, seqlen_k, words in ((5, 1, 1), (7, 32, 1), (1, 33, 2), (40, 70, 3), (0, 0, 0)):
        assert mb.mask_bits_shape(mod, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k) == \
            (*expected, seqlen_q, words)


def test_bad_arguments_raise_naming_them():
    mod = masks.causal_mask()
    with pytest.raises(TypeError, match="mod must be a flashjax MaskMod, got function"):
        mb.mask_bits_shape(lambda b, h, q, kv: q >= kv, batch=1, heads=1, seqlen_q=4, seqlen_k=4)
    for name, value, kind, expected in (("batch", 0, ValueError, r"\[1, "), ("heads", -2, ValueError, r"\[1, "),
                                        ("seqlen_q", -1, ValueError, r"\[0, "), ("seqlen_k", 2**31 - 31, ValueError,
                                                                                 r"\[0, 2147483616\]"),
                                        ("seqlen_q", 4.0, TypeError, "must be an int, got float"),
                                        ("batch", True, TypeError, "must be an int, got bool")):
        sizes = dict(batch=2, heads=2, seqlen_q=4, seqlen_k=4) | {name: value}
        with pytest.raises(kind, match=f"{name} must be" + (f" in {expected}" if kind is ValueError else "")):
            mb.mask_bits_reference(mod, **sizes)
        with pytest.raises(kind, match=name):
            mb.mask_bits(mod, **sizes)
    with pytest.raises(ValueError, match="batch \\* heads must be < 2\\^31"):
        mb.mask_bits_shape(mod, batch=2**16, heads=2**15, seqlen_q=1, seqlen_k=1)


@dataclasses.dataclass(frozen=True)
class _Sine(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.sin(q_idx.astype(jnp.float32)) > 0


def test_a_mod_the_kernels_cannot_compile_raises_on_every_backend():
    with pytest.raises(MaskModCodegenError, match="uses 'sin'"):
        mb.mask_bits(_Sine(), batch=1, heads=1, seqlen_q=4, seqlen_k=4)
    # The oracle still runs it, with b and h kept (it cannot know what the mod reads).
    bits = mb.mask_bits_reference(_Sine(), batch=2, heads=3, seqlen_q=4, seqlen_k=40)
    assert bits.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(bits, _pack(np.broadcast_to((np.sin(np.arange(4.0)) > 0)[:, None], (2, 3, 4, 40)),
                                              40))


# --------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("case", BROADCASTING, ids=[c.name for c in BROADCASTING])
def test_reference_matches_the_interpreter_and_jnp(case):
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    mod = case.make(rng)
    for seqlen_q, seqlen_k in ((1, 1), (examples.SEQLEN, 31), (9, 33), (30, 70)):
        bm, hm, _, words = mb.mask_bits_shape(mod, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        bits = np.asarray(mb.mask_bits_reference(mod, batch=B, heads=H, seqlen_q=seqlen_q, seqlen_k=seqlen_k))
        assert bits.dtype == np.uint32 and bits.shape == (bm, hm, seqlen_q, words)
        np.testing.assert_array_equal(bits, _interpreted_bits(mod, bm, hm, seqlen_q, seqlen_k), err_msg=case.name)
        # The mod's own jnp over the full B x H grid: an axis of extent 1 holds for every b (h).
        grid = (np.arange(B).reshape(-1, 1, 1, 1), np.arange(H).reshape(1, -1, 1, 1),
                np.arange(seqlen_q).reshape(1, 1, -1, 1), np.arange(seqlen_k).reshape(1, 1, 1, -1))
        full = _pack(np.broadcast_to(_jnp_truth(case, mod, grid), (B, H, seqlen_q, seqlen_k)), seqlen_k)
        np.testing.assert_array_equal(np.broadcast_to(bits, full.shape), full, err_msg=case.name)
        if seqlen_k % 32:
            assert not (bits[..., -1] >> np.uint32(seqlen_k % 32)).any(), "bits past seqlen_k must be 0"


def test_reference_words_are_exact_on_a_known_mask():
    bits = np.asarray(mb.mask_bits_reference(masks.causal_mask(), batch=1, heads=1, seqlen_q=40, seqlen_k=40))
    assert bits[0, 0, 0].tolist() == [1, 0]
    assert bits[0, 0, 31].tolist() == [0xFFFFFFFF, 0]
    assert bits[0, 0, 39].tolist() == [0xFFFFFFFF, 0xFF]


def test_mask_bits_off_a_gpu_is_the_reference_and_runs_under_jit():
    ids = np.sort(np.random.default_rng(3).integers(0, 5, (B, 45)), axis=1).astype(np.int32)
    call = jax.jit(lambda mod: mb.mask_bits(mod, batch=B, heads=H, seqlen_q=45, seqlen_k=45))
    want = mb.mask_bits_reference(masks.document_mask(ids), batch=B, heads=H, seqlen_q=45, seqlen_k=45)
    np.testing.assert_array_equal(call(masks.document_mask(ids)), want)
    # The primitive itself (what a GPU binds) lowers to the same reference on the CPU.
    kernel_call = jax.jit(lambda mod: mb._bind_kernel(mod, batch=B, heads=H, seqlen_q=45, seqlen_k=45))
    np.testing.assert_array_equal(kernel_call(masks.document_mask(ids)), want)
    flags = examples.ArrayIntermediates(np.ones((B, 24), np.int32), np.int32(1), np.arange(24) % 3 == 0)  # bool
    np.testing.assert_array_equal(
        mb._bind_kernel(flags, batch=B, heads=H, seqlen_q=20, seqlen_k=50),
        mb.mask_bits_reference(flags, batch=B, heads=H, seqlen_q=20, seqlen_k=50))


# ------------------------------------------------------------------------------------- the split, on the host
@pytest.mark.skipif(host.compiler() is None, reason="no g++ to compile the generated predicates for the host")
def test_the_split_predicate_is_the_predicate_on_the_host(tmp_path):
    """pair(row(b, h, q), col(b, h, kv)), the form the bits kernel evaluates, gives the mod's own values for every
    example (ASan + UBSan, index grids past both ends and at the int32 extremes)."""
    rng = np.random.default_rng(11)
    cases, truths = [], []
    for k, case in enumerate(examples.CASES):
        mod = case.make(rng)
        grid = examples.index_grid(rng, case.extremes)
        name = f"split_{k}_{case.name}"
        generated = generate_mask_mod(mod, function_name=name)
        split, op = emit_split_predicate(generated.graph, name)
        join = "&&" if op == "and" else "||"
        source = generated.source + split + (
            f"static bool {name}_joined(int b, int h, int q, int kv, const FlashjaxMaskFields& f) {{\n"
            f"  const auto row = {name}_row(b, h, q, f);\n  const auto col = {name}_col(b, h, kv, f);\n"
            f"  return {name}_pair(b, h, q, kv, row, col, f) {join} row.term {join} col.term;\n}}\n")
        cases.append(host.HostCase(source, f"{name}_joined", tuple(np.asarray(x) for x in mask_field_operands(mod)),
                                   tuple(x.reshape(-1) for x in grid)))
        truths.append(_jnp_truth(case, mod, grid))
    for case, got, want in zip(examples.CASES, host.run_on_host(cases, tmp_path), truths):
        np.testing.assert_array_equal(got, want, err_msg=case.name)


@pytest.mark.skipif(host.compiler() is None, reason="no g++ to compile the bits kernel for the host")
@pytest.mark.parametrize("name, sizes, blocks", [
    ("document", (B, H, 33, 70), 2),  # a grid smaller than the tasks: the warps loop
    ("head_offsets_one_row", (B, H, 17, 1), 1),
    ("floor_div_mod", (1, H, 5, 33), 3),  # more warps than tasks: some have none
    ("branches", (2, 2, 40, 1100), 5),  # two word chunks per row, the second partial
    ("global_local", (1, 1, 1, 31), 1),  # an or with row, column and mixed terms
    ("prefix_lm", (B, H, 20, 45), 2),  # an or: a column term and a mixed one
    ("sliding_window", (1, 1, 70, 1100), 3),  # most words settled by their box (all false), a few evaluated
    ("causal", (1, 1, 50, 1100), 2),  # settled words all true below the diagonal, all false above it
    ("document_one_row", (B, H, 40, 700), 2),  # keys past the ids read their last id: settled true and false words
    *((case.name, (B, H, 18, 40), 2) for case in examples.CASES if case.name not in (
        "document", "head_offsets_one_row", "floor_div_mod", "branches", "global_local", "prefix_lm", "sliding_window",
        "causal", "document_one_row")),
])
def test_the_bits_kernel_writes_the_reference_on_a_host_warp_emulator(name, sizes, blocks, tmp_path):
    """The CUDA kernel's text, run on the host with emulated warps, writes exactly the interpreter's words (bits
    past seqlen_k 0, nothing outside the bitmask), whatever the grid's size."""
    case = next(c for c in examples.CASES if c.name == name)
    mod = case.make(np.random.default_rng(len(name)))
    batch, heads, seqlen_q, seqlen_k = sizes
    bm, hm, _, _ = mb.mask_bits_shape(mod, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    generated = generate_mask_mod(mod)
    kernel = mb.bits_kernel_name(generated)
    source = generated.source + bits_kernel_source(generated.graph, kernel)
    bits, guards = host_bits_harness.run_kernel_on_host(
        source, kernel, [np.asarray(x) for x in mask_field_operands(mod)], (bm, hm, seqlen_q, seqlen_k), blocks,
        tmp_path)
    assert (guards == 0xDEADBEEF).all(), "a store left the bitmask"
    np.testing.assert_array_equal(bits, _interpreted_bits(mod, bm, hm, seqlen_q, seqlen_k))


def test_the_split_moves_single_index_work_out_of_the_pair():
    source, op = emit_split_predicate(generate_mask_mod(masks.document_mask(np.zeros((B, 64), np.int32))).graph)
    pair = source[source.index("_pair("):]
    assert "fjm_read" not in pair  # both reads are per row or per key; the pair only compares
    assert source[source.index("_row("):source.index("_col(")].count("fjm_read") == 1
    # ids[q] == ids[kv] is the only mixed term; the bounds checks (q < S, kv < S) are the row's and column's
    assert op == "and" and pair.count("const bool") == 1
    source, op = emit_split_predicate(generate_mask_mod(masks.prefix_lm_mask(np.zeros((B,), np.int32))).graph)
    assert op == "or" and "fjm_read" in source[source.index("_col("):source.index("_pair(")]


# ------------------------------------------------------------------------------------------ NVRTC, the lowering
needs_nvrtc = pytest.mark.skipif(nvrtc_library_path() is None, reason="no NVRTC (CUDA toolkit or jax CUDA wheels)")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_bits_kernel_compiles_with_nvrtc(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    for case in examples.CASES:
        generated = generate_mask_mod(case.make(np.random.default_rng(0)))
        binary = mb.compile_mask_bits(generated, arch=arch)
        assert binary.kind == "cubin" and binary.data[:4] == b"\x7fELF"
        assert mb.bits_kernel_name(generated).encode() in binary.data, case.name


def _lowered(mod, **sizes) -> str:
    call = jax.jit(lambda m: mb._bind_kernel(m, **sizes))
    return call.trace(mod).lower(lowering_platforms=("cuda",)).as_text()


def _custom_call(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "stablehlo.custom_call @flashjax_mask_bits" in line]
    return line


@needs_nvrtc
def test_the_lowering_carries_the_binary_and_the_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mb, "_register_target", lambda: None)  # registration serves compilation only
    mod = examples.HeadOffsets(np.zeros((B, H), np.int32))
    line = _custom_call(_lowered(mod, batch=B, heads=H, seqlen_q=100, seqlen_k=70))
    generated = generate_mask_mod(mod)
    binary = mb.compile_mask_bits(generated, arch="compute_80")  # no GPU at lowering: PTX, for any GPU
    encoded = re.search(r'binary = dense<"0x([0-9A-F]+)">', line).group(1)
    assert bytes.fromhex(encoded) == binary.data
    for attribute in (f"batch = {B} : i32", f"heads = {H} : i32", "seqlen_q = 100 : i32", "seqlen_k = 70 : i32",
                      f'kernel_name = "{mb.bits_kernel_name(generated)}"',
                      f"field_shapes = dense<[1, 2, {B}, {H}, 1, 1]> : tensor<6xi64>"):
        assert attribute in line, (attribute, line[-400:])
    assert "tensor<3x4x100x3xui32>" in line and "(%arg0)" in line  # the one field operand, int32


@needs_nvrtc
def test_new_field_values_lower_the_same_call_and_a_static_value_another(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mb, "_register_target", lambda: None)
    monkeypatch.setattr(kernel_cache, "_memory", {})
    sizes = dict(batch=B, heads=H, seqlen_q=33, seqlen_k=33)
    rng = np.random.default_rng(5)
    before = mb.lowering_stats()
    first = _lowered(examples.PrefixLMWindow(rng.integers(0, 9, B).astype(np.int32), window=4), **sizes)
    again = _lowered(examples.PrefixLMWindow(rng.integers(0, 9, B).astype(np.int32), window=4), **sizes)
    other = _lowered(examples.PrefixLMWindow(rng.integers(0, 9, B).astype(np.int32), window=5), **sizes)
    after = mb.lowering_stats()
    assert _custom_call(first) == _custom_call(again) and _custom_call(other) != _custom_call(first)
    assert after["lowerings"] - before["lowerings"] == 3
    assert after["nvrtc_compiles"] - before["nvrtc_compiles"] == 2  # the second lowering hit the cache


def test_a_mod_without_fields_lowers_with_no_operands(monkeypatch):
    monkeypatch.setattr(mb, "_register_target", lambda: None)
    if nvrtc_library_path() is None:
        pytest.skip("no NVRTC")
    line = _custom_call(_lowered(examples.GlobalLocal(num_global=2, window=3), batch=2, heads=2, seqlen_q=8,
                                 seqlen_k=8))
    assert "@flashjax_mask_bits()" in line and "field_shapes = dense<0> : tensor<1xi64>" in line


def test_vmap_over_fields_runs_the_primitive_per_example():
    """vmap of the kernel's primitive over a mod's array field (per-example document ids): one call per index, the
    bits stacked in front, each equal to the reference (the primitive's reference lowering here, the kernel on a GPU)."""
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 3, (4, 2, 70)).cumsum(-1) // 5, jnp.int32)
    call = lambda i: mb._bind_kernel(masks.document_mask(i), batch=2, heads=3, seqlen_q=50, seqlen_k=70)
    got = jax.jit(jax.vmap(call))(ids)
    want = jnp.stack([mb.mask_bits_reference(masks.document_mask(i), batch=2, heads=3, seqlen_q=50, seqlen_k=70)
                      for i in ids])
    assert got.shape == (4, 2, 1, 50, 3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
