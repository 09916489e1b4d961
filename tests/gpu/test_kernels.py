"""Kernels against the reference on the GPU: a randomized sweep plus composition tests.

The sweep draws FLASHJAX_SWEEP_N configurations (default 320) from a fresh seed each run (printed, and settable
with FLASHJAX_SWEEP_SEED to replay a failure): ragged lengths, Sq != Sk both ways, empty sequences, GQA ratios,
head dims 1..256 (any width, padded inside the library), causal, windows (wider than the sequence, and narrow enough to empty
rows), sinks, softcap, both dtypes, cotangents on out and lse.
"""
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import export_fixture
import flashjax
import sweep

SEED = int(os.environ.get("FLASHJAX_SWEEP_SEED", np.random.SeedSequence().entropy % 2**32))
N = int(os.environ.get("FLASHJAX_SWEEP_N", "320"))


def test_sweep_seed_is_reported():
    print(f"FLASHJAX_SWEEP_SEED={SEED}")


def _assert_kernel_matches_reference(cfg, rng, where, key_scale=None, query_scale=None):
    """Forward and backward of `cfg` on fresh inputs from `rng`, kernel against reference (docs/design.md §5).
    key_scale(Sk) -> (Sk,) multiplies the keys along the sequence; query_scale(Sq, Hq) -> (Sq, Hq) the queries."""
    inputs = sweep.make_inputs(cfg, rng)
    if key_scale is not None:
        q, k, *rest = inputs
        k = (k.astype(jnp.float32) * key_scale(cfg.seqlen_k)[None, :, None, None]).astype(k.dtype)
        inputs = (q, k, *rest)
    if query_scale is not None:
        q, *rest = inputs
        q = (q.astype(jnp.float32) * query_scale(cfg.seqlen_q, cfg.heads_q)[None, :, :, None]).astype(q.dtype)
        inputs = (q, *rest)
    errors = sweep.compare(cfg, sweep.run(cfg, inputs, "kernel"), sweep.run(cfg, inputs, "reference"), inputs)
    bad = sweep.check(cfg, errors)
    assert not bad, f"{cfg} ({where}): {bad}; all errors {errors}"


def _assert_fixed_case_matches(cfg, cases, stream, key_scale=None, query_scale=None):
    """A listed case on fresh inputs: its own random stream (stream + position in its list) under the run's seed."""
    rng = np.random.default_rng([SEED, stream + cases.index(cfg)])
    _assert_kernel_matches_reference(cfg, rng, f"seed {SEED}", key_scale, query_scale)


@pytest.mark.parametrize("index", range(N))
def test_sweep(index):
    rng = np.random.default_rng([SEED, index])
    _assert_kernel_matches_reference(sweep.random_config(rng), rng, f"seed {SEED}, index {index}")


# Shapes the random sweep rarely draws, each reaching one of the sm90 forward's launch-time tile choices on purpose
# (csrc/kernels/sm90/fwd_choices.cuh's key_load picks the tile): D 64 causal long enough for 192-row tiles (the middle
# row sees >= 2048 keys) and short enough for 128-row ones, an unbanded D 64 call (192 rows), a sliding window with
# >= 2048 keys per row; D 128 (128 x 128, three K stages) causal with tiles of 1 to 24 KV blocks and non-causal with
# 24-block tiles, and unbanded with >= 8192 keys per row (a partial last block); D 256 causal with
# < 512 keys for the middle row (128 x 48, O in a buffer of its own) and with more (128 x 80, O staged in Q's);
# D 192 causal with < 512 keys for the middle row (128 x 64, two Q buffers); D 256 and D 192 without a band and at
# most 512 keys (128 x 64: 64-key steps divide such rows; a partial last block where Sk is not a multiple of 64).
TILE_CHOICE_CASES = [
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=4500, seqlen_k=4500, heads_q=4, heads_k=2, head_dim=64,
                 causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=2, heads_k=1, head_dim=64,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=700, heads_q=4, heads_k=4, head_dim=64, softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=5000, seqlen_k=5000, heads_q=2, heads_k=1, head_dim=64,
                 window_size=(2500, 0)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=3001, seqlen_k=3001, heads_q=4, heads_k=1, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1000, seqlen_k=3001, heads_q=2, heads_k=2, head_dim=128),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=300, seqlen_k=8300, heads_q=4, heads_k=2, head_dim=128,
                 sinks=True),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=700, seqlen_k=700, heads_q=4, heads_k=2, head_dim=256,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1500, seqlen_k=1500, heads_q=2, heads_k=2, head_dim=256,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=900, seqlen_k=900, heads_q=6, heads_k=2, head_dim=192,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=500, heads_q=4, heads_k=2, head_dim=256, sinks=True),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=1000, seqlen_k=511, heads_q=2, heads_k=1, head_dim=256,
                 softcap=3.0),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=512, heads_q=4, heads_k=4, head_dim=192, softcap=5.0),
]


@pytest.mark.parametrize("cfg", TILE_CHOICE_CASES, ids=str)
def test_tile_choices(cfg):
    _assert_fixed_case_matches(cfg, TILE_CHOICE_CASES, 10_000)


