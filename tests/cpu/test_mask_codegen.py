"""Mask-mod code generation (flashjax.mask_codegen, docs/mask_codegen.md): the traced graph against the mod's own
jnp evaluation, the emitted C++ run on the host, NVRTC, the caches, and the errors for what the kernels lack."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import host_mask_harness as host
import mask_mod_examples as examples
from flashjax import kernel_cache, masks
from flashjax.mask_codegen import (MaskModCodegenError, compile_mask_mod, emit_mask_mod_source, evaluate_mask_graph,
                                   generate_mask_mod, mask_field_operands, mask_source_hash, trace_mask_mod)
from flashjax.masks import MaskMod, static
from flashjax.nvrtc import NvrtcError, compile_cuda, nvrtc_library_path

CASE_IDS = [case.name for case in examples.CASES]


def _field_values(mod):
    return [np.asarray(x) for x in mask_field_operands(mod)]


def _jnp_truth(case, mod, grid) -> np.ndarray:
    """The mod evaluated by jax itself: on broadcasting index arrays, as the reference calls it, or (for the
    scalar-only mods) vmapped over scalar indices."""
    mod = jax.tree_util.tree_map(jnp.asarray, mod)  # fields as jax arrays, as inside the reference's jit
    shape = np.broadcast_shapes(*(x.shape for x in grid))
    if not case.scalar_only:
        return np.broadcast_to(np.asarray(mod(*(jnp.asarray(x) for x in grid))), shape)
    over_kv = jax.vmap(mod.__call__, (None, None, None, 0))
    over_q = jax.vmap(over_kv, (None, None, 0, None))
    over_h = jax.vmap(over_q, (None, 0, None, None))
    return np.asarray(jax.vmap(over_h, (0, None, None, None))(*(jnp.asarray(x.reshape(-1)) for x in grid)))


@pytest.mark.parametrize("case", examples.CASES, ids=CASE_IDS)
def test_interpreter_matches_jnp(case):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        mod = case.make(rng)
        grid = examples.index_grid(rng, case.extremes)
        graph = generate_mask_mod(mod).graph
        got = evaluate_mask_graph(graph, *grid, _field_values(mod))
        np.testing.assert_array_equal(got, _jnp_truth(case, mod, grid), err_msg=f"{case.name}, seed {seed}")


@pytest.mark.skipif(host.compiler() is None, reason="no g++ to compile the generated predicates for the host")
def test_emitted_cxx_matches_jnp_on_the_host(tmp_path):
    """One sanitized host program runs every case's emitted predicate (asan + ubsan: no signed overflow, no UB
    division or shift, no read outside a field) and matches jax."""
    rng = np.random.default_rng(7)
    cases, truths = [], []
    for k, case in enumerate(examples.CASES):
        mod = case.make(rng)
        grid = examples.index_grid(rng, case.extremes)
        name = f"mod_{k}_{case.name}"
        generated = generate_mask_mod(mod, function_name=name)
        cases.append(host.HostCase(generated.source, name, tuple(_field_values(mod)),
                                   tuple(x.reshape(-1) for x in grid)))
        truths.append(_jnp_truth(case, mod, grid))
    for case, got, want in zip(examples.CASES, host.run_on_host(cases, tmp_path), truths):
        np.testing.assert_array_equal(got, want, err_msg=case.name)


# --------------------------------------------------------------------------- determinism and the cache key


def _fresh_source(mod) -> str:
    """Traced and emitted anew, past generate_mask_mod's cache."""
    return emit_mask_mod_source(trace_mask_mod(mod))


@pytest.mark.parametrize("case", examples.CASES, ids=CASE_IDS)
def test_new_array_values_give_the_same_source(case):
    first, second = case.make(np.random.default_rng(1)), case.make(np.random.default_rng(2))
    assert _fresh_source(first) == _fresh_source(second)
    assert generate_mask_mod(first).source_hash == generate_mask_mod(second).source_hash


