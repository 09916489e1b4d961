"""Every GPU the build has code for runs every call on a kernel that is in the library: the machine code of each
architecture the build info names is in libflashjax.so (its .nv_fatbin section, read here without CUDA tools), and
the plan sends each (GPU, head dim, dtype, feature) to a row of the build's table that fits the GPU's shared memory,
the largest such row (sm100: the 163 KB tiles; sm86/89/120: the 99 KB ones). With the release build (FLASHJAX_LIBRARY
pointing at the wheel's library) this covers sm80 through sm121; CI's build has sm80 and sm90a code only, and the
C++ test tests/cpp/test_sm80_tiles.cu checks the release architecture list against the full kernel set."""
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from flashjax import _ffi

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="libflashjax.so not built")

# GPUs by compute capability: Ampere (A100, RTX 30 / A10 / A40, Orin), Ada, Hopper, Blackwell (B200, B300,
# RTX 50 / RTX PRO 6000, GB10).
GPUS = (80, 86, 87, 89, 90, 100, 103, 120, 121)
HEAD_DIMS = (64, 96, 128, 192, 256)
FEATURES = {
    "dense": {},
    "causal": dict(window_right=0),
    "window": dict(window_left=100, window_right=20),
    "sinks": dict(has_sinks=True),
    "softcap": dict(softcap=30.0),
    "gqa": dict(heads_q=8, heads_k=2),
    "mqa decode": dict(seqlen_q=1, heads_q=8, heads_k=1),
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2
_ARCH_SPECIFIC_FLAG = 0x100000  # set on sm_90a / sm_100a machine code


def fatbin_entries(path):
    """[(kind, sm, arch_specific)] of the fatbin entries in an ELF shared library's .nv_fatbin section: kind 1 is PTX,
    2 machine code (a cubin). Each container is a 16-byte header (magic, version, header size, size) followed by
    entries, each a header (kind at byte 0, its header size at 4, payload size at 8, sm at 28, flags at 40) and its
    payload."""
    data = pathlib.Path(path).read_bytes()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size
    names_offset = section(shstrndx)[1]
    fatbin = None
    for i in range(shnum):
        name, offset, size = section(i)
        if data[names_offset + name:data.index(b"\0", names_offset + name)] == b".nv_fatbin":
            fatbin = (offset, size)
    if fatbin is None:
        return []
    entries = []
    pos, end = fatbin[0], fatbin[0] + fatbin[1]
    while pos + 16 <= end:
        magic, _, header_size, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != _FATBIN_MAGIC:  # containers are 8-byte aligned
            pos += 8
            continue
        entry = pos + header_size
        while entry < pos + header_size + size:
            kind = struct.unpack_from("<H", data, entry)[0]
            entry_header, payload = struct.unpack_from("<IQ", data, entry + 4)
            sm, flags = struct.unpack_from("<I", data, entry + 28)[0], struct.unpack_from("<I", data, entry + 40)[0]
            entries.append((kind, sm, bool(flags & _ARCH_SPECIFIC_FLAG)))
            entry += entry_header + payload
        pos += header_size + size
    return entries


def _arch(spec):
    """CMake spelling -> (sm, arch_specific, machine code, PTX): "90a-real" -> (90, True, True, False)."""
    number, _, kind = spec.partition("-")
    specific = number.endswith("a")
    return int(number.rstrip("a")), specific, kind in ("", "real"), kind in ("", "virtual")


def _runs_on(spec, sm):
    """dispatch.cpp's arch_runs_on, for the tests' expectations."""
    arch, specific, real, ptx = _arch(spec)
    if specific:
        return arch == sm and real
    return (real and arch // 10 == sm // 10 and arch <= sm) or (ptx and arch <= sm)


def test_the_library_holds_each_architectures_kernels():
    info = _ffi.build_info()
    entries = fatbin_entries(info["path"])
    kernels = info["kernels"]
    for spec in info["cuda_archs"]:
        sm, specific, real, ptx = _arch(spec)
        # One cubin per kernel translation unit (one per table row) and architecture; arch-specific families
        # (sm90: wgmma) compile for their own "a" target only.
        rows = [k for k in kernels if not k["arch_specific"] or (specific and k["family"] == f"sm{sm}")]
        if real:
            cubins = sum(1 for e in entries if e == (_KIND_ELF, sm, specific))
            assert cubins >= len(rows), f"{spec}: {cubins} cubins for {len(rows)} kernel rows"
        if ptx:
            assert any(e[0] == _KIND_PTX and e[1] == sm for e in entries), f"{spec}: no PTX"
    assert {(e[1], e[2]) for e in entries if e[0] == _KIND_ELF} <= {
        (_arch(s)[0], _arch(s)[1]) for s in info["cuda_archs"] if _arch(s)[2]}, "machine code the build info omits"


def _rows():
    by_key = {}
    for k in _ffi.build_info()["kernels"]:
        by_key.setdefault((k["direction"], k["dtype"], k["head_dim"]), []).append(k)
    return by_key


def _limit(sm):
    return _ffi.plan(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=1, heads_q=1, heads_k=1, head_dim=64,
                     device_sm=sm)["device"]["smem_per_block_optin"]


def _disabled():
    return set(os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").replace(";", ",").split(","))


def _expected_row(rows, sm, limit):
    """The row dispatch should take on sm: of the newest family that runs there and has a row that fits, its largest
    row that fits (None when none does)."""
    def family_sm(k):
        return int(k["family"][2:])
    runs = [k for k in rows if k["family"] not in _disabled() and (
        family_sm(k) == sm if k["arch_specific"] else family_sm(k) <= sm) and k["smem_bytes"] <= limit]
    if not runs:
        return None
    newest = max(family_sm(k) for k in runs)
    return max((k for k in runs if family_sm(k) == newest), key=lambda k: k["smem_bytes"])


@pytest.mark.parametrize("sm", GPUS)
def test_every_call_on_each_gpu_runs_the_largest_kernel_that_fits(sm):
    info = _ffi.build_info()
    if not any(_runs_on(spec, sm) for spec in info["cuda_archs"]):
        plan = _ffi.plan(dtype="bfloat16", batch=1, seqlen_q=64, seqlen_k=64, heads_q=1, heads_k=1, head_dim=64,
                         device_sm=sm)
        assert not plan["runs"] and f"no code for sm_{sm}" in plan["reason"], plan["reason"]
        pytest.skip(f"this build ({', '.join(info['cuda_archs'])}) has no code for sm_{sm}")
    if os.environ.get("FLASHJAX_SMEM_LIMIT_KB"):
        pytest.skip("FLASHJAX_SMEM_LIMIT_KB caps the shared memory of every GPU")
    limit = _limit(sm)
    rows = _rows()
    checked = 0
    for dtype, name in DTYPES.items():
        for head_dim in HEAD_DIMS:
            if (("fwd", dtype, head_dim) not in rows or ("bwd", dtype, head_dim) not in rows
                    or not any(k["family"] == "sm80" for k in rows[("bwd", dtype, head_dim)])):
                continue  # a width the build's kernel set lacks (the CI set has 64 only)
            for feature, options in FEATURES.items():
                call = dict(batch=2, seqlen_q=300, seqlen_k=500, heads_q=4, heads_k=4)
                call.update(options)
                plan = _ffi.plan(dtype=name, head_dim=head_dim - 8, device_sm=sm, **call)
                where = f"sm_{sm} {dtype} D {head_dim} {feature}"
                assert plan["runs"], f"{where}: {plan['reason']}"
                for direction in ("fwd", "bwd"):
                    want = _expected_row(rows[(direction, dtype, head_dim)], sm, limit)
                    got = plan[direction]
                    assert want is not None and got["family"] == want["family"], f"{where} {direction}: {got}"
                    assert got["smem_bytes"] == want["smem_bytes"] <= limit, f"{where} {direction}: {got}"
                checked += 1
    assert checked, "no width with both directions in this build"


def test_blackwell_takes_the_large_tiles_on_sm100_and_the_small_ones_on_sm120():
    rows = _rows()
    if ("bwd", "bf16", 256) not in rows or len(rows[("bwd", "bf16", 256)]) < 2:
        pytest.skip("needs the full kernel set (the sm80 backward's 163 KB and 99 KB rows at D 256)")
    sizes = sorted(k["smem_bytes"] for k in rows[("bwd", "bf16", 256)] if k["family"] == "sm80")
    archs = _ffi.build_info()["cuda_archs"]
    for sm, want in ((100, sizes[-1]), (120, sizes[0])):
        if not any(_runs_on(spec, sm) for spec in archs):
            continue
        plan = _ffi.plan(dtype="bfloat16", batch=1, seqlen_q=512, seqlen_k=512, heads_q=4, heads_k=4, head_dim=256,
                         device_sm=sm)
        assert plan["runs"] and plan["bwd"]["family"] == "sm80" and plan["bwd"]["smem_bytes"] == want, plan


def test_the_shared_memory_knob_caps_every_gpu():
    # FLASHJAX_SMEM_LIMIT_KB is read once per process, so a fresh one: an H200 with the knob at 99 plans what an
    # RTX 4090 plans (with the sm90 family disabled, as a 99 KB GPU has none).
    rows = _rows()
    code = ("import json; from flashjax import _ffi\n"
            "plans = {sm: {d: _ffi.plan(dtype='bfloat16', batch=1, seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=4,"
            " head_dim=d, window_right=0, device_sm=sm) for d in (64, 96, 128, 192, 256)} for sm in (89, 90)}\n"
            "print(json.dumps({'plans': plans, 'settings': _ffi.build_info()['settings']}))")
    env = dict(os.environ, FLASHJAX_SMEM_LIMIT_KB="99", FLASHJAX_DISABLE_FAMILIES="sm90", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(_ffi.__file__)),
                                                     env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert {s["name"]: s["value"] for s in out["settings"]}["FLASHJAX_SMEM_LIMIT_KB"] == "99"
    capped, rtx = out["plans"]["90"], out["plans"]["89"]
    for d, plan in capped.items():
        assert plan["device"]["smem_per_block_optin"] == 99 * 1024
        if ("fwd", "bf16", int(d)) not in rows or ("bwd", "bf16", int(d)) not in rows:
            continue  # a width the build's kernel set lacks
        assert plan["runs"], plan["reason"]
        for direction in ("fwd", "bwd"):
            assert plan[direction]["family"] == "sm80" and plan[direction]["smem_bytes"] <= 99 * 1024, plan
            assert plan[direction]["smem_bytes"] == rtx[d][direction]["smem_bytes"], (plan, rtx[d])