# The sm90 backward's edges (csrc/kernels/sm90/bwd_*.cuh; on other devices these run whatever backward dispatch picks):
# CTAs walking many steps (every query block of every query head of a GQA group of 4), query blocks cut by Sq and
# 128-key CTAs cut by Sk, causal with Sq < Sk and with Sq > Sk (CTAs whose keys no row sees write zero dK / dV, and the
# first rows are empty), a window that empties whole query blocks, softcap (tanh' in dS), sinks with the lse
# cotangent, a single query row against long keys, and widths padded to 64 and 128.
BWD_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=1000, heads_q=4, heads_k=1, head_dim=64,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=300, heads_q=2, heads_k=2, head_dim=128,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=2000, seqlen_k=2000, heads_q=4, heads_k=4, head_dim=64,
                 window_size=(200, 0)),
    sweep.Config(dtype="float16", batch=3, seqlen_q=129, seqlen_k=257, heads_q=6, heads_k=3, head_dim=128,
                 softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=4000, heads_q=32, heads_k=8, head_dim=128),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=513, seqlen_k=65, heads_q=4, heads_k=2, head_dim=64,
                 softcap=3.0, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=333, seqlen_k=444, heads_q=4, heads_k=2, head_dim=100,
                 window_size=(50, 70)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=4100, seqlen_k=4100, heads_q=2, heads_k=1, head_dim=40,
                 causal=True),
]


@pytest.mark.parametrize("cfg", BWD_CASES, ids=str)
def test_backward_cases(cfg):
    _assert_fixed_case_matches(cfg, BWD_CASES, 11_000)


# deterministic=True (the sm90 backward adds each query block's dQ partials in a fixed order, bwd_dq_order.cuh):
# matches the reference, and five runs give the same bits. Many KV blocks per query block (long keys, GQA with
# sinks: the ordered dsinks sum too), causal with more key blocks per head than the H200 has SMs (the grid launched
# from the last key block; a CTA waits only for CTAs launched before it), Sq > Sk causal (leading rows empty), a
# two-sided window (a few contributors per block) and fp16 D 64 with softcap.
DETERMINISTIC_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=3000, heads_q=8, heads_k=2, head_dim=128,
                 sinks=True, deterministic=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=17000, seqlen_k=17000, heads_q=1, heads_k=1, head_dim=64,
                 causal=True, deterministic=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=900, seqlen_k=300, heads_q=4, heads_k=4, head_dim=128,
                 causal=True, deterministic=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=2000, seqlen_k=2000, heads_q=4, heads_k=2, head_dim=64,
                 window_size=(300, 100), softcap=5.0, sinks=True, deterministic=True),
]


def _sm90_backward_rows(deterministic=False):
    """The head dims whose sm90 backward runs here: an sm90 device, the family in the build (its rows marked
    deterministic where asked) and not switched off by FLASHJAX_DISABLE_FAMILIES (the sm80 and 99 KB modes)."""
    device = flashjax._ffi.default_device()
    if device is None or device[0] != 90 or "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(","):
        return set()
    return {row["head_dim"] for row in flashjax._ffi.build_info().get("kernels", [])
            if row["family"] == "sm90" and row["direction"] == "bwd" and (row.get("deterministic") or not deterministic)}


@pytest.mark.parametrize("cfg", DETERMINISTIC_CASES, ids=str)
def test_deterministic_backward_matches_and_repeats_bit_for_bit(cfg):
    if cfg.head_dim not in _sm90_backward_rows(deterministic=True):
        pytest.skip("needs an sm90 device and a build whose sm90 backward for this head dim is marked deterministic")
    rng = np.random.default_rng([SEED, 12_000 + DETERMINISTIC_CASES.index(cfg)])
    inputs = sweep.make_inputs(cfg, rng)
    q, k, v, sinks, *_ = inputs
    assert "fixed order" in flashjax.explain(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                             softcap=cfg.softcap, deterministic=True)
    first = sweep.run(cfg, inputs, "kernel")
    bad = sweep.check(cfg, sweep.compare(cfg, first, sweep.run(cfg, inputs, "reference"), inputs))
    assert not bad, f"{cfg}: {bad}"
    sweep.assert_grads_repeat(first, lambda: sweep.run(cfg, inputs, "kernel"), str(cfg))


def test_explain_names_the_sm90_backward_on_hopper():
    widths = _sm90_backward_rows()
    if 128 not in widths:
        pytest.skip("needs an sm90 device and a build with the sm90 backward")
    for d in sorted(widths & {64, 96, 128, 192, 256}):
        q, k, v = _inputs(0, d=d)
        assert "backward: sm90 backward kernel" in flashjax.explain(q, k, v, causal=True), d


# The sm90 backward at D 96 (the 128-key plan; dQ's wgmma N is 48), 192 and 256 (64-key CTAs whose warpgroups split
# S^T / dP^T by query columns and dK / dV / dQ by D, P^T and dS^T through shared memory; one Q / dO stage at 256:
# bwd_tile_sizes.cuh). Every case has Sq != Sk, neither a multiple of 64 (query blocks cut by Sq, key blocks by Sk),
# and some of: causal either way round, windows, GQA, softcap, sinks (with the lse cotangent), deterministic=True.
SM90_BWD_HEAD_DIM_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=1001, heads_q=8, heads_k=2, head_dim=96,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1000, seqlen_k=333, heads_q=4, heads_k=4, head_dim=96,
                 window_size=(100, 30), softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=900, seqlen_k=301, heads_q=4, heads_k=1, head_dim=96,
                 causal=True, deterministic=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=300, seqlen_k=1000, heads_q=4, heads_k=1, head_dim=192,
                 causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=513, seqlen_k=65, heads_q=4, heads_k=2, head_dim=192,
                 softcap=3.0, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=2000, seqlen_k=1900, heads_q=2, heads_k=1, head_dim=192,
                 window_size=(200, 0), sinks=True, deterministic=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=301, heads_q=8, heads_k=2, head_dim=256,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=333, seqlen_k=444, heads_q=4, heads_k=2, head_dim=256,
                 window_size=(50, 70), softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1000, seqlen_k=3001, heads_q=4, heads_k=2, head_dim=256,
                 deterministic=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1, seqlen_k=4000, heads_q=16, heads_k=4, head_dim=256),
]


