"""The compiled library: loads with ctypes without a GPU, describes its build, answers dispatch questions and
registers its FFI targets. CI builds it with the small kernel set before running these."""
import ctypes
import os
import re
import warnings
from pathlib import Path

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
    assert info["kernel_set"] in ("full", "ci", "bench", "none")
    assert info["cuda_archs"] and all(a[:2].isdigit() for a in info["cuda_archs"])
    names = [s["name"] for s in info["settings"]]
    assert names == ["FLASHJAX_DISABLE_FAMILIES", "FLASHJAX_SM90_PACK_GQA", "FLASHJAX_SM90_SPLIT_KV",
                     "FLASHJAX_SM90_MAX_CTAS", "FLASHJAX_SM90_PDL", "FLASHJAX_SM90_VARLEN_WALK",
                     "FLASHJAX_SMEM_LIMIT_KB"]
    assert all(s["meaning"] and s["value"] == os.environ.get(s["name"], "") for s in info["settings"])
    for kernel in info["kernels"]:
        assert kernel["direction"] in ("fwd", "bwd", "tangent", "jvp") and kernel["dtype"] in ("fp16", "bf16")
        assert kernel["head_dim"] in (64, 96, 128, 192, 256)
    if info["kernel_set"] == "ci":
        expected = {("sm80", "fwd"), ("sm80", "bwd"), ("sm80", "tangent")}
        if any(a.startswith("90a") for a in info["cuda_archs"]):  # the Hopper family compiles for sm_90a only
            expected |= {("sm90", "fwd"), ("sm90", "bwd"), ("sm90", "tangent"), ("sm90", "jvp")}
        assert {(k["family"], k["direction"]) for k in info["kernels"]} == expected


def _plan(sm, dtype="bfloat16", head_dim=64, num_sms=0, **sizes):
    """The library's plan of a call of these sizes (defaults: B 2, S 256, 8 heads) on a GPU of compute capability
    sm."""
    call = dict(batch=2, seqlen_q=256, seqlen_k=256, heads_q=8, heads_k=8)
    call.update(sizes)
    return _ffi.plan(dtype=dtype, head_dim=head_dim, device_sm=sm, num_sms=num_sms, **call)


def _pass(sm, direction, dtype, head_dim, **keywords):
    """(a kernel runs it, its reason, its family) for one pass of a call."""
    plan = _plan(sm, dtype, head_dim, **keywords)[direction]
    return plan["family"] is not None, plan["reason"], plan["family"]


@pytest.mark.parametrize("d,width", [(8, 64), (64, 64), (72, 96), (200, 256), (256, 256), (264, 0)])
def test_the_plan_pads_the_head_dim(d, width):
    assert _plan(90, head_dim=d)["head_dim"] == width


def test_the_plan_answers_with_reasons():
    info = _ffi.build_info()
    ok, reason, _ = _pass(70, "fwd", "bfloat16", 128)
    assert not ok and "no code for sm_70" in reason
    # Varlen: the newest family whose rows take packed sequences (on Hopper the sm90 family both ways, the sm80
    # family both ways elsewhere), its backward's workspace one slab per query head.
    sm = 90 if any(a.startswith("90") for a in info["cuda_archs"]) else 80  # sm80 code runs on sm_90 only as 90a
    plan = _plan(sm, head_dim=64, varlen=True, batch=3, seqlen_q=300)
    for direction in ("fwd", "bwd"):
        rows = {k["family"] for k in info["kernels"] if k["direction"] == direction and k["dtype"] == "bf16" and
                k["head_dim"] == 64 and k.get("varlen")}
        expected = "sm90" if sm == 90 and "sm90" in rows else "sm80" if "sm80" in rows else None
        assert plan[direction]["family"] == expected, plan[direction]
        if expected is not None:
            assert "varlen" in plan[direction]["reason"], plan
        if expected == "sm90":  # one tile per (sequence block, query head): unpacked, unsplit
            assert plan["fwd"]["pack_group"] == 1 and plan["fwd"]["num_splits"] == 1, plan["fwd"]
    assert all(k["varlen"] for k in info["kernels"] if k["family"] == "sm90" and k["direction"] in ("fwd", "bwd"))
    if plan["bwd"]["family"] is not None:  # (300 / 64 + 3) * 64 = 448 rows, rounded up to 512
        assert [b["shape"] for b in plan["bwd"]["workspace"]] == [[8, 512, 64], [8, 512], [8, 512]], plan["bwd"]
    # No backward orders varlen's dq sums (the sm90 one's counters are per dense batch, the sm80 one adds atomically).
    assert not _plan(sm, head_dim=64, varlen=True, deterministic=True)["runs"]
    if any(a.startswith("80") for a in info["cuda_archs"]):  # the portable backward cannot order its dq atomics
        plan = _plan(80, deterministic=True)
        assert not plan["runs"] and "deterministic=True" in plan["reason"], plan["reason"]
    compiled = {(k["direction"], k["dtype"], k["head_dim"]) for k in info["kernels"]}
    for direction in ("fwd", "bwd"):
        ok, reason, family = _pass(80, direction, "bfloat16", 64)
        assert ok == ((direction, "bf16", 64) in compiled and any(a.startswith("80") for a in info["cuda_archs"]))
        if ok:
            assert family == "sm80" and "sm80" in reason


