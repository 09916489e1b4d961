"""The compiled library: loads with ctypes without a GPU, describes its build, answers dispatch questions and
registers its FFI targets. CI builds it with the small kernel set before running these."""
import importlib.util
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import flashjax
from flashjax import _ffi

if not _ffi.available() and os.environ.get("FLASHJAX_REQUIRE_LIBRARY", "1") == "1":
    pytest.fail("libflashjax.so is not built; set FLASHJAX_REQUIRE_LIBRARY=0 to skip these tests", pytrace=False)
pytestmark = pytest.mark.skipif(not _ffi.available(), reason="libflashjax.so not built")


def test_build_info_describes_the_build():
    info = _ffi.build_info()
    assert info["version"]
    assert info["kernel_set"] in ("full", "ci", "none")
    assert info["cuda_archs"] and all(a[:2].isdigit() for a in info["cuda_archs"])
    assert info["bwd_seqlen_q_rounding"] % 64 == 0
    for kernel in info["kernels"]:
        assert kernel["direction"] in ("fwd", "bwd") and kernel["dtype"] in ("fp16", "bf16")
        assert kernel["head_dim"] in (64, 96, 128, 192, 256)
    if info["kernel_set"] == "ci":
        expected = {("sm80", "fwd"), ("sm80", "bwd")}
        if any(a.startswith("90a") for a in info["cuda_archs"]):  # the Hopper family compiles for sm_90a only
            expected.add(("sm90", "fwd"))
        assert {(k["family"], k["direction"]) for k in info["kernels"]} == expected


@pytest.mark.parametrize("d,width", [(8, 64), (64, 64), (72, 96), (200, 256), (256, 256), (264, 0)])
def test_padded_head_dim(d, width):
    assert _ffi.padded_head_dim(d) == width


def test_dispatch_answers_with_reasons():
    info = _ffi.build_info()
    ok, reason = _ffi.choose_kernel(70, "fwd", "bfloat16", 128)
    assert not ok and "no code for sm_70" in reason
    ok, reason = _ffi.choose_kernel(90, "fwd", "bfloat16", 128, varlen=True)
    assert not ok and "varlen" in reason
    compiled = {(k["direction"], k["dtype"], k["head_dim"]) for k in info["kernels"]}
    for direction in ("fwd", "bwd"):
        ok, reason = _ffi.choose_kernel(80, direction, "bfloat16", 64)
        assert ok == ((direction, "bf16", 64) in compiled and any(a.startswith("80") for a in info["cuda_archs"]))
        if ok:
            assert "sm80" in reason


def _generator():
    """tools/gen_kernels.py, the one table that says which kernels exist and how much shared memory each needs."""
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gen_kernels.py"
    spec = importlib.util.spec_from_file_location("gen_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DTYPE_NAME = {"bf16": "bfloat16", "fp16": "float16"}


def test_kernel_table_carries_the_generators_shared_memory_figures():
    # The generator's figures are static_asserted against the kernels' own constants in every instantiation file.
    gen = _generator()
    for k in _ffi.build_info()["kernels"]:
        assert k["smem_bytes"] == gen.smem_bytes(k["family"], k["direction"], k["head_dim"]), k


def test_shared_memory_limits_per_arch():
    assert _ffi.max_smem_per_block_optin(80) == 163 * 1024
    for sm in (86, 89, 120):
        assert _ffi.max_smem_per_block_optin(sm) == 99 * 1024
    assert _ffi.max_smem_per_block_optin(90) == 227 * 1024


@pytest.mark.parametrize("sm", [80, 86, 89])
def test_dispatch_refuses_kernels_over_the_devices_shared_memory(sm):
    info = _ffi.build_info()
    if not any(a.startswith("80") for a in info["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    limit = _ffi.max_smem_per_block_optin(sm)
    for k in info["kernels"]:
        if k["family"] != "sm80":
            continue
        ok, reason = _ffi.choose_kernel(sm, k["direction"], DTYPE_NAME[k["dtype"]], k["head_dim"])
        assert ok == (k["smem_bytes"] <= limit), (k, reason)
        if not ok:
            direction = {"fwd": "forward", "bwd": "backward"}[k["direction"]]
            assert reason == (f"the sm80 {direction} kernel for {k['dtype']} head dim {k['head_dim']} needs "
                              f"{k['smem_bytes'] / 1024:g} KB of shared memory per block; sm_{sm} allows 99 KB")


def _has_kernel(direction, dtype, head_dim):
    return any((k["family"], k["direction"], k["dtype"], k["head_dim"]) == ("sm80", direction, dtype, head_dim)
               for k in _ffi.build_info()["kernels"])


def test_explain_on_a_99_kb_gpu():
    # sm86/89/120 allow 99 KB per block: the sm80 backward fits at head dim 64 (96 KB), not at 128 (160 KB), and
    # backend="auto" takes the kernel only when both directions run.
    if not any(a.startswith("80") for a in _ffi.build_info()["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    spec = jax.ShapeDtypeStruct
    for d in (64, 128):
        if not (_has_kernel("fwd", "bf16", d) and _has_kernel("bwd", "bf16", d)):
            continue  # the small CI kernel set has head dim 64 only
        q = spec((1, 256, 8, d), jnp.bfloat16)
        text = flashjax.explain(q, q, q, causal=True, device_sm=86)
        if d == 64:
            assert ": kernel (sm80 forward kernel" in text, text
        else:
            assert ": reference (the sm80 backward kernel for bf16 head dim 128 needs 160 KB of shared memory per " \
                   "block; sm_86 allows 99 KB)" in text, text
            assert ": kernel (" in flashjax.explain(q, q, q, causal=True, device_sm=80)


def test_auto_warns_once_with_the_shared_memory_reason(monkeypatch):
    if not (_has_kernel("fwd", "bf16", 128) and _has_kernel("bwd", "bf16", 128)):
        pytest.skip("needs the sm80 head dim 128 kernels (the full kernel set)")
    if not any(a.startswith("80") for a in _ffi.build_info()["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    from flashjax import api
    options = api._check_options(causal=True, window_size=(-1, -1), softmax_scale=None, sinks=None, softcap=0.0,
                                 mask_mod=None, return_lse=False, deterministic=False, backend="auto",
                                 head_dim=128, heads_q=8)
    monkeypatch.setattr(api, "_warned", set())
    with pytest.warns(UserWarning, match="160 KB of shared memory per block; sm_89 allows 99 KB"):
        assert api.plan(jnp.bfloat16, 128, varlen=False, options=options, device_sm=89)[0] == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.plan(jnp.bfloat16, 128, varlen=False, options=options, device_sm=89)[0] == "reference"


def test_registers_ffi_targets():
    _ffi.register_targets()
    _ffi.register_targets()  # idempotent: the library is loaded and registered once per process
    assert _ffi.library() is _ffi.library()
