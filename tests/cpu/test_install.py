"""How flashjax installs and meets its environment (docs/release.md): the wheel's name, tag and metadata follow the
CUDA toolkit it is built with, the installed package works from outside the checkout, and a library whose CUDA
major does not fit the driver or the jax plugin says so at import instead of failing at the first launch."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import pytest

import flashjax
from flashjax import _ffi, api

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What the manylinux policy lets a wheel's library need from the system (besides the driver, which the library
# does not link: cudart, linked statically, opens it at run time).
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2", "libdl.so.2", "libpthread.so.0", "librt.so.1"}


def _nvcc_major():
    out = subprocess.run([str(ROOT / "tools" / "gpu.sh"), "cuda-major"], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A kernel-less wheel built by tools/wheel.sh exactly as a release one is (same staging, naming, tagging)."""
    major = _nvcc_major()
    if not major:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    dist = tmp_path_factory.mktemp("dist")
    # A build folder per pytest worker: under xdist two workers may each build this module's fixture at once.
    env = dict(os.environ, FLASHJAX_KERNEL_SET="none", FLASHJAX_CUDA_ARCHS="80-real",
               FLASHJAX_WHEEL_BUILD_DIR=str(tmp_path_factory.mktemp("wheel-build")))
    built = subprocess.run([str(ROOT / "tools" / "wheel.sh"), str(dist)], env=env, capture_output=True, text=True)
    if built.returncode != 0 and "No matching distribution found for ziglang" in built.stderr:
        pytest.skip("offline without ziglang: the glibc 2.28 link directory cannot be made (FLASHJAX_GLIBC228_DIR)")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    (path,) = dist.glob("*.whl")
    return path, major


def test_wheel_is_named_and_tagged_for_its_cuda_major(wheel):
    path, major = wheel
    # Linked against glibc 2.28's ABI (cmake/manylinux_link.cmake): installable on RHEL 8 and newer.
    match = re.fullmatch(rf"flashjax_cu{major}-{flashjax.__version__}-py3-none-manylinux_2_(28)_x86_64\.whl",
                         path.name)
    assert match, path.name
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        metadata = z.read(f"flashjax_cu{major}-{flashjax.__version__}.dist-info/METADATA").decode()
        wheel_tags = z.read(f"flashjax_cu{major}-{flashjax.__version__}.dist-info/WHEEL").decode()
    assert f"Name: flashjax-cu{major}" in metadata
    assert "Requires-Python: >=3.12" in metadata
    (jax_requirement,) = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: jax")]
    assert jax_requirement == f"Requires-Dist: jax[cuda{major}]<0.13,>=0.11.2", jax_requirement
    assert f"Tag: py3-none-manylinux_2_{match.group(1)}_x86_64" in wheel_tags
    assert "flashjax/libflashjax.so" in names
    assert not [n for n in names if n.startswith(("tests/", "lab/", "csrc/"))]


def test_wheel_library_needs_only_what_manylinux_allows(wheel, tmp_path):
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    path, _ = wheel
    with zipfile.ZipFile(path) as z:
        z.extract("flashjax/libflashjax.so", tmp_path)
    dynamic = subprocess.run(["readelf", "-d", str(tmp_path / "flashjax" / "libflashjax.so")], check=True,
                             capture_output=True, text=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed and needed <= ALLOWED_NEEDED, needed
    if shutil.which("objdump"):
        symbols = subprocess.run(["objdump", "-T", str(tmp_path / "flashjax" / "libflashjax.so")], check=True,
                                 capture_output=True, text=True).stdout
        versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+(?:\.\d+)?)", symbols)}
        assert versions and max(versions) <= (2, 28), sorted(versions)[-3:]


def test_installed_wheel_runs_from_outside_the_checkout(wheel, tmp_path):
    path, major = wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(path)],
                   check=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    env.pop("FLASHJAX_LIBRARY", None)
    out = subprocess.run([sys.executable, "-m", "flashjax"], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert f"library: {target / 'flashjax' / 'libflashjax.so'}" in out, out
    assert f"CUDA {major}." in out, out


# ------------------------------------------------------------------------------------- CUDA major checks
@pytest.fixture
def environment(monkeypatch):
    """cuda_environment() with the library's CUDA, the driver's and the plugins set by the test."""
    def make(library, driver, plugins):
        monkeypatch.setattr(_ffi, "build_info", lambda: {"cuda_version": library})
        monkeypatch.setattr(_ffi, "driver_cuda_version", lambda: driver)
        monkeypatch.setattr(_ffi, "jax_cuda_plugins", lambda: plugins)
        monkeypatch.setattr(_ffi, "available", lambda: True)
        _ffi.cuda_environment.cache_clear()
        return _ffi.cuda_environment()
    yield make
    _ffi.cuda_environment.cache_clear()


def test_driver_older_than_the_library_is_a_problem_naming_the_wheel_to_install(environment):
    env = environment(13000, 12080, {12: "0.11.2"})
    assert env["problem"] and "12.8" in env["problem"] and "flashjax-cu12" in env["problem"], env
    with pytest.raises(ImportError, match="update the driver"):
        _ffi.check_environment()


def test_plugin_of_another_major_warns_naming_the_matching_wheel(environment):
    env = environment(13000, 13000, {12: "0.11.2"})
    assert env["problem"] is None
    assert "jax-cuda12-plugin 0.11.2" in env["warning"] and "flashjax-cu12" in env["warning"], env
    with pytest.warns(UserWarning, match="flashjax-cu12"):
        _ffi.check_environment()


def test_matching_library_driver_and_plugin_say_nothing(environment):
    env = environment(13000, 13020, {13: "0.11.2"})
    assert env["problem"] is None and env["warning"] is None
    _ffi.check_environment()  # neither raises nor warns


def test_a_driver_problem_sends_calls_to_the_reference_with_its_reason(environment, monkeypatch):
    environment(13000, 12040, {13: "0.11.2"})
    monkeypatch.setattr(_ffi, "default_device", lambda: (90, 132))
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
    call = api._dense_call(q, q, q, causal=True)
    path, reason, _ = api.choose(call)
    assert path == "reference" and "driver supports CUDA 12.4" in reason, reason
    with pytest.raises(ValueError, match="update the driver"):
        api.choose(api._dense_call(q, q, q, causal=True, backend="kernel"))


def test_older_python_is_told_the_requirement_at_import():
    candidates = [shutil.which("python3.11"), *map(str, pathlib.Path.home().glob(".pyenv/versions/3.11*/bin/python3"))]
    old = next((c for c in candidates if c), None)
    if old is None:
        pytest.skip("no Python 3.11 on this machine")
    out = subprocess.run([old, "-c", "import flashjax"], cwd=ROOT / "python", capture_output=True, text=True)
    assert out.returncode != 0
    assert "flashjax needs Python >= 3.12" in out.stderr.splitlines()[-1], out.stderr