@pytest.mark.parametrize("cfg", SM90_BWD_HEAD_DIM_CASES, ids=str)
def test_sm90_bwd_head_dims(cfg):
    if cfg.head_dim not in _sm90_backward_rows():
        pytest.skip("needs an sm90 device and a build with the sm90 backward at this head dim")
    rng = np.random.default_rng([SEED, 13_000 + SM90_BWD_HEAD_DIM_CASES.index(cfg)])
    inputs = sweep.make_inputs(cfg, rng)
    q, k, v, sinks, *_ = inputs
    explained = flashjax.explain(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                 softcap=cfg.softcap, deterministic=cfg.deterministic)
    assert "backward: sm90 backward kernel" in explained, explained
    bad = sweep.check(cfg, sweep.compare(cfg, sweep.run(cfg, inputs, "kernel"), sweep.run(cfg, inputs, "reference"),
                                         inputs))
    assert not bad, f"{cfg}: {bad}"

# More tiles than two per SM (132 on an H100/H200), so that each persistent CTA runs several in a row: the sm90
# consumers carry state from one tile into the next (the next tile's first GEMM goes out with this tile's last,
# where Q has two buffers), and tiles whose rows see no key (Sq > Sk causal: the top rows) fall between tiles with
# work. One case per tile / buffer plan: D 64 on 192 rows (three consumer warpgroups) and on 128, D 96, D 128 (also
# with >= 8192 keys per row), D 256 (one Q buffer: no carry-over). The banded cases have uneven tiles and more than one
# per SM, so their last tiles are planned on the host (fwd_tile_scheduler.cuh's tail: CTAs leave the pairs for a
# per-CTA list); the last case has every tile planned (160 tiles, too few for a bulk).
SCHEDULE_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=2100, seqlen_k=2100, heads_q=16, heads_k=16, head_dim=64,
                 softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=4, seqlen_q=700, seqlen_k=700, heads_q=16, heads_k=4, head_dim=64,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=4, seqlen_q=1000, seqlen_k=1300, heads_q=8, heads_k=8, head_dim=96,
                 causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=3000, seqlen_k=1100, heads_q=12, heads_k=4, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=2300, seqlen_k=8300, heads_q=16, heads_k=2, head_dim=128,
                 sinks=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=1500, seqlen_k=900, heads_q=12, heads_k=3, head_dim=256,
                 window_size=(300, 0)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=4096, seqlen_k=4096, heads_q=5, heads_k=5, head_dim=128,
                 causal=True),
]


@pytest.mark.parametrize("cfg", SCHEDULE_CASES, ids=str)
def test_several_tiles_per_cta(cfg):
    _assert_fixed_case_matches(cfg, SCHEDULE_CASES, 20_000)


# D 64 on 192-row tiles where the last tile of each head has warpgroups whose 64 rows all lie past Sq (they compute
# on TMA's zero-filled Q rows; nothing of theirs may reach out or lse, nor disturb the ping-pong rounds and stage
# releases of the others): one such warpgroup (Sq mod 192 in 65..128), two (1..64), with a single KV block per tile,
# and with many tiles per CTA so that the ragged tile sits between carried-over tiles.
IDLE_ROWS_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=512, seqlen_k=512, heads_q=8, heads_k=2, head_dim=64),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1000, seqlen_k=1500, heads_q=4, heads_k=4, head_dim=64,
                 causal=True, softcap=3.0),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=385, seqlen_k=100, heads_q=4, heads_k=1, head_dim=64, sinks=True),
    sweep.Config(dtype="bfloat16", batch=4, seqlen_q=1000, seqlen_k=1000, heads_q=16, heads_k=8, head_dim=64,
                 causal=True, sinks=True),
]


@pytest.mark.parametrize("cfg", IDLE_ROWS_CASES, ids=str)
def test_warpgroups_past_the_last_row(cfg):
    _assert_fixed_case_matches(cfg, IDLE_ROWS_CASES, 30_000)


# Packed GQA (csrc/kernels/sm90/fwd_query_tiling.cuh): where Sq is short, the sm90 forward puts the query heads of a
# KV head into shared tiles, in 8-position chunks, head fastest. Each case is one the rule packs (the test checks
# explain() says so): decode, speculative and chunked lengths, group sizes 3, 4 and 8 (a chunk of the group's last
# head straddles two tiles unless G divides 16), causal with Sq < Sk (a tile's rows see different keys: per-row
# masks), windows, sinks (per row: several heads per tile), softcap, Sk = 0 (every row empty: store_empty per row),
# and 192 tiles on 132 CTAs.
PACKED_GQA_CASES = [
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=1, seqlen_k=1000, heads_q=32, heads_k=8, head_dim=128, sinks=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=5, seqlen_k=700, heads_q=12, heads_k=4, head_dim=64, causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=16, seqlen_k=2000, heads_q=16, heads_k=2, head_dim=128,
                 causal=True, window_size=(100, 0), sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=77, seqlen_k=300, heads_q=8, heads_k=1, head_dim=256,
                 causal=True, softcap=30.0),
    sweep.Config(dtype="float16", batch=4, seqlen_q=33, seqlen_k=33, heads_q=8, heads_k=2, head_dim=192,
                 window_size=(20, 5), sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=9, seqlen_k=0, heads_q=8, heads_k=2, head_dim=96, sinks=True),
    sweep.Config(dtype="bfloat16", batch=64, seqlen_q=3, seqlen_k=500, heads_q=18, heads_k=3, head_dim=128,
                 causal=True),
]


@pytest.mark.parametrize("cfg", PACKED_GQA_CASES, ids=str)
def test_packed_gqa(cfg):
    q = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim), cfg.dtype)
    k = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim), cfg.dtype)
    text = flashjax.explain(q, k, k)
    if "sm90 forward kernel" in text:
        assert "GQA packed" in text, f"the case no longer reaches the packed path: {text}"
    _assert_fixed_case_matches(cfg, PACKED_GQA_CASES, 50_000)


