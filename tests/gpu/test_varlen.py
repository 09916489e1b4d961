"""Varlen (packed sequences) on the kernels against the reference (issue 37): whatever dispatch picks, i.e. on Hopper
the sm90 family both ways, elsewhere (or with FLASHJAX_DISABLE_FAMILIES=sm90) the sm80 family both ways.

Random packings (N 1..64, lengths 0..2000 with many empty and tiny ones, q and k packed differently, seqused, GQA,
causal / windows, sinks, softcap, bf16 / fp16, odd head dims) from a fresh seed each run (FLASHJAX_VARLEN_SEED
fixes it), and fixed cases that reach each feature for sure; relative error by norm as tests/gpu/sweep.py measures
it (gradients at twice the output tolerance, dsinks against the sum of its terms' magnitudes). Gradients run
through the backward kernel dispatch picks, dlse and dsinks included; rows and keys that no sequence uses must get
exactly zero gradients. Malformed offsets run under jit (no Python check) and must give finite outputs and gradients, no crash.
FLASHJAX_SMEM_LIMIT_KB=99 runs the same tests on the 99 KB rows.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import sweep

SEED = int(os.environ.get("FLASHJAX_VARLEN_SEED", np.random.SeedSequence().entropy % 2**31))
CASES = int(os.environ.get("FLASHJAX_VARLEN_N", 48))
print(f"test_varlen: seed {SEED} (FLASHJAX_VARLEN_SEED={SEED} repeats this run)")


def _lengths(rng, n):
    """Many empty and tiny sequences, some long ones (up to 2000)."""
    kind = rng.integers(0, 4, n)
    return np.where(kind == 0, 0, np.where(kind == 1, rng.integers(1, 9, n), rng.integers(1, 2001, n)))


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def random_varlen_config(rng):
    n = int(rng.integers(1, 65))
    # Bound the tokens so that the reference stays quick: at most ~16k per side.
    lengths_q = np.minimum(_lengths(rng, n), 16384 // n)
    decode = rng.random() < 0.2
    if decode:  # one query per sequence against long caches
        lengths_q = np.ones(n, np.int64)
    lengths_k = lengths_q.copy() if rng.random() < 0.4 else np.minimum(_lengths(rng, n), 16384 // n)
    hk = int(rng.choice([1, 2, 4]))
    hq = hk * int(rng.choice([1, 2, 4]))
    # The reference with max_seqlen hints pads every sequence to the longest: its scores are N x Hq x max_q x max_k
    # f32, several times over in the backward. Halve the lengths until that is ~256 MB, so that the suite's parallel
    # workers fit on one GPU (whole-sequence halving keeps the empty and the one-token ones as they are).
    while n * hq * max(lengths_q.max(), 1) * max(lengths_k.max(), 1) > 1 << 26:
        lengths_q, lengths_k = (np.where(x > 1, (x + 1) // 2, x) for x in (lengths_q, lengths_k))
    cfg = dict(
        lengths_q=lengths_q, lengths_k=lengths_k, hk=hk, hq=hq,
        d=int(rng.choice([8, 40, 64, 80, 96, 128, 160, 192, 256])),
        dtype=str(rng.choice(["bfloat16", "float16"])),
        causal=bool(rng.random() < 0.5), window=(-1, -1), sinks=bool(rng.random() < 0.3),
        softcap=float(rng.choice([0.0, 0.0, 0.0, 15.0])),
        padding_q=int(rng.choice([0, 0, 37])), padding_k=int(rng.choice([0, 0, 64])),
        seqused_q=bool(rng.random() < 0.25), seqused_k=bool(rng.random() < 0.35))
    if not cfg["causal"] and rng.random() < 0.3:
        cfg["window"] = (int(rng.integers(-1, 300)), int(rng.integers(-1, 300)))
    return cfg


def _inputs(cfg, rng):
    dtype = jnp.dtype(cfg["dtype"])
    tq = int(cfg["lengths_q"].sum()) + cfg["padding_q"]
    tk = int(cfg["lengths_k"].sum()) + cfg["padding_k"]
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = normal(tq, cfg["hq"], cfg["d"]).astype(dtype)
    k = normal(tk, cfg["hk"], cfg["d"]).astype(dtype)
    v = normal(tk, cfg["hk"], cfg["d"]).astype(dtype)
    extra = dict(
        cu_seqlens_q=jnp.asarray(_offsets(cfg["lengths_q"])), cu_seqlens_k=jnp.asarray(_offsets(cfg["lengths_k"])),
        seqused_q=jnp.asarray(rng.integers(0, cfg["lengths_q"] + 1), jnp.int32) if cfg["seqused_q"] else None,
        seqused_k=jnp.asarray(rng.integers(0, cfg["lengths_k"] + 1), jnp.int32) if cfg["seqused_k"] else None,
        sinks=normal(cfg["hq"]) if cfg["sinks"] else None)
    cotangents = (normal(tq, cfg["hq"], cfg["d"]).astype(dtype), normal(cfg["hq"], tq))
    return (q, k, v), extra, cotangents


def _run(cfg, qkv, extra, cotangents, backend):
    hints = dict(max_seqlen_q=int(max(cfg["lengths_q"].max(), 1)), max_seqlen_k=int(max(cfg["lengths_k"].max(), 1)))
    sinks = extra["sinks"]
    fixed = {key: val for key, val in extra.items() if key != "sinks"}

    def attention(q, k, v, sinks):
        return flashjax.flash_attn_varlen(q, k, v, **fixed, sinks=sinks, causal=cfg["causal"],
                                          window_size=cfg["window"], softcap=cfg["softcap"], return_lse=True,
                                          backend=backend, **hints)

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attention, q, k, v, sinks)
        return out, lse, vjp((d_out, jnp.where(jnp.isfinite(lse), d_lse, 0.0)))

    out, lse, grads = fwd_bwd(*qkv, sinks, *cotangents)  # sinks None: a pytree without leaves, its gradient None
    return out, lse, grads


def _dsinks_scale(cfg, cotangents, reference):
    """Per head, the sum of the magnitudes of dsinks' terms (sweep.dsinks_scale, for lse [Hq, Tq])."""
    d_out, d_lse = cotangents
    out_r, lse_r, _ = reference
    lse = np.asarray(lse_r, np.float64)
    sinks = np.asarray(cfg["_sinks"], np.float64)[:, None]
    p_sink = np.where(np.isfinite(lse), np.exp(sinks - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    terms = np.where(np.isfinite(lse), np.abs(np.asarray(d_lse, np.float64)), 0.0) + np.einsum(
        "thd,thd->ht", np.abs(np.asarray(d_out.astype(jnp.float32), np.float64)), np.abs(np.asarray(out_r, np.float64)))
    return np.linalg.norm(np.sum(p_sink * terms, axis=1))


def _compare(cfg, kernel, reference, cotangents=None):
    out_k, lse_k, grads_k = kernel
    out_r, lse_r, grads_r = reference
    lse_k, lse_r = np.asarray(lse_k), np.asarray(lse_r)
    errors = {"out": sweep.rel_err(out_k, out_r)}
    same_inf = np.array_equal(np.isneginf(lse_k), np.isneginf(lse_r)) and not np.any(np.isnan(lse_k))
    finite = np.isfinite(lse_r)
    errors["lse"] = sweep.rel_err(lse_k[finite], lse_r[finite]) if same_inf else float("nan")
    for name, g_k, g_r in zip(("dq", "dk", "dv", "dsinks"), grads_k, grads_r):
        if g_r is None:
            continue
        scale = _dsinks_scale(cfg, cotangents, reference) if name == "dsinks" and cotangents is not None else 0.0
        errors[name] = sweep.rel_err(g_k, g_r, scale if scale > 0 else None)
    return errors


def _check(cfg, errors):
    tol = sweep.TOLERANCE[cfg["dtype"]]
    return {name: err for name, err in errors.items() if not err <= (tol if name in ("out", "lse") else 2 * tol)}


def _unused_rows(lengths, used, total):
    """Rows of a packed tensor that no sequence uses (padding, past seqused): their gradients must be exactly 0."""
    unused = np.ones(total, bool)
    start = 0
    for b, length in enumerate(lengths):
        unused[start:start + (length if used is None else int(used[b]))] = False
        start += length
    return unused


def _case(cfg, rng):
    qkv, extra, cotangents = _inputs(cfg, rng)
    cfg = dict(cfg, _sinks=extra["sinks"])
    kernel = _run(cfg, qkv, extra, cotangents, "kernel")
    reference = _run(cfg, qkv, extra, cotangents, "reference")
    return cfg, extra, kernel, _compare(cfg, kernel, reference, cotangents)


@pytest.mark.parametrize("index", range(CASES))
def test_random_varlen_matches_reference(index):
    rng = np.random.default_rng([SEED, index])
    cfg = random_varlen_config(rng)
    cfg, _, _, errors = _case(cfg, rng)
    bad = _check(cfg, errors)
    assert not bad, f"seed {SEED}, index {index}: {bad} (config {cfg})"


def _fixed(lengths_q, lengths_k=None, **overrides):
    cfg = dict(lengths_q=np.asarray(lengths_q), lengths_k=np.asarray(lengths_q if lengths_k is None else lengths_k),
               hk=2, hq=4, d=64, dtype="bfloat16", causal=False, window=(-1, -1), sinks=False, softcap=0.0,
               padding_q=0, padding_k=0, seqused_q=False, seqused_k=False)
    cfg.update(overrides)
    return cfg


# Each feature of the backward for sure, besides the random draws: sequences over many KV blocks and M blocks (the
# virtual blocks of both grids, straddling block boundaries), GQA with two-sided windows, causal + left windows,
# sinks with dlse and softcap, decode-shaped packing (one query per sequence against long keys), seqused on both
# sides, sequences empty on one side only, padding tokens, head dims 8..256, fp16.
FIXED = {
    "gqa_two_sided_window": _fixed([300, 0, 77, 513], hq=8, hk=2, d=128, window=(64, 16)),
    "causal_left_window": _fixed([700, 129, 64], [900, 129, 1], causal=True, window=(100, -1), d=96),
    "sinks_dlse_softcap": _fixed([130, 1, 260], sinks=True, softcap=15.0, dtype="float16", padding_q=37),
    "decode": _fixed(np.ones(16, int), np.arange(16) * 113 + 50, hq=16, hk=2, d=256, causal=True, sinks=True,
                     seqused_k=True),
    "seqused_both": _fixed([200, 129, 64, 1], d=96, dtype="float16", causal=True, seqused_q=True, seqused_k=True,
                           padding_k=64),
    "empty_on_one_side": _fixed([0, 50, 70, 0, 3], [40, 0, 90, 0, 200], d=8, causal=True, sinks=True),
    "long_causal": _fixed([3000], hq=2, hk=1, d=64, causal=True),
    "d192_fp16": _fixed([333, 65, 128], [200, 400, 1], d=192, dtype="float16", window=(32, 7), sinks=True),
    "d40_mqa": _fixed([190, 61], hq=8, hk=1, d=40, softcap=15.0, seqused_q=True),
    # The sm90 forward's tiles start at each sequence's first row and run over into the next sequence: lengths around
    # its 64-row warpgroups and 128-row tiles on both sides, packed differently; an empty sequence between two long
    # ones (several tiles each, seqused inside them); decode against caches of 1k..4k keys (GQA 4:1); D 64 / 128 /
    # 256; a window with softcap.
    "tile_boundaries": _fixed([63, 64, 65, 127, 128, 129], [129, 128, 127, 65, 64, 63], d=128, causal=True,
                              sinks=True, padding_q=5, padding_k=3),
    "empty_between_long": _fixed([1500, 0, 1300], [1400, 0, 1700], hq=4, hk=1, d=256, seqused_q=True,
                                 seqused_k=True),
    "decode_long_caches": _fixed(np.ones(32, int), np.arange(32) * 97 + 1000, hq=8, hk=2, d=128, causal=True),
    "d64_window_softcap": _fixed([257, 3, 190, 64], [300, 1, 190, 700], d=64, window=(40, 40), softcap=15.0,
                                 dtype="float16"),
    # The sm90 backward's CTAs own 128 keys at D <= 128 and 64 at D 192 / 256 and step over 64 query rows, each box
    # from its sequence's first row: key lengths around both key blocks (63 .. 129) against query lengths packed
    # differently, at the two warpgroup splits (by keys: D 64 / 128; by head dim: D 192 / 256), GQA, seqused inside
    # the last blocks, sinks with dlse and softcap, padding tokens between which the last boxes run.
    "bwd_key_blocks_d64": _fixed([65, 129, 1, 64, 127, 63], [63, 64, 65, 127, 128, 129], d=64, hq=4, hk=1,
                                 sinks=True, padding_q=11, padding_k=7),
    "bwd_key_blocks_d128": _fixed([129, 63, 128, 65, 64, 127], [129, 128, 127, 65, 64, 63], d=128, causal=True,
                                  seqused_k=True, softcap=15.0, dtype="float16", padding_k=70),
    "bwd_key_blocks_d192": _fixed([63, 64, 65, 127, 128, 129], [65, 63, 129, 64, 128, 127], d=192, hq=6, hk=2,
                                  window=(50, 20), sinks=True, seqused_q=True, padding_q=40),
    "bwd_key_blocks_d256": _fixed([128, 1, 129, 64, 65, 63], [64, 129, 63, 65, 128, 127], d=256, causal=True,
                                  sinks=True, softcap=15.0, seqused_q=True, seqused_k=True, padding_k=64),
    # Decode-like calls pack GQA on the sm90 forward (mean query length ceil(Tq / N) short: fwd_choices.cuh), bf16
    # D 128 (its varlen row): issue 37's decode shape (GQA 32:8, caches 1k..32k, one query each) with seqused_k and
    # sinks; short query sequences around the packed tiling's 8-position chunks (7, 8, 9, 15, 16, 17, 33) at GQA 8,
    # so that tiles hold chunks of several sequences' heads and a sequence spans tiles; seqused_q inside them.
    "decode_gqa32_8_long_caches": _fixed(np.ones(10, int), [1024, 32768, 4097, 1, 20000, 0, 1500, 9999, 128, 31000],
                                         hq=32, hk=8, d=128, causal=True, sinks=True, seqused_k=True, padding_q=3),
    "packed_gqa_chunk_boundaries": _fixed([7, 8, 9, 15, 16, 17, 33, 1, 0], [300, 8, 129, 2000, 16, 700, 33, 1, 50],
                                          hq=16, hk=2, d=128, causal=True, seqused_q=True, padding_k=5),
    "packed_gqa_window_softcap": _fixed([3, 1, 12, 5], [900, 64, 1300, 5], hq=12, hk=3, d=128, window=(200, 0),
                                        softcap=15.0, sinks=True),
}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_varlen_cases_match_reference(name):
    rng = np.random.default_rng([SEED, 7919])
    cfg = FIXED[name]
    cfg, extra, kernel, errors = _case(cfg, rng)
    bad = _check(cfg, errors)
    assert not bad, f"seed {SEED}, {name}: {bad}"
    dq, dk, dv, _ = kernel[2]
    tq, tk = dq.shape[0], dk.shape[0]
    used_q = None if extra["seqused_q"] is None else np.asarray(extra["seqused_q"])
    used_k = None if extra["seqused_k"] is None else np.asarray(extra["seqused_k"])
    rows_q = _unused_rows(cfg["lengths_q"], used_q, tq)
    rows_k = _unused_rows(cfg["lengths_k"], used_k, tk)
    assert np.all(np.asarray(dq, np.float32)[rows_q] == 0), name
    assert np.all(np.asarray(dk, np.float32)[rows_k] == 0) and np.all(np.asarray(dv, np.float32)[rows_k] == 0), name


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_nan_in_unused_tokens_never_reaches_a_sequence(d):
    """Tokens no sequence uses (past seqused, padding past cu_seqlens[N]) hold NaN, in q, k, v and, for the kernels,
    the output's cotangent: the reference zeroes them before use, and the kernels must not let them in either,
    although the sm90 kernels' boxes load them (the forward's V rows past a sequence's used keys are multiplied by
    P = 0, the backward's K, V, Q and dO rows past the used ones by P = 0 or dS = 0, and 0 * NaN is NaN unless they
    are zeroed first). The reference gets zeros in those cotangent rows instead (the rows' outputs are constant 0, so
    their cotangent is immaterial; the reference's all-pairs branch would multiply it by P = 0 in dv)."""
    rng = np.random.default_rng([SEED, d])
    cfg = _fixed([65, 0, 130, 7], [129, 3, 200, 64], d=d, causal=True, sinks=True, seqused_q=True, seqused_k=True,
                 padding_q=9, padding_k=70)
    (q, k, v), extra, cotangents = _inputs(cfg, rng)
    used_q, used_k = np.asarray(extra["seqused_q"]), np.asarray(extra["seqused_k"])
    unused_q = _unused_rows(cfg["lengths_q"], used_q, q.shape[0])
    unused_k = _unused_rows(cfg["lengths_k"], used_k, k.shape[0])
    assert unused_k.any() and unused_q.any()
    q = jnp.where(unused_q[:, None, None], jnp.nan, q).astype(q.dtype)
    k = jnp.where(unused_k[:, None, None], jnp.nan, k).astype(k.dtype)
    v = jnp.where(unused_k[:, None, None], jnp.nan, v).astype(v.dtype)
    d_out, d_lse = cotangents
    cotangents = (jnp.where(unused_q[:, None, None], 0, d_out).astype(d_out.dtype), d_lse)
    poisoned = (jnp.where(unused_q[:, None, None], jnp.nan, d_out).astype(d_out.dtype), d_lse)
    cfg = dict(cfg, _sinks=extra["sinks"])
    kernel = _run(cfg, (q, k, v), extra, poisoned, "kernel")
    reference = _run(cfg, (q, k, v), extra, cotangents, "reference")
    bad = _check(cfg, _compare(cfg, kernel, reference, cotangents))
    assert not bad, f"seed {SEED}, d {d}: {bad}"
    assert np.all(np.isfinite(np.asarray(kernel[0], np.float32)))
    for name, g in zip(("dq", "dk", "dv"), kernel[2][:3]):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), (d, name)


def test_no_sequences_give_zero_gradients():
    q = jnp.asarray(np.random.default_rng(SEED).standard_normal((10, 4, 64)), jnp.bfloat16)
    k = q[:7, :2]
    sinks = jnp.ones((4,), jnp.float32)
    cu = jnp.zeros((1,), jnp.int32)  # N = 0: every token is padding

    def loss(q, k, v, sinks):
        out, lse = flashjax.flash_attn_varlen(q, k, v, cu, cu, sinks=sinks, return_lse=True, backend="kernel")
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, k, sinks)
    for g in grads:
        assert np.all(np.asarray(g, np.float32) == 0)


