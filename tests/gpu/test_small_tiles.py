"""The sm80 family's 99 KB rows (the tiles of sm86/89/120: RTX 30/40/50, A10, L4, L40, RTX PRO 6000) on whatever GPU
runs the tests: FLASHJAX_SMEM_LIMIT_KB=99 with FLASHJAX_DISABLE_FAMILIES=sm90 makes dispatch plan, and run, what a
99 KB GPU would. Both settings are read once per process, so the fixed cases below run in a process of their own; the
whole GPU suite run under the same two settings (a device_check stage) takes the small tiles for every call of the
sweep, which test_the_plan_takes_the_99_kb_rows_under_the_cap checks in that run."""
import os
import subprocess
import sys

import numpy as np
import pytest

import flashjax
import sweep
from flashjax import _ffi

SEED = int(os.environ.get("FLASHJAX_SWEEP_SEED", np.random.SeedSequence().entropy % 2**32))
CAP_KB = 99

# Each width with a 99 KB row (forward 256; backward 96, 128, 192, 256: one dO buffer, 32-row steps, 32-key CTAs with
# V in registers), through every feature of the kernels: ragged lengths both ways, GQA / MQA, causal, windows that
# empty rows, sinks, softcap, both dtypes, widths padded up to a compiled one, decode.
CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=333, seqlen_k=517, heads_q=8, heads_k=2, head_dim=96, causal=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=700, seqlen_k=300, heads_q=4, heads_k=4, head_dim=72,
                 window_size=(64, 16), sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=6, heads_k=3, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=129, seqlen_k=1500, heads_q=4, heads_k=1, head_dim=120,
                 softcap=30.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=2000, heads_q=8, heads_k=2, head_dim=128),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=600, seqlen_k=611, heads_q=4, heads_k=2, head_dim=192,
                 causal=True, softcap=5.0),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=900, heads_q=4, heads_k=4, head_dim=160,
                 window_size=(200, 0), sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=513, seqlen_k=400, heads_q=4, heads_k=1, head_dim=256,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1100, seqlen_k=1100, heads_q=2, heads_k=2, head_dim=256,
                 softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=77, seqlen_k=1300, heads_q=8, heads_k=4, head_dim=200,
                 window_size=(300, 40)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=2100, seqlen_k=2100, heads_q=2, heads_k=1, head_dim=64,
                 causal=True),
]


def _rows_for_99_kb():
    """Whether every width has sm80 rows of both directions that fit 99 KB, for both dtypes (the full kernel set)."""
    fits = {(k["direction"], k["dtype"], k["head_dim"]) for k in _ffi.build_info()["kernels"]
            if k["family"] == "sm80" and k["smem_bytes"] <= CAP_KB * 1024}
    return all((d, t, w) in fits for d in ("fwd", "bwd", "tangent") for t in ("bf16", "fp16")
               for w in (64, 96, 128, 192, 256))


def _check_plan(cfg, device_sm):
    plan = _ffi.plan(dtype=cfg.dtype, batch=cfg.batch, seqlen_q=cfg.seqlen_q, seqlen_k=cfg.seqlen_k,
                     heads_q=cfg.heads_q, heads_k=cfg.heads_k, head_dim=max(cfg.head_dim, cfg.head_dim_v),
                     window_left=cfg.window_size[0], window_right=0 if cfg.causal else cfg.window_size[1],
                     softcap=cfg.softcap, has_sinks=cfg.sinks, device_sm=device_sm)
    assert plan["runs"], f"{cfg}: {plan['reason']}"
    assert plan["device"]["smem_per_block_optin"] <= CAP_KB * 1024, plan["device"]
    for direction in ("fwd", "bwd", "tangent"):
        assert plan[direction]["family"] == "sm80", f"{cfg} {direction}: {plan[direction]['reason']}"
        assert 0 < plan[direction]["smem_bytes"] <= CAP_KB * 1024, f"{cfg} {direction}: {plan[direction]}"
    return plan