def test_explain_says_where_gqa_is_packed():
    def text(seqlen_q, heads_q, heads_k):
        # 500 keys: too few blocks to split keys (the split kernel packs every GQA call: test_split_keys)
        q = jax.ShapeDtypeStruct((2, seqlen_q, heads_q, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, 500, heads_k, 128), jnp.bfloat16)
        return flashjax.explain(q, k, k)
    if "sm90 forward kernel" not in text(1, 32, 8):
        pytest.skip("the sm90 forward does not run here")
    assert "the 4 query heads of a KV head share each forward tile" in text(1, 32, 8)
    assert "GQA packed" in text(60, 16, 2)
    for unpacked in (text(4096, 32, 8), text(1, 16, 16), text(128, 32, 8)):
        assert "GQA packed" not in unpacked, unpacked


# FLASHJAX_SM90_PACK_GQA forces every GQA call through one path ("1": packed, also where the tiles are long: 192-row
# tiles at D 64, causal tails planned on the host, carried-over tiles, tiles of Sq > Sk that see no key; "0": the
# unpacked path on the short cases above). The launcher reads it once per process, so each runs in a fresh one.
FORCED_GQA_CASES = PACKED_GQA_CASES + [
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=2500, seqlen_k=2500, heads_q=8, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=4500, seqlen_k=4500, heads_q=4, heads_k=1, head_dim=64,
                 causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=1000, seqlen_k=1300, heads_q=6, heads_k=2, head_dim=256,
                 window_size=(300, 0), softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=700, seqlen_k=200, heads_q=8, heads_k=4, head_dim=192,
                 causal=True, sinks=True),
]


def _forced_gqa_cases():
    for cfg in FORCED_GQA_CASES:
        _assert_fixed_case_matches(cfg, FORCED_GQA_CASES, 60_000)
    return "ok"


def _in_fresh_process(expression, timeout, **env_vars):
    """The value (printed, last word) of `expression` over this module, evaluated in a new Python process with
    `env_vars` set: for the launcher's settings that it reads once per process."""
    env = dict(os.environ, **env_vars)
    # This module's folder, and the folder of the flashjax this process imported (a checkout's python/, which
    # tests/conftest.py put on sys.path, or site-packages).
    package_root = os.path.dirname(os.path.dirname(flashjax.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), package_root, env.get("PYTHONPATH"))
                                        if p)
    code = f"import test_kernels; print(test_kernels.{expression})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.mark.parametrize("mode", ["1", "0"])
def test_gqa_forced_through_each_path(mode):
    assert _in_fresh_process("_forced_gqa_cases()", 900, FLASHJAX_SM90_PACK_GQA=mode,
                             FLASHJAX_SWEEP_SEED=str(SEED)) == "ok"


# Split keys (csrc/kernels/sm90/fwd_split_kv.h): where a call's tiles fill at most half of the SMs and its rows see
# many keys, each tile's KV range runs as parts on separate CTAs, and a second kernel merges their partial O and
# LSE. Each case is one the rule splits on an H200 (the test checks explain() says so): decode of one sequence (GQA
# and MHA, a ragged last block, sinks: added once, by the merge), speculative and chunked lengths under causal
# (Sq < Sk: the diagonal's masked blocks fall in the last part), G 3, D 64 / 96 / 192 / 256, fp16, softcap (the
# split kernel's capped twin). Gradients run the backward on the merged out and lse.
SPLIT_KV_CASES = [
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=8191, heads_q=32, heads_k=8, head_dim=128, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1, seqlen_k=3000, heads_q=4, heads_k=4, head_dim=64, causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=16, seqlen_k=5000, heads_q=16, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=5, seqlen_k=1500, heads_q=12, heads_k=4, head_dim=192, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=4000, heads_q=8, heads_k=8, head_dim=256),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=40, seqlen_k=2000, heads_q=4, heads_k=1, head_dim=96, causal=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=6000, heads_q=16, heads_k=4, head_dim=128,
                 sinks=True, softcap=30.0),
    sweep.Config(dtype="float16", batch=2, seqlen_q=7, seqlen_k=2500, heads_q=8, heads_k=8, head_dim=64,
                 causal=True, softcap=5.0),
]


@pytest.mark.parametrize("cfg", SPLIT_KV_CASES, ids=str)
def test_split_keys(cfg):
    q = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim), cfg.dtype)
    k = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim), cfg.dtype)
    text = flashjax.explain(q, k, k, causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap)
    if "sm90 forward kernel" in text and getattr(jax.devices()[0], "core_count", 0) >= 128:
        assert "keys split" in text, f"the case no longer reaches the split path: {text}"
    _assert_fixed_case_matches(cfg, SPLIT_KV_CASES, 70_000)