def test_mask_mods_take_the_newest_family_that_reads_the_bits():
    # Mask mods (issue 38): the rows marked mask_mod (on Hopper the sm90 family both ways, the sm80 family both ways
    # elsewhere). The sm90 forward's workspace holds its block lists ahead of the classes: rows of
    # 4 (n_blocks + 2) + n_blocks bytes for its 128 x 128 tiles at D 64. The sm90 backward's holds per key block
    # its query blocks: for its 64 x 128 tiles (5 x 4 at Sq 300, Sk 500) 4 * 4 (5 + 2) + 5 * 4 bytes per (b, h).
    info = _ffi.build_info()
    sm = 90 if any(a.startswith("90") for a in info["cuda_archs"]) else 80
    plan = _plan(sm, mask_mod=True, seqlen_q=300, seqlen_k=500)
    for direction in ("fwd", "bwd"):
        rows = {k["family"] for k in info["kernels"] if k["direction"] == direction and k["dtype"] == "bf16" and
                k["head_dim"] == 64 and k.get("mask_mod")}
        expected = "sm90" if sm == 90 and "sm90" in rows else "sm80" if "sm80" in rows else None
        assert plan[direction]["family"] == expected, plan[direction]
        if expected is not None:
            assert "mask mod" in plan[direction]["reason"], plan[direction]["reason"]
    assert all(k.get("mask_mod") for k in info["kernels"] if k["family"] == "sm90" and k["direction"] == "bwd")
    if plan["bwd"]["family"] == "sm90":
        bwd = plan["bwd"]
        assert (bwd["block_m"], bwd["block_n"]) == (64, 128), bwd
        assert bwd["workspace"][-1]["name"] == "mask_tile_classes", bwd["workspace"]
        assert bwd["workspace"][-1]["shape"] == [2, 8, 4 * 4 * (5 + 2) + 5 * 4], bwd["workspace"]
    # deterministic=True with a mask mod: the sm90 backward orders its dq adds by the same classes its lists come from;
    # its workspace has the counters, then the classes. The sm80 backward adds with atomics: refused, saying why.
    ordered = _plan(sm, mask_mod=True, deterministic=True, seqlen_q=300, seqlen_k=500)
    if plan["bwd"]["family"] == "sm90":
        names = [b["name"] for b in ordered["bwd"]["workspace"]]
        assert ordered["bwd"]["family"] == "sm90" and names[-2:] == ["dq_semaphore", "mask_tile_classes"], ordered
        assert "fixed order" in ordered["bwd"]["reason"] and "mask mod" in ordered["bwd"]["reason"], ordered["bwd"]
    else:  # the sm80 row is refused for its atomics (a build without either row has nothing to refuse)
        assert ordered["bwd"]["family"] is None, ordered["bwd"]
        assert plan["bwd"]["family"] is None or "deterministic=True" in ordered["bwd"]["reason"], ordered["bwd"]
    assert ordered["fwd"]["family"] == plan["fwd"]["family"], ordered["fwd"]
    if plan["fwd"]["family"] == "sm90":
        fwd = plan["fwd"]
        assert (fwd["block_m"], fwd["block_n"], fwd["pack_group"], fwd["num_splits"]) == (128, 128, 1, 1), fwd
        assert [b["shape"] for b in fwd["workspace"]] == [[2, 8, 3, 4 * (4 + 2) + 4]], fwd["workspace"]


