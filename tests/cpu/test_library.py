"""The compiled library: loads with ctypes without a GPU, describes its build, answers dispatch questions and
registers its FFI targets. CI builds it with the small kernel set before running these."""
import os

import pytest

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


def test_registers_ffi_targets():
    _ffi.register_targets()
    _ffi.register_targets()  # idempotent: the library is loaded and registered once per process
    assert _ffi.library() is _ffi.library()