@pytest.mark.parametrize("first, second", [
    (masks.sliding_window_mask(5, 2), masks.sliding_window_mask(5, 3)),
    (examples.GlobalLocal(num_global=3, window=2), examples.GlobalLocal(num_global=4, window=2)),
    (examples.PrefixLMWindow(np.zeros(3, np.int32), window=4), examples.PrefixLMWindow(np.zeros(3, np.int32), 5)),
    (examples.StaticTokens((0, 5)), examples.StaticTokens((0, 6))),
], ids=["sliding_window", "global_local", "prefix_lm_window", "static_tokens"])
def test_a_new_static_value_gives_new_source(first, second):
    assert _fresh_source(first) != _fresh_source(second)
    assert generate_mask_mod(first).source_hash != generate_mask_mod(second).source_hash


def test_the_hash_covers_the_source_and_the_version():
    source = generate_mask_mod(masks.causal_mask()).source
    assert mask_source_hash(source) == mask_source_hash(source)
    assert mask_source_hash(source) != mask_source_hash(source, version="0.0.0")
    assert mask_source_hash(source) != mask_source_hash(source + " ")


def test_sources_do_not_depend_on_the_process():
    """Another interpreter, with another string-hash seed, generates the same bytes."""
    script = ("import hashlib, numpy as np, mask_mod_examples as e\n"
              "from flashjax.mask_codegen import generate_mask_mod\n"
              "for c in e.CASES: print(hashlib.sha256(generate_mask_mod(c.make(np.random.default_rng(0)))"
              ".source.encode()).hexdigest())\n")
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONHASHSEED="12345",
               PYTHONPATH=os.pathsep.join([here, os.path.join(here, "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    here_hashes = [hashlib.sha256(generate_mask_mod(c.make(np.random.default_rng(0))).source.encode()).hexdigest()
                   for c in examples.CASES]
    assert result.stdout.split() == here_hashes


def test_field_operands_follow_the_graph_order():
    mod = examples.BothOf(masks.document_mask(np.ones((2, 8), np.int32)),
                          examples.PrefixLMWindow(np.array([3], np.int32), window=2))
    graph = generate_mask_mod(mod).graph
    assert [f.name for f in graph.fields] == ["first.doc_ids", "second.prefix_len"]
    operands = mask_field_operands(mod)
    assert [x.shape for x in operands] == [(2, 8), (1,)] and all(x.dtype == jnp.int32 for x in operands)


def test_a_builtin_mask_emits_the_expression_a_person_would_write():
    source = generate_mask_mod(masks.sliding_window_mask(3, 1)).source
    body = source[source.index("bool flashjax_mask_mod("):]
    assert "fjm_sub(q_idx, 3)" in body and "fjm_add(q_idx, 1)" in body and body.count("\n  const ") == 5


# --------------------------------------------------------------------------- what the kernels cannot compile


@dataclasses.dataclass(frozen=True)
class Sine(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.sin(q_idx.astype(jnp.float32)) > 0


@dataclasses.dataclass(frozen=True)
class TrueDivide(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx / 2 < kv_idx


@dataclasses.dataclass(frozen=True)
class ForLoop(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return lax.fori_loop(0, 3, lambda i, c: c + kv_idx, q_idx) > 0


@dataclasses.dataclass(frozen=True)
class WhileLoop(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return lax.while_loop(lambda c: c < kv_idx, lambda c: c + 1, q_idx) > 0


@dataclasses.dataclass(frozen=True)
class CumulativeSum(MaskMod):
    lengths: tuple = static()

    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.cumsum(jnp.asarray(self.lengths))[h] > q_idx


@dataclasses.dataclass(frozen=True)
class LongReduction(MaskMod):
    ids: jax.Array

    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.any(self.ids == jnp.expand_dims(kv_idx, -1), axis=-1)


@dataclasses.dataclass(frozen=True)
class LargeConstant(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return jnp.asarray(np.arange(5000, dtype=np.int32))[kv_idx] < q_idx


@dataclasses.dataclass(frozen=True)
class FloatField(MaskMod):
    weights: jax.Array

    def __call__(self, b, h, q_idx, kv_idx):
        return self.weights[kv_idx] > 0.5


@dataclasses.dataclass(frozen=True)
class PythonBranch(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx if q_idx > 0 else kv_idx == 0


@dataclasses.dataclass(frozen=True)
class NarrowCast(MaskMod):
    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx.astype(jnp.uint8) > kv_idx.astype(jnp.uint8)


@pytest.mark.parametrize("mod, construct", [
    (Sine(), "sin"),
    (TrueDivide(), "convert_element_type"),
    (ForLoop(), "scan"),
    (WhileLoop(), "while"),
    (CumulativeSum((1, 2, 3)), "cumsum"),
    (LongReduction(np.zeros(1024, np.int32)), "reduce_or"),
    (LargeConstant(), "a constant array of 5000 elements"),
    (FloatField(np.zeros(8, np.float32)), "field weights of dtype float32"),
    (PythonBranch(), "its __call__ on scalar indices"),
    (NarrowCast(), "convert_element_type"),
], ids=lambda x: type(x).__name__ if isinstance(x, MaskMod) else "")
def test_what_the_kernels_cannot_compile_raises_naming_it(mod, construct):
    with pytest.raises(MaskModCodegenError) as raised:
        generate_mask_mod(mod)
    error = raised.value
    assert isinstance(error, NotImplementedError)
    assert error.construct == construct and error.mod_class == type(mod).__qualname__
    message = str(error)
    assert f"mask mod {type(mod).__qualname__} uses '{construct}'" in message and 'backend="reference"' in message


# --------------------------------------------------------------------------- NVRTC and the disk cache

needs_nvrtc = pytest.mark.skipif(nvrtc_library_path() is None, reason="no NVRTC (CUDA toolkit or jax CUDA wheels)")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "compute_90"])
def test_every_case_compiles_with_nvrtc(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    for case in examples.CASES:
        binary = compile_mask_mod(generate_mask_mod(case.make(np.random.default_rng(0))), arch=arch)
        assert binary.kind == ("cubin" if arch.startswith("sm_") else "ptx")
        if binary.kind == "ptx":
            assert b"flashjax_mask_mod_probe" in binary.data
        else:
            assert binary.data[:4] == b"\x7fELF"


@needs_nvrtc
def test_an_external_predicate_compiles_for_separate_linking():
    graph = generate_mask_mod(masks.document_mask(np.zeros((2, 16), np.int32))).graph
    source = emit_mask_mod_source(graph, external=True)
    assert 'extern "C" __device__ bool flashjax_mask_mod(' in source
    relocatable = compile_cuda(source, arch="sm_90", options=("-rdc=true",))
    assert relocatable.kind == "cubin" and b"flashjax_mask_mod" in relocatable.data


@needs_nvrtc
def test_the_disk_cache_serves_a_second_process(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_memory", {})
    generated = generate_mask_mod(examples.GlobalLocal(num_global=2, window=9))
    first = compile_mask_mod(generated, arch="sm_90")
    assert not first.from_cache and first.path is not None and first.path.read_bytes() == first.data
    assert first.path.parent == tmp_path / "nvrtc" and first.path.name.startswith(first.key)
    assert compile_mask_mod(generated, arch="sm_90").from_cache  # this process's memory
    monkeypatch.setattr(kernel_cache, "_memory", {})  # as a new process would start
    again = compile_mask_mod(generated, arch="sm_90")
    assert again.from_cache and again.data == first.data
    other_arch = compile_mask_mod(generated, arch="sm_80")
    assert not other_arch.from_cache and other_arch.key != first.key


@needs_nvrtc
def test_nvrtc_errors_carry_the_log():
    with pytest.raises(NvrtcError) as raised:
        compile_cuda("__device__ int broken( { return; }", arch="sm_80")
    assert raised.value.log and "error" in raised.value.log