def test_the_tangent_is_the_sm90_familys_on_hopper_and_the_sm80_familys_elsewhere():
    # Forward mode (issue 39): dense tangents on the sm90 tangent kernel on Hopper where the build has it, on the sm80
    # one on every other device with its code; varlen tangents on the sm80 one everywhere.
    info = _ffi.build_info()

    def compiled(family):
        return any(k["family"] == family and k["direction"] == "tangent" and k["dtype"] == "bf16"
                   and k["head_dim"] == 64 for k in info["kernels"])
    for sm in (80, 86, 89, 90, 100, 120):
        tangent = _plan(sm)["tangent"]
        assert tangent["workspace"] == []
        if tangent["family"] is None:  # only where the build lacks the row or code for the device
            assert not compiled("sm80") or "holds no code for" in tangent["reason"], (sm, tangent)
            continue
        family = "sm90" if sm == 90 and compiled("sm90") else "sm80"
        assert tangent["family"] == family, (sm, tangent)
        assert tangent["reason"].startswith(f"{family} tangent kernel, bf16, head dim 64"), tangent["reason"]
        block_m = 128 if family == "sm90" else 64
        assert tangent["block_m"] == block_m and tangent["block_n"] == 64, tangent
    compiled = compiled("sm80")
    varlen = _plan(90, varlen=True)["tangent"]
    if compiled:
        assert varlen["family"] == "sm80" and "varlen" in varlen["reason"], varlen


def test_the_plan_names_the_family_of_the_row_it_picks():
    # explain() learns the family from the plan's field, never from the reason's wording.
    info = _ffi.build_info()
    families = {}
    for k in info["kernels"]:
        families.setdefault((k["direction"], k["dtype"], k["head_dim"]), set()).add(k["family"])
    for (direction, dtype, head_dim), offered in families.items():
        for sm in (80, 90):
            ok, reason, family = _pass(sm, direction, DTYPE_NAME[dtype], head_dim)
            assert (family is not None) == ok, (sm, direction, dtype, head_dim, reason)
            if ok:
                assert family in offered and reason.startswith(family), (family, reason)
                # on Hopper the Hopper family wins where it is compiled
                assert sm == 80 or "sm90" not in offered or family == "sm90", (direction, dtype, head_dim)


def test_the_plan_sizes_the_backward_workspace():
    bwd = _plan(80, head_dim=72, batch=3, seqlen_q=300, heads_q=8, heads_k=2)["bwd"]
    assert [(b["name"], b["shape"]) for b in bwd["workspace"]] == [
        ("dq_accum", [3, 8, 384, 96]), ("dpsum", [3, 8, 384]), ("lse_log2", [3, 8, 384])]


def test_deterministic_backward_takes_the_sm90_family_with_its_counters():
    info = _ffi.build_info()
    rows = {(k["family"], k["direction"], k["dtype"], k["head_dim"]) for k in info["kernels"]}
    ordered = {(k["family"], k["dtype"], k["head_dim"]) for k in info["kernels"] if k["deterministic"]}
    assert all(k["direction"] == "bwd" for k in info["kernels"] if k["deterministic"])
    if ("sm90", "bf16", 64) not in ordered:
        pytest.skip("this build has no sm90 backward marked deterministic (tools/gen_kernels.py's DETERMINISTIC)")
    plan = _plan(90, head_dim=64, batch=3, seqlen_q=300, heads_q=8, heads_k=2, deterministic=True)
    assert plan["runs"] and plan["bwd"]["family"] == "sm90" and "fixed order" in plan["bwd"]["reason"]
    assert [(b["name"], b["shape"], b["dtype"]) for b in plan["bwd"]["workspace"]] == [
        ("dq_accum", [3, 8, 384, 64], "float32"), ("dpsum", [3, 8, 384], "float32"),
        ("lse_log2", [3, 8, 384], "float32"), ("dq_semaphore", [3, 8, 6], "int32")]
    # head dims without an sm90 backward row are refused, naming the option, rather than run unordered
    if ("sm90", "bwd", "bf16", 256) not in rows and ("sm80", "bwd", "bf16", 256) in rows:
        refused = _plan(90, head_dim=256, deterministic=True)
        assert not refused["runs"] and "deterministic=True" in refused["bwd"]["reason"], refused["bwd"]["reason"]