def test_explain_says_where_keys_are_split():
    def text(batch, seqlen_q, seqlen_k, heads_q, heads_k, **keywords):
        q = jax.ShapeDtypeStruct((batch, seqlen_q, heads_q, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((batch, seqlen_k, heads_k, 128), jnp.bfloat16)
        return flashjax.explain(q, k, k, **keywords)
    if "sm90 forward kernel" not in text(1, 1, 8192, 32, 8) or getattr(jax.devices()[0], "core_count", 0) < 128:
        pytest.skip("the sm90 forward does not run here, or on a GPU of fewer SMs than the H100's")
    assert "keys run as 16 parts" in text(1, 1, 8192, 32, 8)  # 8 tiles, 64 blocks: 16 parts of 4 blocks
    assert "keys run as 8 parts" in text(1, 1, 32768, 16, 16)  # 16 tiles
    assert "keys run as 16 parts" in text(1, 1, 8192, 32, 8, softcap=5.0)
    for whole in (text(64, 1, 8192, 32, 8), text(1, 1, 500, 32, 8), text(1, 4096, 4096, 16, 16),
                  text(1, 64, 8192, 32, 8, causal=True, window_size=(100, 0))):
        assert "keys split" not in whole, whole


# FLASHJAX_SM90_SPLIT_KV=n splits every call the split kernel serves into n parts, also where the rule would not:
# many tiles (the parts fold into the scheduler's batch: pairs of uneven causal tiles and tails planned on the host
# walk them), windows (parts of a banded range, masked blocks at both ends), Sq > Sk causal (rows that see no key
# in any part: lse -inf, or the sink), more parts than blocks (empty parts), GQA packed and not, softcap, Sk = 0.
# The split cases above run with 3 and with 64 parts.
FORCED_SPLIT_CASES = SPLIT_KV_CASES + [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=900, heads_q=8, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=2000, heads_q=4, heads_k=4, head_dim=64,
                 window_size=(300, 40)),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=500, seqlen_k=200, heads_q=6, heads_k=2, head_dim=256,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=3, seqlen_q=9, seqlen_k=150, heads_q=8, heads_k=1, head_dim=192),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=3, seqlen_k=900, heads_q=8, heads_k=2, head_dim=128,
                 sinks=True, softcap=7.0),
    sweep.Config(dtype="float16", batch=2, seqlen_q=9, seqlen_k=0, heads_q=8, heads_k=2, head_dim=96, sinks=True),
]


def _forced_split_cases():
    for cfg in FORCED_SPLIT_CASES:
        _assert_fixed_case_matches(cfg, FORCED_SPLIT_CASES, 80_000)
    return "ok"


@pytest.mark.parametrize("parts", ["3", "64"])
def test_keys_forced_into_parts(parts):
    assert _in_fresh_process("_forced_split_cases()", 900, FLASHJAX_SM90_SPLIT_KV=parts,
                             FLASHJAX_SWEEP_SEED=str(SEED)) == "ok"


# Scores that grow along the keys (keys scaled from 0.5 to 12 along the sequence, so a row's max keeps rising by
# tens in the log2 domain): the online softmax must rescale O whenever its reference max moves. The D 256 kernel
# moves it only when the max grew past 2^8 (lazy rescale, csrc/kernels/sm90/fwd_softmax.cuh) and keeps it
# otherwise, with probabilities up to 256 in 16-bit P; D 128 and 192 exponentiate against the reference without a
# row max and go back to the full update for the blocks where a sum exceeds 256 (exponentiate_at_reference).
# Causal and not, ragged lengths, several tiles per CTA.
GROWING_MAX_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=1900, heads_q=4, heads_k=2, head_dim=256),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1500, seqlen_k=1500, heads_q=8, heads_k=8, head_dim=256,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=900, seqlen_k=2500, heads_q=6, heads_k=2, head_dim=192),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1300, seqlen_k=1300, heads_q=4, heads_k=4, head_dim=192,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=800, seqlen_k=2000, heads_q=4, heads_k=2, head_dim=128,
                 sinks=True),
]


@pytest.mark.parametrize("cfg", GROWING_MAX_CASES, ids=str)
def test_row_max_growing_along_the_keys(cfg):
    _assert_fixed_case_matches(cfg, GROWING_MAX_CASES, 40_000, key_scale=lambda n: jnp.linspace(0.5, 12.0, n))


# A few late keys 40 times longer than the rest: a row's scores jump by up to ~100s in the log2 domain in one block,
# far past what exp2 can hold against the reference the earlier blocks set, so the sm90 fast path
# (exponentiate_at_reference) computes inf there and must fall back to the full update for that block; rows whose
# scores at those keys are negative keep the fast path. Every head dim's kernel, GQA, softcap (which bounds the
# jump: the fast path then holds), sinks, causal and not.
SPIKE_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=600, seqlen_k=1700, heads_q=4, heads_k=2, head_dim=64),
    sweep.Config(dtype="float16", batch=1, seqlen_q=4500, seqlen_k=4500, heads_q=4, heads_k=1, head_dim=64,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=900, seqlen_k=2100, heads_q=4, heads_k=4, head_dim=96),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=3001, heads_q=4, heads_k=2, head_dim=128,
                 sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=2000, seqlen_k=2000, heads_q=8, heads_k=2, head_dim=128,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=300, seqlen_k=8500, heads_q=4, heads_k=2, head_dim=128,
                 softcap=20.0),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1200, seqlen_k=2600, heads_q=4, heads_k=2, head_dim=192),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1100, seqlen_k=2300, heads_q=4, heads_k=2, head_dim=256,
                 causal=True),
]


def _late_spikes(n):
    """Keys at 60%, 75% and 90% of the sequence scaled by 40, the rest by 1."""
    return jnp.ones(n).at[jnp.array([int(n * 0.6), int(n * 0.75), int(n * 0.9)])].set(40.0)


@pytest.mark.parametrize("cfg", SPIKE_CASES, ids=str)
def test_late_keys_far_above_the_reference(cfg):
    _assert_fixed_case_matches(cfg, SPIKE_CASES, 50_000, key_scale=_late_spikes)