MALFORMED = {
    "decreasing": [0, 40, 20, 90],
    "negative": [-50, 10, -3, 90],
    "past_the_end": [0, 30, 5000, 90],
    "not_from_zero": [17, 40, 60, 80],
    "int32_max": [0, 2**31 - 1, 2**31 - 1, 2**31 - 1],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("causal", [False, True])
def test_malformed_offsets_give_finite_results_under_jit(name, causal):
    rng = np.random.default_rng(SEED)
    q = jnp.asarray(rng.standard_normal((90, 4, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal((90, 4, 64)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    offsets = jnp.asarray(MALFORMED[name], jnp.int32)
    seqused = jnp.asarray([2**31 - 1, -5, 7], jnp.int32)

    @jax.jit  # under jit the offsets are not concrete: nothing checks them in Python, the kernels clamp them
    def call(q, k, v, sinks, cu_q, cu_k, used):
        def plain(q, k, v, s):
            return flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, backend="kernel")

        def used_and_sinks(q, k, v, s):
            return flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, seqused_q=used, seqused_k=used, sinks=s,
                                              causal=causal, return_lse=True, backend="kernel")

        results = []
        for fn in (plain, used_and_sinks):
            (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
            results.append((out, lse, vjp((d_out, jnp.where(jnp.isfinite(lse), 1.0, 0.0)))))
        return results

    for out, lse, grads in call(q, k, v, sinks, offsets, offsets[::-1] if name == "decreasing" else offsets, seqused):
        out, lse, grads = jax.block_until_ready((out, lse, grads))
        assert np.all(np.isfinite(np.asarray(out, np.float32))), name
        assert not np.any(np.isnan(np.asarray(lse))) and not np.any(np.asarray(lse) == np.inf), name
        for g in grads:
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name


def _sm90_varlen(direction):
    """Whether dispatch gives varlen calls of `direction` ("fwd", "bwd") to the sm90 family here: an sm90 device, the
    build's bf16 D 128 sm90 row marked varlen, and the family not switched off (the sm80 mode)."""
    device = flashjax._ffi.default_device()
    if device is None or device[0] != 90 or "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(","):
        return False
    return any(row["family"] == "sm90" and row["direction"] == direction and row["dtype"] == "bf16" and
               row["head_dim"] == 128 and row.get("varlen") for row in flashjax._ffi.build_info().get("kernels", []))


def test_explain_names_the_varlen_families():
    q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    text = flashjax.explain(q, k, k, cu, cu, causal=True)
    forward = text.split("backward: ", 1)[0]  # the plan's reason is the forward's, then its tiles
    family = "sm90" if _sm90_varlen("fwd") else "sm80"
    assert f": kernel ({family} forward kernel" in forward and "varlen" in forward, text
    if family == "sm90":  # mean query length 25 at GQA 4: the group's query heads share each tile; no key splits
        assert "the varlen kernel's" in forward and "share each varlen tile" in forward, text
    backward = text.split("backward: ", 1)[1]
    family = "sm90" if _sm90_varlen("bwd") else "sm80"
    assert backward.startswith(f"{family} backward kernel") and "varlen" in backward, text
    # No varlen kernel orders its dq sums: deterministic=True takes the reference, saying why.
    text = flashjax.explain(q, k, k, cu, cu, deterministic=True)
    assert ": reference (" in text and "deterministic=True" in text, text


def test_dynamic_walk_lowers_to_the_counter_target():
    """The sm90 forward's lowering carries the tile counter of its run-time walk (flashjax_fwd_varlen_dynamic) unless
    FLASHJAX_SM90_VARLEN_WALK (read once per process) asks for a static walk (0 or 1: the plain target)."""
    if not _sm90_varlen("fwd"):
        pytest.skip("varlen forward not on the sm90 family here")
    q = jnp.zeros((300, 4, 128), jnp.bfloat16)
    cu = jnp.asarray([0, 100, 300], jnp.int32)
    text = jax.jit(lambda q, cu: flashjax.flash_attn_varlen(q, q, q, cu, cu, causal=True, backend="kernel")).lower(
        q, cu).as_text()
    dynamic = os.environ.get("FLASHJAX_SM90_VARLEN_WALK", "2") == "2"
    assert ("@flashjax_fwd_varlen_dynamic(" in text) == dynamic, text
    assert dynamic or "@flashjax_fwd_varlen(" in text, text


def test_round_robin_walk_matches_reference():
    """The forward's static round-robin walk (FLASHJAX_SM90_VARLEN_WALK=0; the run-time walk is the default) on a few
    random packings, the fixed cases and malformed offsets: this file's own tests in a child process with the setting
    (it is read once per process)."""
    if os.environ.get("FLASHJAX_SM90_VARLEN_WALK", "2") != "2":
        pytest.skip("this process runs a static walk already")
    if not _sm90_varlen("fwd"):
        pytest.skip("varlen forward not on the sm90 family here")
    import subprocess
    import sys
    env = dict(os.environ, FLASHJAX_SM90_VARLEN_WALK="0", FLASHJAX_VARLEN_N="12", FLASHJAX_VARLEN_SEED=str(SEED))
    tests = "random_varlen or fixed_varlen or malformed or nan_in_unused or dynamic_walk_lowers"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