def test_the_plan_refuses_a_mismatched_struct():
    # The library checks the caller's struct sizes: a package and a library of different versions fail loudly.
    lib = _ffi.library()
    problem = _ffi._Problem(ctypes.sizeof(_ffi._Problem) - 4)
    device = _ffi._Device(ctypes.sizeof(_ffi._Device), 90, 0, 132)
    assert lib.flashjax_plan(ctypes.byref(problem), ctypes.byref(device), None, 0) == -1


DTYPE_NAME = {"bf16": "bfloat16", "fp16": "float16"}
DIRECTION_NAME = {"fwd": "forward", "bwd": "backward", "tangent": "tangent", "jvp": "fused jvp"}
FAMILY_SM = {"sm80": 80, "sm90": 90}


def _kb(n):
    """dispatch.cpp's spelling of a byte count: KB to a tenth, without a trailing .0."""
    tenths = (n * 10 + 512) // 1024
    return f"{tenths // 10}" + (f".{tenths % 10}" if tenths % 10 else "") + " KB"


def _smem_rows(family, direction, dtype, head_dim):
    """The library's figures for one (family, direction, dtype, head dim), one per row (the sm80 family has a row
    with smaller tiles where its 163 KB ones do not fit 99 KB): each kernel's own <direction>_smem_bytes."""
    return sorted(k["smem_bytes"] for k in _ffi.build_info()["kernels"]
                  if (k["family"], k["direction"], k["dtype"], k["head_dim"]) == (family, direction, dtype, head_dim))


def _smem(family, direction, dtype, head_dim):
    """The least figure of those rows (None when the build lacks them): what a GPU must hold to run one of them."""
    rows = _smem_rows(family, direction, dtype, head_dim)
    return rows[0] if rows else None


def test_every_kernel_reports_shared_memory_its_own_arch_holds():
    # The figures come from the kernels' types (fwd_smem_bytes / bwd_smem_bytes next to each launcher); nothing
    # outside the kernels restates them, so check what must hold of any figure: positive, and within the per-block
    # limit of the arch the family is written for (else dispatch could never pick it there), 227 KB at most.
    for k in _ffi.build_info()["kernels"]:
        n = k["smem_bytes"]
        assert isinstance(n, int) and 0 < n <= 227 * 1024, k
        assert n <= _smem_limit(FAMILY_SM[k["family"]]), k


def _smem_limit(sm):
    return _plan(sm)["device"]["smem_per_block_optin"]


def test_shared_memory_limits_per_arch():
    assert _smem_limit(80) == 163 * 1024
    for sm in (86, 89, 120):
        assert _smem_limit(sm) == 99 * 1024
    assert _smem_limit(90) == 227 * 1024