# Query rows of very different lengths next to each other: in every run of 16 positions (and, for packed GQA tiles,
# from one query head to the next) the queries alternate between 1x and `factor`x. A thread of the sm90 forward
# holds rows r and r + 8 of its warp's 16, so its two rows' maxima lie far apart: by ~40 in the log2 domain at 10x
# and by ~170 at 40x. Each row's softmax must stay its own. (One exp2 reference shared by a thread's two rows, tried
# and dropped as lab/experiments/v29-shared-reference.patch, failed here at 10x in fp16: the lower row's P, scaled
# down by ~2^-40, fell out of fp16's range.) Every head dim's kernel, packed GQA, softcap (which bounds the span),
# sinks, causal and not.
FAR_APART_ROWS_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=900, heads_q=4, heads_k=2, head_dim=64, causal=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=2500, seqlen_k=2500, heads_q=4, heads_k=4, head_dim=64, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=900, seqlen_k=1300, heads_q=4, heads_k=4, head_dim=96),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=4, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1200, seqlen_k=2600, heads_q=8, heads_k=2, head_dim=128),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=300, seqlen_k=3000, heads_q=8, heads_k=1, head_dim=128,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=800, seqlen_k=1800, heads_q=4, heads_k=2, head_dim=128,
                 softcap=20.0),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1100, seqlen_k=1100, heads_q=4, heads_k=2, head_dim=192,
                 causal=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=900, seqlen_k=1500, heads_q=4, heads_k=2, head_dim=256),
]


def _alternating_queries(factor):
    def scale(sq, hq):
        positions, heads = jnp.arange(sq)[:, None], jnp.arange(hq)[None, :]
        return jnp.where((positions // 8 + heads) % 2 == 1, factor, 1.0)
    return scale


@pytest.mark.parametrize("factor", [10.0, 40.0])
@pytest.mark.parametrize("cfg", FAR_APART_ROWS_CASES, ids=str)
def test_rows_of_one_thread_far_apart(cfg, factor):
    _assert_fixed_case_matches(cfg, FAR_APART_ROWS_CASES, 60_000 + int(factor) * 100,
                               query_scale=_alternating_queries(factor))


# Head dims that are not a multiple of 8 (issue 35 item 7): api.py zero-pads q, k and v to the next compiled width
# (59, 33 -> 64; 100 -> 128; 200 -> 256) with the scale of the true head dim and slices out and the gradients back.
# Dv != D both ways, including Dv wider than D (the width holds the larger), every compiled width, GQA, causal with
# Sq > Sk (empty rows), windows, sinks, softcap, a decode shape (packed GQA / split keys on sm90), both dtypes.
ODD_HEAD_DIM_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=517, heads_q=4, heads_k=2, head_dim=59,
                 causal=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=1000, seqlen_k=700, heads_q=2, heads_k=1, head_dim=33,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=129, seqlen_k=1100, heads_q=8, heads_k=2, head_dim=100,
                 window_size=(64, 3), softcap=5.0),
    sweep.Config(dtype="float16", batch=1, seqlen_q=700, seqlen_k=700, heads_q=4, heads_k=4, head_dim=200,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=250, seqlen_k=333, heads_q=4, heads_k=1, head_dim=59,
                 head_dim_v=33, sinks=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=97, seqlen_k=128, heads_q=2, heads_k=2, head_dim=33,
                 head_dim_v=200),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=4000, heads_q=16, heads_k=4, head_dim=100,
                 head_dim_v=59, sinks=True),
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=400, seqlen_k=300, heads_q=6, heads_k=3, head_dim=200,
                 head_dim_v=100, causal=True, window_size=(100, 0)),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=301, heads_q=2, heads_k=1, head_dim=1,
                 head_dim_v=255, softcap=30.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=513, seqlen_k=65, heads_q=4, heads_k=2, head_dim=255,
                 head_dim_v=7, causal=True, sinks=True),
]


@pytest.mark.parametrize("cfg", ODD_HEAD_DIM_CASES, ids=str)
def test_head_dims_not_a_multiple_of_8(cfg):
    q = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim), cfg.dtype)
    k = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim), cfg.dtype)
    v = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim_v), cfg.dtype)
    text = flashjax.explain(q, k, v, causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap)
    width = next(w for w in (64, 96, 128, 192, 256) if w >= max(cfg.head_dim, cfg.head_dim_v))
    if ": kernel (" in text:
        assert f"head dim padded to {width}" in text, text
    _assert_fixed_case_matches(cfg, ODD_HEAD_DIM_CASES, 90_000)


# Sinks of -inf, +inf and NaN under jit (traced: a concrete NaN raises at trace time instead), docs/design.md §2.4:
# -inf is no sink; +inf puts all the weight on the sink (out 0, lse +inf, no gradient into q/k/v, dsink = the sum of
# its rows' dlse, 0 here: the cotangent of a non-finite lse is zeroed as in sweep.run); NaN makes its head's out and
# lse NaN where a key is visible, and rows with no visible key keep out 0 with lse = the sink (NaN). Head 1 carries
# the special sink; head 0 shares its KV head, the other heads have their own. Cases: causal with Sq > Sk (the first
# 500 rows see no key: tiles with no row that sees a key, and a tile mixing such rows with rows that see keys), a
# decode shape that sm90 splits into key parts (the sink is added by the combine kernel), and a window with fp16.
SPECIAL_SINK_CASES = [
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=700, seqlen_k=200, heads_q=4, heads_k=2, head_dim=128,
                 causal=True, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=8191, heads_q=32, heads_k=8, head_dim=128,
                 sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=2, head_dim=64,
                 window_size=(50, 0), sinks=True),
]
SPECIAL_SINK_HEAD = 1