def _small_tile_cases():
    """Run in the capped process: each case plans the 99 KB rows and matches the reference."""
    device = _ffi.default_device()
    assert device is not None
    settings = {s["name"]: s["value"] for s in _ffi.build_info()["settings"]}
    assert settings["FLASHJAX_SMEM_LIMIT_KB"] == str(CAP_KB), settings
    tiles, tangent_tiles = set(), set()
    for i, cfg in enumerate(CASES):
        plan = _check_plan(cfg, device[0])
        tiles.add((plan["head_dim"], plan["bwd"]["block_m"], plan["bwd"]["block_n"]))
        tangent_tiles.add((plan["head_dim"], plan["tangent"]["block_m"], plan["tangent"]["block_n"]))
        primals, tangents = sweep.make_tangent_inputs(cfg, np.random.default_rng([SEED, 125_000 + i]))
        bad = sweep.jvp_errors(cfg, sweep.run_jvp(cfg, primals, tangents, "kernel"),
                               sweep.run_jvp(cfg, primals, tangents, "reference"))
        assert not bad, f"{cfg} jvp (seed {SEED}): {bad}"
        rng = np.random.default_rng([SEED, 120_000 + i])
        inputs = sweep.make_inputs(cfg, rng)
        errors = sweep.compare(cfg, sweep.run(cfg, inputs, "kernel"), sweep.run(cfg, inputs, "reference"), inputs)
        bad = sweep.check(cfg, errors)
        assert not bad, f"{cfg} (seed {SEED}): {bad}; all errors {errors}"
    # The backward's small tiles themselves (bwd_tile_sizes.cuh): 64 x 64 at D 96 and 128, 32 x 64 at 192, 64 x 32
    # at 256.
    assert {(96, 64, 64), (128, 64, 64), (192, 32, 64), (256, 64, 32)} <= tiles, tiles
    # The tangent's (tangent_tile_sizes.cuh): 64 x 32 at D 192, 64 x 16 at 256.
    assert {(192, 64, 32), (256, 64, 16)} <= tangent_tiles, tangent_tiles
    return "ok"


def test_small_tiles_match_the_reference_as_on_a_99_kb_gpu():
    if not _rows_for_99_kb():
        pytest.skip("this build has no 99 KB rows (the full kernel set has them)")
    env = dict(os.environ, FLASHJAX_SMEM_LIMIT_KB=str(CAP_KB), FLASHJAX_DISABLE_FAMILIES="sm90",
               FLASHJAX_SWEEP_SEED=str(SEED))
    package_root = os.path.dirname(os.path.dirname(flashjax.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), package_root, env.get("PYTHONPATH"))
                                        if p)
    code = "import test_small_tiles; print(test_small_tiles._small_tile_cases())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok", done.stdout[-2000:]


def test_the_plan_takes_the_99_kb_rows_under_the_cap():
    # In a run of the whole suite under FLASHJAX_SMEM_LIMIT_KB=99 FLASHJAX_DISABLE_FAMILIES=sm90: every width plans
    # sm80 rows that fit 99 KB, so the sweep's calls all ran the small tiles.
    cap = os.environ.get("FLASHJAX_SMEM_LIMIT_KB")
    if not cap or "sm90" not in os.environ.get("FLASHJAX_DISABLE_FAMILIES", ""):
        pytest.skip("run the suite with FLASHJAX_SMEM_LIMIT_KB=99 FLASHJAX_DISABLE_FAMILIES=sm90 for this check")
    if int(cap) != CAP_KB:
        pytest.skip(f"checks the {CAP_KB} KB cap")
    device = _ffi.default_device()
    widths = {k["head_dim"] for k in _ffi.build_info()["kernels"] if k["family"] == "sm80"}
    for d in sorted(widths):
        _check_plan(sweep.Config(dtype="bfloat16", batch=1, seqlen_q=500, seqlen_k=500, heads_q=4, heads_k=2,
                                 head_dim=d, causal=True), device[0])