@pytest.mark.parametrize("sm", [80, 86, 89])
def test_dispatch_takes_the_largest_sm80_row_that_fits(sm):
    # Of an sm80 (direction, dtype, head dim)'s rows, the one with the most shared memory the device holds; none
    # (with both numbers in the reason) only where even the smallest does not fit.
    info = _ffi.build_info()
    if not any(a.startswith("80") for a in info["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    limit = _smem_limit(sm)
    for k in info["kernels"]:
        if k["family"] != "sm80":
            continue
        rows = _smem_rows("sm80", k["direction"], k["dtype"], k["head_dim"])
        fits = [n for n in rows if n <= limit]
        plan = _plan(sm, DTYPE_NAME[k["dtype"]], k["head_dim"])[k["direction"]]
        assert (plan["family"] is not None) == bool(fits), (k, plan["reason"])
        if fits:
            assert plan["family"] == "sm80" and plan["smem_bytes"] == max(fits), (k, plan)
        else:
            assert plan["reason"] == (f"the sm80 {DIRECTION_NAME[k['direction']]} kernel for {k['dtype']} head dim "
                                      f"{k['head_dim']} needs {_kb(rows[0])} of shared memory per block; sm_{sm} "
                                      f"allows {_kb(limit)}")


@pytest.mark.parametrize("sm", [80, 90])
def test_dispatch_takes_every_kernel_on_its_own_arch(sm):
    # Each family's kernels fit the per-block shared memory of the arch they are written for.
    info = _ffi.build_info()
    family = f"sm{sm}"
    if not any(a.startswith(str(sm)) for a in info["cuda_archs"]):
        pytest.skip(f"no {family} code in this build")
    if family in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").replace(";", ",").split(","):
        pytest.skip(f"FLASHJAX_DISABLE_FAMILIES leaves {family} out of dispatch")
    for k in info["kernels"]:
        if k["family"] != family:
            continue
        ok, reason, _ = _pass(sm, k["direction"], DTYPE_NAME[k["dtype"]], k["head_dim"])
        assert ok and reason.startswith(f"{family} {DIRECTION_NAME[k['direction']]} kernel"), (k, reason)


def _refusal_on_99_kb(head_dim, sm):
    """What dispatch says on a 99 KB GPU about the sm80 bf16 kernels of head_dim, from the library's own figures:
    None when both directions fit, else the reason of the first that does not (the forward is asked first)."""
    for direction in ("fwd", "bwd"):
        n = _smem("sm80", direction, "bf16", head_dim)
        if n > 99 * 1024:
            return (f"the sm80 {DIRECTION_NAME[direction]} kernel for bf16 head dim {head_dim} needs {_kb(n)} of "
                    f"shared memory per block; sm_{sm} allows 99 KB")
    return None


def test_explain_on_a_99_kb_gpu():
    # sm86/89/120 allow 99 KB per block: backend="auto" takes the sm80 kernel only when both directions have a row
    # that fits there (every width of the full set: the 99 KB rows), and otherwise names the kernel that does not.
    if not any(a.startswith("80") for a in _ffi.build_info()["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    spec = jax.ShapeDtypeStruct
    for d in (64, 96, 128, 192, 256):
        if _smem("sm80", "fwd", "bf16", d) is None or _smem("sm80", "bwd", "bf16", d) is None:
            continue  # the small CI kernel set has head dim 64 only
        q = spec((1, 256, 8, d), jnp.bfloat16)
        text = flashjax.explain(q, q, q, causal=True, device_sm=86)
        refusal = _refusal_on_99_kb(d, 86)
        if refusal is None:
            assert ": kernel (sm80 forward kernel" in text, text
        else:
            assert f": reference ({refusal})" in text, text
            assert ": kernel (" in flashjax.explain(q, q, q, causal=True, device_sm=80)


def test_explain_says_where_the_sm90_forward_packs_gqa():
    # The rule is the library's (csrc/kernels/sm90/fwd_pack_gqa.h), asked through the C API as the launcher asks it.
    if _smem("sm90", "fwd", "bf16", 64) is None or _smem("sm80", "bwd", "bf16", 64) is None:
        pytest.skip("no sm90 forward with an sm80 backward at head dim 64 in this build")
    spec = jax.ShapeDtypeStruct

    def text(seqlen_q, heads_q, heads_k, device_sm=90):
        q = spec((2, seqlen_q, heads_q, 64), jnp.bfloat16)
        k = spec((2, 4096, heads_k, 64), jnp.bfloat16)
        return flashjax.explain(q, k, k, device_sm=device_sm)

    assert "; GQA packed: the 4 query heads of a KV head share each forward tile" in text(1, 32, 8)
    assert "GQA packed: the 8 query heads" in text(60, 16, 2)
    assert "GQA packed: the 4 query heads" in text(129, 32, 8)  # 5 packed tiles per KV head against 8
    for sizes in ((4000, 32, 8), (128, 32, 8), (97, 32, 8), (200, 32, 4), (100, 16, 2), (1, 16, 16)):
        assert "GQA packed" not in text(*sizes), sizes
    assert "GQA packed" not in text(1, 32, 8, device_sm=80)  # the sm80 forward does not pack
    assert _plan(90, seqlen_q=1, seqlen_k=4096, heads_q=32, heads_k=8)["fwd"]["pack_group"] == 4
    assert _plan(90, seqlen_q=4000, seqlen_k=4096, heads_q=32, heads_k=8)["fwd"]["pack_group"] == 1


def test_auto_warns_once_with_the_shared_memory_reason(monkeypatch):
    if not any(a.startswith("80") for a in _ffi.build_info()["cuda_archs"]):
        pytest.skip("no sm80-family code in this build")
    widths = [d for d in (64, 96, 128, 192, 256)
              if _smem("sm80", "fwd", "bf16", d) is not None and _smem("sm80", "bwd", "bf16", d) is not None
              and _refusal_on_99_kb(d, 89) is not None]
    if not widths:
        pytest.skip("no sm80 kernel in this build needs more than 99 KB (the small CI set)")
    d = widths[0]
    from flashjax import api
    q = jax.ShapeDtypeStruct((1, 256, 8, d), jnp.bfloat16)
    call = api._dense_call(q, q, q, causal=True)
    monkeypatch.setattr(api, "_warned", set())
    with pytest.warns(UserWarning, match=re.escape(_refusal_on_99_kb(d, 89))):
        assert api.choose(call, device_sm=89)[0] == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.choose(call, device_sm=89)[0] == "reference"


def test_registers_ffi_targets():
    _ffi.register_targets()
    _ffi.register_targets()  # idempotent: the library is loaded and registered once per process
    assert _ffi.library() is _ffi.library()


def test_sm90_split_keys_rule():
    # csrc/kernels/sm90/fwd_split_kv.h through the plan: split where tiles fill at most half of the SMs and the rows
    # see at least 8 KV blocks, into as many parts as fit the SMs (at least 4 blocks each); capped calls alike.
    if _smem("sm90", "fwd", "bf16", 64) is None:
        pytest.skip("no sm90 forward at head dim 64 in this build")

    # Head dim 64 (the CI set's): 128 keys per block for these calls, as at 128.
    def splits(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim=64, window_left=-1, softcap=0.0, sms=132):
        fwd = _plan(90, head_dim=head_dim, num_sms=sms, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                    heads_q=heads_q, heads_k=heads_k, window_left=window_left, softcap=softcap)["fwd"]
        if fwd["num_splits"] > 1:
            assert fwd["workspace"][0]["shape"] == [batch, fwd["num_splits"], heads_q, seqlen_q, head_dim]
            assert fwd["pack_group"] == heads_q // heads_k  # the split kernel packs every GQA call
        return fwd["num_splits"]
    assert splits(1, 1, 8192, 32, 8) == 16  # 8 packed tiles, 64 blocks of 128 keys
    assert splits(1, 1, 32768, 16, 16) == 8  # 16 tiles
    assert splits(2, 16, 5000, 16, 2) == 10  # 4 tiles, 40 blocks
    assert splits(1, 1, 8192, 32, 8, sms=78) == 9
    assert splits(1, 1, 8192, 32, 8, softcap=5.0) == 16  # the split kernel has a capped twin
    for whole in (splits(64, 1, 8192, 32, 8), splits(1, 1, 500, 32, 8), splits(1, 4096, 4096, 16, 16),
                  splits(1, 64, 8192, 32, 8, window_left=100),
                  splits(1, 1, 8192, 32, 8, sms=0), splits(1, 1, 0, 32, 8), splits(0, 1, 8192, 32, 8)):
        assert whole == 1


def _sm90_on_the_default_device(monkeypatch):
    if _smem("sm90", "fwd", "bf16", 64) is None or _smem("sm80", "bwd", "bf16", 64) is None:
        pytest.skip("no sm90 forward with an sm80 backward at head dim 64 in this build")
    monkeypatch.setattr(_ffi, "default_device", lambda: (90, 132))  # an H100 / H200, as the lowering sees it


def test_explain_says_where_the_sm90_forward_splits_keys(monkeypatch):
    _sm90_on_the_default_device(monkeypatch)
    spec = jax.ShapeDtypeStruct
    q, k = spec((1, 1, 32, 64), jnp.bfloat16), spec((1, 8192, 8, 64), jnp.bfloat16)
    text = flashjax.explain(q, k, k, device_sm=90)
    assert "GQA packed: the 4 query heads" in text and "keys run as 16 parts" in text, text
    assert "keys run as 16 parts" in flashjax.explain(q, k, k, softcap=5.0, device_sm=90)
    assert "keys split" not in flashjax.explain(q, k, k, device_sm=80)


def test_split_keys_lower_to_the_split_target_with_its_workspace(monkeypatch):
    # The workspace exists only inside the lowering: the primitive still returns (out, lse), and the FFI call has
    # two more f32 results, [B, parts, Hq, Sq, D] and [B, parts, Hq, Sq].
    _sm90_on_the_default_device(monkeypatch)
    monkeypatch.setattr(_ffi, "register_targets", lambda: None)  # registration serves compiling only
    from flashjax import primitives
    q = jnp.ones((1, 1, 32, 64), jnp.bfloat16)
    k = jnp.ones((1, 8192, 8, 64), jnp.bfloat16)
    sinks = jnp.zeros((32,), jnp.float32)

    def lowered(seqlen_k, softcap=0.0):
        params = dict(softmax_scale=0.125, softcap=softcap, window_left=-1, window_right=-1, has_sinks=True)
        fn = jax.jit(lambda q, k, v, s: primitives.forward(q, k, v, s, **params))
        return fn.trace(q, k[:, :seqlen_k], k[:, :seqlen_k], sinks).lower(lowering_platforms=("cuda",)).as_text()

    for softcap in (0.0, 5.0):
        split = [line for line in lowered(8192, softcap).splitlines() if "stablehlo.custom_call" in line]
        assert len(split) == 1 and "@flashjax_fwd_split" in split[0], split
        assert "num_splits = 16 : i32" in split[0] and "tensor<1x16x32x1x64xf32>" in split[0], split[0]
    whole = lowered(500)
    assert "@flashjax_fwd(" in whole and "flashjax_fwd_split" not in whole


def test_the_backward_lowers_with_the_plans_workspace(monkeypatch):
    # dq accumulator and per-row statistics as the plan sizes them (rows rounded up to 128): three more f32 results
    # of the FFI call, which the primitive does not return.
    if _smem("sm80", "bwd", "bf16", 64) is None:
        pytest.skip("no sm80 backward at head dim 64 in this build")
    monkeypatch.setattr(_ffi, "default_device", lambda: (80, 108))
    monkeypatch.setattr(_ffi, "register_targets", lambda: None)
    from flashjax import primitives
    q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    params = dict(softmax_scale=0.125, softcap=0.0, window_left=-1, window_right=0, has_sinks=False,
                  has_dlse=False)
    fn = jax.jit(lambda *a: primitives.bwd_p.bind(*a, **params))
    text = fn.trace(q, k, k, q, lse, q, lse, sinks).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "@flashjax_bwd" in line]
    assert len(call) == 1, text
    assert "tensor<2x4x384x64xf32>, tensor<2x4x384xf32>, tensor<2x4x384xf32>" in call[0], call[0]


def test_the_varlen_backward_lowers_with_its_workspace(monkeypatch):
    # flashjax_bwd_varlen: q, k, v, o, lse, dout, the offsets, then only the optional operands whose flag is set
    # (seqused_q, seqused_k, dlse, sinks); three more f32 results sized per query head for Tq tokens and N sequences.
    if _smem("sm80", "bwd", "bf16", 64) is None:
        pytest.skip("no sm80 backward at head dim 64 in this build")
    monkeypatch.setattr(_ffi, "default_device", lambda: (80, 108))
    monkeypatch.setattr(_ffi, "register_targets", lambda: None)
    from flashjax import varlen_kernel
    q = jax.ShapeDtypeStruct((300, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((200, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((4, 300), jnp.float32)
    cu, used = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    for has_dlse, has_seqused in ((False, False), (True, True)):
        params = dict(softmax_scale=0.125, softcap=0.0, window_left=-1, window_right=0, has_sinks=False,
                      has_dlse=has_dlse, has_seqused_q=has_seqused, has_seqused_k=has_seqused, max_seqlen_q=7,
                      max_seqlen_k=None)
        fn = jax.jit(lambda *a: varlen_kernel.bwd_varlen_p.bind(*a, **params))
        text = fn.trace(q, k, k, q, lse, q, cu, cu, used, used, lse, sinks).lower(
            lowering_platforms=("cuda",)).as_text()
        call = [line for line in text.splitlines() if "@flashjax_bwd_varlen" in line]
        assert len(call) == 1, text
        operands = call[0].split("(", 1)[1].split(")", 1)[0].split(",")
        assert len(operands) == 8 + 2 * has_seqused + has_dlse, call[0]
        # (300 / 64 + 3) * 64 = 448 rows per head, rounded up to 512; no N x max_seqlen anywhere.
        assert "tensor<4x512x64xf32>, tensor<4x512xf32>, tensor<4x512xf32>" in call[0], call[0]
        assert "max_seqlen" not in call[0]


def test_export_checks_cover_every_ffi_target_the_library_defines():
    """flashjax.export_checks() lets jax.export through every custom call flashjax lowers to: one check per handler
    the C++ sources define (an execute/instantiate pair is one target), none for a target that does not exist."""
    sources = (Path(__file__).resolve().parents[2] / "csrc").rglob("*.cpp")
    symbols = {m for path in sources for m in re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((flashjax_\w+),",
                                                         path.read_text())}
    targets = {re.sub(r"_(instantiate|execute)$", "", s) for s in symbols}
    checked = [c.is_custom_call() for c in flashjax.export_checks()]
    assert targets == set(_ffi.ALL_TARGETS) and sorted(checked) == sorted(targets)