@pytest.mark.parametrize("kind", ["-inf", "+inf", "nan"])
@pytest.mark.parametrize("cfg", SPECIAL_SINK_CASES, ids=str)
def test_infinite_and_nan_sinks_traced(cfg, kind):
    rng = np.random.default_rng([SEED, 95_000 + SPECIAL_SINK_CASES.index(cfg)])
    q, k, v, sinks, d_out, d_lse = sweep.make_inputs(cfg, rng)
    sinks = sinks.at[SPECIAL_SINK_HEAD].set({"-inf": -np.inf, "+inf": np.inf, "nan": np.nan}[kind])
    inputs = (q, k, v, sinks, d_out, d_lse)
    out_k, lse_k, grads_k = sweep.run(cfg, inputs, "kernel")
    reference = sweep.run(cfg, inputs, "reference")
    out_r, lse_r, grads_r = reference
    tol = sweep.TOLERANCE[cfg.dtype]
    bad = sweep.special_value_errors("out", out_k, out_r, tol) + sweep.special_value_errors("lse", lse_k, lse_r, tol)
    for name, g_k, g_r in zip(("dq", "dk", "dv"), grads_k, grads_r):
        bad += sweep.special_value_errors(name, g_k, g_r, 2 * tol)
    scale = sweep.dsinks_scale(cfg, inputs, reference)
    heads = np.isfinite(scale) & np.isfinite(np.asarray(grads_r[3]))
    bad += sweep.special_value_errors("dsinks", grads_k[3], grads_r[3], 2 * tol, np.linalg.norm(scale[heads]) or None)
    assert not bad, f"{cfg}, sink {kind} at head {SPECIAL_SINK_HEAD} (seed {SEED}): {bad}"


def _inputs(seed, b=2, sq=300, sk=517, hq=8, hk=2, d=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype),
            jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype),
            jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype))


def test_explain_names_the_kernel():
    q, k, v = _inputs(0)
    text = flashjax.explain(q, k, v, causal=True)
    assert re.search(r": kernel \(sm(80|90) forward kernel", text), text


def test_jit_of_grad_composes_and_matches_reference():
    q, k, v = _inputs(1)

    def loss(q, k, v, backend):
        out = flashjax.flash_attn(q, k, v, causal=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "kernel"), argnums=(0, 1, 2)))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2))(*f32)
    assert abs(float(got[0]) - float(want[0])) <= 2e-2 * abs(float(want[0])) + 1e-2
    for g, w in zip(got[1], want[1]):
        assert sweep.rel_err(g, w) < 2e-2


@pytest.mark.parametrize("with_lse", [False, True])
def test_grad_with_sinks_with_and_without_an_lse_cotangent(with_lse):
    # The FFI call passes dlse and sinks only when they are used (primitives._kernel_lowering): sinks then rides
    # first or second among the optional operands, and the handler must tell which is which.
    q, k, v = _inputs(11, sq=257, sk=300)
    sinks = jnp.asarray(np.random.default_rng(12).standard_normal(q.shape[2]), jnp.float32)
    weights = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))

    def loss(q, k, v, sinks, backend):
        out, lse = flashjax.flash_attn(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=backend)
        value = jnp.sum(out.astype(jnp.float32) * weights)
        return value + 0.1 * jnp.sum(jnp.sin(lse)) if with_lse else value

    got = jax.jit(jax.grad(lambda *a: loss(*a, "kernel"), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2, 3))(*f32, sinks)
    for g, w in zip(got, want):
        assert sweep.rel_err(g, w) < 2e-2


def test_calls_lowered_with_every_optional_slot_still_run():
    # flashjax 0.1.0 lowered every optional operand, a zero array where unused; a call lowered then (a jax.export
    # artifact) must run on this library and give what today's lowering gives. The unused slots get random values
    # here, so a handler that read them would show.
    from flashjax import primitives
    q, k, v = _inputs(13, sq=200, sk=333)
    rng = np.random.default_rng(14)
    params = dict(softmax_scale=0.1, softcap=0.0, window_left=-1, window_right=0, has_sinks=False)
    unused_sinks = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32)
    structs = lambda avals: [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    primitives._ffi.register_targets()

    legacy_fwd = jax.ffi.ffi_call(primitives._ffi.FWD_TARGET, structs(primitives._fwd_abstract(q, k, v, unused_sinks)))
    got = jax.jit(lambda *a: legacy_fwd(*a, unused_sinks, **primitives._attrs(params)))(q, k, v)
    out, lse = jax.jit(lambda *a: primitives.forward(*a, unused_sinks, **params))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(lse))

    dout = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
    unused_dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    args = (q, k, v, out, lse, dout, unused_dlse, unused_sinks)
    bwd_params = dict(params, has_dlse=False)
    # The backward's results: the gradients, then the workspace the plan sizes (the lowering adds it the same way).
    workspace = primitives.lowering_plan(q, k, **params)["bwd"]["workspace"]
    legacy_bwd = jax.ffi.ffi_call(primitives._ffi.BWD_TARGET,
                                  structs(primitives._bwd_abstract(*args, **bwd_params)) +
                                  [jax.ShapeDtypeStruct(tuple(b["shape"]), jnp.float32) for b in workspace])
    got = jax.jit(lambda *a: legacy_bwd(*a, **primitives._attrs(bwd_params)))(*args)[:3]
    want = jax.jit(lambda *a: primitives.backward(*a, **bwd_params))(*args)[:3]
    for g, w in zip(got, want):  # dq accumulates with atomics: equal up to summation order
        assert sweep.rel_err(g, w) < 1e-3


def test_export_round_trip_matches_the_jitted_call():
    # docs/design.md §1: jax.export of a jitted call works (stable FFI target names); serialization when flatbuffers,
    # which jax.export's serializer needs, is installed.
    from jax import export
    q, k, v, d_out = export_fixture.export_fixture_inputs(3)

    def fwd_bwd(q, k, v, d_out):
        out, pullback = jax.vjp(lambda *a: flashjax.flash_attn(*a, causal=True, backend="kernel"), q, k, v)
        return (out, *pullback(d_out))

    exported = export_fixture.export_call(fwd_bwd)(q, k, v, d_out)
    try:
        exported = export.deserialize(exported.serialize())
    except ImportError:
        pass
    got = exported.call(q, k, v, d_out)
    want = jax.jit(fwd_bwd)(q, k, v, d_out)
    for g, w in zip(got, want):  # dq accumulates with atomics: equal up to summation order
        assert sweep.rel_err(g, w) < 1e-3


EXPORT_ARTIFACTS = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize("artifact", sorted(p.name for p in EXPORT_ARTIFACTS.glob("*.jax_export")))
def test_exported_by_earlier_versions_still_runs(artifact):
    # Artifacts serialized by earlier flashjax versions (tests/gpu/export_fixture.py says how): 0.1.0 passed every
    # optional FFI operand, 0.2.0 only the used ones; today's handlers must take both and compute the same.
    export = pytest.importorskip("jax.export")
    pytest.importorskip("flatbuffers", reason="jax.export's deserializer needs flatbuffers")
    exported = export.deserialize((EXPORT_ARTIFACTS / artifact).read_bytes())
    inputs = export_fixture.export_fixture_inputs(4)
    got = exported.call(*inputs)
    want = jax.jit(export_fixture.fixture_function())(*inputs)
    reference = jax.vjp(lambda *a: flashjax.flash_attn(*a, causal=True, backend="reference"),
                        *(x.astype(jnp.float32) for x in inputs[:3]))
    ref = (reference[0], *reference[1](inputs[3].astype(jnp.float32)))
    for g, w, r in zip(got, want, ref):
        assert sweep.rel_err(g, w) < 1e-3 and sweep.rel_err(g, r) < 2e-2


def test_vmap_over_extra_leading_axis():
    q, k, v = _inputs(2, b=1)
    qs = jnp.stack([q, q * 0.5, -q])
    got = jax.jit(jax.vmap(lambda q: flashjax.flash_attn(q, k, v, backend="kernel")))(qs)
    for i in range(3):
        want = flashjax.flash_attn(qs[i], k, v, backend="kernel")
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))


def test_vmap_of_grad_per_example():
    q, k, v = _inputs(3, b=1, sq=130, sk=130)
    qs = jnp.stack([q, q * 0.5])
    loss = lambda q, k, backend: jnp.sum(flashjax.flash_attn(q, k, v, backend=backend).astype(jnp.float32) ** 2)
    got = jax.vmap(jax.grad(lambda q, k: loss(q, k, "kernel"), argnums=(0, 1)), in_axes=(0, None))(qs, k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(2):
            ref_loss = lambda q, k: jnp.sum(flashjax.flash_attn(q, k, v.astype(jnp.float32),
                                                                backend="reference") ** 2)
            want = jax.grad(ref_loss, argnums=(0, 1))(qs[i].astype(jnp.float32), k.astype(jnp.float32))
            assert sweep.rel_err(got[0][i], want[0]) < 2e-2 and sweep.rel_err(got[1][i], want[1]) < 2e-2


def test_two_shapes_in_one_process():
    for seed, (sq, sk, d) in enumerate([(77, 1000, 64), (1000, 77, 256)]):
        q, k, v = _inputs(10 + seed, sq=sq, sk=sk, d=d)
        got = flashjax.flash_attn(q, k, v, backend="kernel")
        want = flashjax.flash_attn(*(x.astype(jnp.float32) for x in (q, k, v)), backend="reference")
        assert sweep.rel_err(got, want) < 1e-2


def test_output_is_deterministic_run_to_run():
    q, k, v = _inputs(5)
    f = jax.jit(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, backend="kernel"))
    a, b = f(q, k, v), f(q, k, v)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# Back-to-back kernels, each reading what the one before wrote, with no other op in between (one jit, one stream):
# the sm90 forward launches with programmatic dependent launch, so it may start while the previous kernel still
# runs, and its first global access must wait for that kernel's writes. Each output becomes the next call's values
# (O = P V is linear in them) or queries (against keys scaled up, so the scores depend on them); short calls, so
# that the next launch lands in the previous kernel's tail. A read of the output buffer before it is written gives
# errors of order 1.
def _chained_calls_rel_err(b=2, s=300, h=8):
    q, k, v = _inputs(6, b=b, sq=s, sk=s, hq=h, hk=h)
    k = (k.astype(jnp.float32) * 4.0).astype(k.dtype)

    def chain(q, k, v, backend):
        for step in range(6):
            out = flashjax.flash_attn(q, k, v, causal=True, backend=backend)
            if step % 2 == 0:
                v = out
            else:
                q = out
        return out

    got = jax.jit(lambda *a: chain(*a, "kernel"))(q, k, v)
    want = chain(*(x.astype(jnp.float32) for x in (q, k, v)), "reference")
    return sweep.rel_err(got, want)


def test_chained_calls_read_the_previous_output():
    # bf16 rounding of each link: 0.25% (the reference on bf16 inputs); a stale Q or V at one link: 33-51%.
    assert _chained_calls_rel_err() < 1e-2


def test_chained_split_calls_read_the_previous_output():
    # The same through split keys: 16 tiles of 8 blocks run as 2 parts each on an H200, so every link is the split
    # kernel and its combine, both launched programmatically (the combine must wait for every part, the next split
    # kernel for the combine).
    q = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
    text = flashjax.explain(q, q, q, causal=True)
    if "sm90 forward kernel" in text and getattr(jax.devices()[0], "core_count", 0) >= 128:
        assert "keys split" in text, f"the chain no longer reaches the split path: {text}"
    assert _chained_calls_rel_err(b=1, s=1000, h=2) < 1e-2


# FLASHJAX_SM90_PDL=0 (README) launches without programmatic dependent launch. The launcher reads it once per
# process, so the same chain runs in a fresh one.
def test_chained_calls_without_programmatic_launch():
    assert float(_in_fresh_process("_chained_calls_rel_err()", 600, FLASHJAX_SM90_PDL="0")) < 1e-2
