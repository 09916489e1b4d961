"""Varlen (packed) attention with a mask mod on the kernels (issue 38, design §2.6-2.7): the sm80 forward and backward
on every GPU (dispatch's VARLEN_MASK_MOD rows; on Hopper too, where the sm90 kernels take each feature alone), the mod
evaluated with b = the sequence and sequence-local indices into bits over the sequences padded to the max_seqlen
hints, against the reference with the mod itself.

Random packings (N 1..16, lengths 0..700 with empty and tiny sequences, q and k packed differently, seqused, GQA,
causal / windows ANDed, sinks, softcap, D 64 / 128 / 256 and odd widths, bf16 / fp16) from a fresh seed per run
(FLASHJAX_VARLEN_MASK_SEED replays one), fixed cases that reach each feature for sure, and per-sequence mods: a
document mask whose ids are local to each sequence, a per-(sequence, head) mod, a top-left sliding window, prefix LM.
Gradients (dq, dk, dv, dsinks, dlse) through the backward kernel; unused rows get exactly zero gradients. Malformed
offsets and a hint smaller than a sequence under jit give finite results, no crash. Tolerances: test_varlen.py's."""
import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import test_varlen as cases  # its inputs, comparison and tolerances (a module: its tests are not collected here)
from flashjax.masks import MaskMod

SEED = int(os.environ.get("FLASHJAX_VARLEN_MASK_SEED", np.random.SeedSequence().entropy % 2**31))
CASES = int(os.environ.get("FLASHJAX_VARLEN_MASK_N", 24))


def test_seed_is_reported():
    print(f"FLASHJAX_VARLEN_MASK_SEED={SEED}")


@dataclasses.dataclass(frozen=True)
class SequenceHeadStripes(MaskMod):
    """Per (sequence, query head): head h sees the keys whose (kv // 16) % (h + 2) != 0, within reach[b, h] of the
    diagonal (bits per sequence and per head)."""

    reach: jax.Array  # [N, Hq]

    def __call__(self, b, h, q_idx, kv_idx):
        return ((kv_idx // 16) % (h + 2) != 0) & (kv_idx <= q_idx + self.reach[b, h])


def _doc_ids(rng, n, length, docs):
    """int32 [n, length]: each sequence cut into documents at random local positions of its own."""
    ids = np.zeros((n, max(length, 1)), np.int32)
    for r in range(n):
        if length > 1:
            cuts = np.sort(rng.choice(np.arange(1, length), size=min(docs - 1, length - 1), replace=False))
            ids[r] = np.searchsorted(cuts, np.arange(length), side="right")
    return jnp.asarray(ids)


# name -> mod from (rng, sequences, query heads, longest sequence)
MODS = {
    "document": lambda rng, n, h, s: flashjax.document_mask(_doc_ids(rng, n, s, 4)),
    "per_head": lambda rng, n, h, s: SequenceHeadStripes(jnp.asarray(rng.integers(-30, 60, (n, h)), jnp.int32)),
    "sliding_window": lambda rng, n, h, s: flashjax.sliding_window_mask(int(rng.integers(1, 150)),
                                                                        int(rng.integers(0, 40))),
    "prefix_lm": lambda rng, n, h, s: flashjax.prefix_lm_mask(jnp.asarray(rng.integers(0, max(s, 1), n), jnp.int32)),
    "causal": lambda rng, n, h, s: flashjax.causal_mask(),
}


def _lengths(rng, n):
    kind = rng.integers(0, 4, n)
    return np.where(kind == 0, 0, np.where(kind == 1, rng.integers(1, 9, n), rng.integers(1, 701, n)))


def _random_config(rng):
    n = int(rng.integers(1, 17))
    lengths_q = _lengths(rng, n)
    lengths_k = lengths_q.copy() if rng.random() < 0.4 else _lengths(rng, n)
    hk = int(rng.choice([1, 2]))
    cfg = cases._fixed(lengths_q, lengths_k, hk=hk, hq=hk * int(rng.choice([1, 2, 4])),
                       d=int(rng.choice([64, 128, 256, 80])), dtype=str(rng.choice(["bfloat16", "float16"])),
                       causal=bool(rng.random() < 0.5), sinks=bool(rng.random() < 0.3),
                       softcap=float(rng.choice([0.0, 0.0, 15.0])), padding_q=int(rng.choice([0, 37])),
                       padding_k=int(rng.choice([0, 64])), seqused_q=bool(rng.random() < 0.25),
                       seqused_k=bool(rng.random() < 0.35))
    if not cfg["causal"] and rng.random() < 0.3:
        cfg["window"] = (int(rng.integers(-1, 300)), int(rng.integers(-1, 300)))
    return cfg


def _hints(cfg):
    return dict(max_seqlen_q=int(max(cfg["lengths_q"].max(), 1)), max_seqlen_k=int(max(cfg["lengths_k"].max(), 1)))


def _run(cfg, qkv, extra, cotangents, mod, backend):
    """out, lse and (dq, dk, dv, dsinks) under jit, the offsets and the mod's fields as jit arguments."""
    sinks = extra["sinks"]
    fixed = {key: val for key, val in extra.items() if key != "sinks"}
    q, k, v = qkv
    d_out, d_lse = cotangents
    if backend == "reference":
        q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse, fixed, mod):
        def attention(q, k, v, sinks):
            return flashjax.flash_attn_varlen(q, k, v, **fixed, sinks=sinks, causal=cfg["causal"],
                                              window_size=cfg["window"], softcap=cfg["softcap"], mask_mod=mod,
                                              return_lse=True, backend=backend, **_hints(cfg))

        (out, lse), vjp = jax.vjp(attention, q, k, v, sinks)
        return out, lse, vjp((d_out.astype(out.dtype), jnp.where(jnp.isfinite(lse), d_lse, 0.0)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwd_bwd(q, k, v, sinks, d_out, d_lse, fixed, mod)


def _case(cfg, mod_name, rng):
    qkv, extra, cotangents = cases._inputs(cfg, rng)
    longest = int(max(cfg["lengths_q"].max(), cfg["lengths_k"].max(), 1))
    mod = MODS[mod_name](rng, len(cfg["lengths_q"]), cfg["hq"], longest)
    cfg = dict(cfg, _sinks=extra["sinks"])
    kernel = _run(cfg, qkv, extra, cotangents, mod, "kernel")
    reference = _run(cfg, qkv, extra, cotangents, mod, "reference")
    errors = cases._compare(cfg, kernel, reference, cotangents)
    bad = cases._check(cfg, errors)
    return cfg, extra, kernel, bad, errors


@pytest.mark.parametrize("index", range(CASES))
def test_random_varlen_mask_mod_matches_reference(index):
    rng = np.random.default_rng([SEED, index])
    cfg = _random_config(rng)
    mod_name = sorted(MODS)[index % len(MODS)]
    cfg, _, _, bad, errors = _case(cfg, mod_name, rng)
    assert not bad, f"seed {SEED}, index {index}, {mod_name}: {bad}; all {errors} (config {cfg})"


FIXED = {
    "gqa_causal_d128": cases._fixed([300, 0, 77, 513], [400, 5, 77, 600], hq=8, hk=2, d=128, causal=True),
    "window_d64_fp16": cases._fixed([129, 1, 640, 64], d=64, dtype="float16", window=(64, 16), padding_q=9),
    "sinks_softcap_d256": cases._fixed([130, 1, 260, 0], [200, 3, 260, 7], d=256, sinks=True, softcap=15.0,
                                       seqused_q=True, seqused_k=True, padding_k=64),
    "decode": cases._fixed(np.ones(16, int), np.arange(16) * 43 + 20, hq=8, hk=2, d=128, causal=True, sinks=True,
                           seqused_k=True),
    "empty_and_tiny": cases._fixed([0, 1, 2, 0, 700, 3], [5, 0, 700, 1, 2, 0], d=64, causal=True),
    "odd_width_mqa": cases._fixed([190, 61, 333], hq=4, hk=1, d=40, softcap=15.0, seqused_q=True),
}


@pytest.mark.parametrize("name", sorted(FIXED))
@pytest.mark.parametrize("mod_name", sorted(MODS))
def test_fixed_varlen_mask_mod_cases_match_reference(name, mod_name):
    rng = np.random.default_rng([SEED, 7919, sorted(FIXED).index(name)])
    cfg, extra, kernel, bad, errors = _case(FIXED[name], mod_name, rng)
    assert not bad, f"seed {SEED}, {name}, {mod_name}: {bad}; all {errors}"
    dq, dk, dv, _ = kernel[2]
    used_q = None if extra["seqused_q"] is None else np.asarray(extra["seqused_q"])
    used_k = None if extra["seqused_k"] is None else np.asarray(extra["seqused_k"])
    rows_q = cases._unused_rows(cfg["lengths_q"], used_q, dq.shape[0])
    rows_k = cases._unused_rows(cfg["lengths_k"], used_k, dk.shape[0])
    assert np.all(np.asarray(dq, np.float32)[rows_q] == 0), name
    assert np.all(np.asarray(dk, np.float32)[rows_k] == 0) and np.all(np.asarray(dv, np.float32)[rows_k] == 0), name


def test_the_mod_is_local_to_each_sequence():
    """The same document ids for every sequence (one row) give what a dense batch of the same sequences gives (the
    dense call may run another family: equal up to rounding)."""
    rng = np.random.default_rng([SEED, 11])
    lengths = np.array([200, 200, 200])
    cfg = cases._fixed(lengths, d=128, causal=True)
    (q, k, v), extra, _ = cases._inputs(cfg, rng)
    mod = flashjax.document_mask(_doc_ids(rng, 1, 200, 3))
    packed = flashjax.flash_attn_varlen(q, k, v, extra["cu_seqlens_q"], extra["cu_seqlens_k"], causal=True,
                                        mask_mod=mod, backend="kernel")
    dense = flashjax.flash_attn(q.reshape(3, 200, 4, 128), k.reshape(3, 200, 2, 128), v.reshape(3, 200, 2, 128),
                                causal=True, mask_mod=mod, backend="kernel")
    packed, dense = np.asarray(packed, np.float32), np.asarray(dense, np.float32).reshape(600, 4, 128)
    assert np.linalg.norm(packed - dense) <= 1e-2 * np.linalg.norm(dense)
    without = np.asarray(flashjax.flash_attn_varlen(q, k, v, extra["cu_seqlens_q"], extra["cu_seqlens_k"],
                                                    causal=True, backend="kernel"), np.float32)
    assert np.linalg.norm(packed - without) > 0.1 * np.linalg.norm(dense)  # the mod did mask something


def test_explain_names_the_sm80_kernels_and_the_reference_tangent():
    q = jax.ShapeDtypeStruct((100, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((300, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    mod = flashjax.sliding_window_mask(64, 0)
    text = flashjax.explain(q, k, k, cu, cu, causal=True, mask_mod=mod, max_seqlen_q=64, max_seqlen_k=128)
    forward, backward = text.split("backward: ", 1)
    assert ": kernel (sm80 forward kernel" in forward and "varlen with a mask mod" in forward, text
    assert backward.startswith("sm80 backward kernel") and "varlen with a mask mod" in backward, text
    assert "tangent (jax.jvp): the reference's (no tangent kernel implements mask_mod with varlen" in text, text
    # Traced offsets without the hints: the grid is unknown, the call runs the reference and says why.
    text = flashjax.explain(q, k, k, cu, cu, mask_mod=mod)
    assert ": reference (" in text and "max_seqlen_q and max_seqlen_k" in text, text
    with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k"):
        jax.jit(lambda q, cu: flashjax.flash_attn_varlen(q, q, q, cu, cu, mask_mod=mod, backend="kernel"))(
            jnp.ones((64, 2, 64), jnp.bfloat16), jnp.array([0, 64], jnp.int32))


def test_jvp_runs_the_reference_tangent():
    rng = np.random.default_rng([SEED, 12])
    cfg = cases._fixed([150, 0, 90], [170, 4, 90], d=64, causal=True)
    (q, k, v), extra, _ = cases._inputs(cfg, rng)
    mod = MODS["per_head"](rng, 3, 4, 170)
    fixed = {key: val for key, val in extra.items() if key != "sinks"}

    def f(backend, dtype):
        k_, v_ = k.astype(dtype), v.astype(dtype)
        return lambda q: flashjax.flash_attn_varlen(q, k_, v_, **fixed, causal=True, mask_mod=mod,
                                                    backend=backend).astype(jnp.float32)

    _, t_kernel = jax.jvp(f("kernel", q.dtype), (q,), (q,))
    q32 = q.astype(jnp.float32)
    _, t_ref = jax.jvp(f("reference", jnp.float32), (q32,), (q32,))
    assert float(jnp.linalg.norm(t_kernel - t_ref) / jnp.linalg.norm(t_ref)) < 2e-2


@pytest.mark.parametrize("name", sorted(cases.MALFORMED) + ["hint_too_small"])
@pytest.mark.parametrize("causal", [False, True])
def test_malformed_offsets_with_a_mod_give_finite_results_under_jit(name, causal):
    """Under jit nothing checks the offsets: the kernels clamp them, and cut any sequence longer than the bits' grid
    (flashjax/mask_grid.h), so no bit or tile class outside the buffers is read. hint_too_small: well-formed offsets
    whose second sequence (60 rows, 70 keys) is longer than the hints (40, 50)."""
    rng = np.random.default_rng([SEED, 13])
    q = jnp.asarray(rng.standard_normal((90, 4, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((120, 2, 64)), jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal((90, 4, 64)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    well_formed = name == "hint_too_small"
    cu_q = jnp.asarray([0, 20, 80, 90] if well_formed else cases.MALFORMED[name], jnp.int32)
    cu_k = jnp.asarray([0, 30, 100, 120] if well_formed else cases.MALFORMED[name], jnp.int32)
    if name == "decreasing":
        cu_k = cu_k[::-1]
    seqused = jnp.asarray([2**31 - 1, -5, 7], jnp.int32)
    mods = (flashjax.document_mask(_doc_ids(rng, 3, 40, 3)),
            SequenceHeadStripes(jnp.asarray(rng.integers(-10, 30, (3, 4)), jnp.int32)))

    @jax.jit
    def call(q, k, v, sinks, cu_q, cu_k, used, mods):
        results = []
        for mod in mods:
            for extra in ({}, dict(seqused_q=used, seqused_k=used)):
                def fn(q, k, v, s):
                    return flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, sinks=s, causal=causal, mask_mod=mod,
                                                      return_lse=True, backend="kernel", max_seqlen_q=40,
                                                      max_seqlen_k=50, **extra)
                (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
                results.append((out, lse, vjp((d_out, jnp.where(jnp.isfinite(lse), 1.0, 0.0)))))
        return results

    for out, lse, grads in call(q, k, v, sinks, cu_q, cu_k, seqused, mods):
        out, lse, grads = jax.block_until_ready((out, lse, grads))
        assert np.all(np.isfinite(np.asarray(out, np.float32))), name
        assert not np.any(np.isnan(np.asarray(lse))) and not np.any(np.asarray(lse) == np.inf), name
        for g in grads:
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    if well_formed:  # rows past the grid's 40 are cut: out 0 and lse -inf there (mask_grid.h)
        out, lse, _ = call(q, k, v, sinks, cu_q, cu_k, seqused, mods)[0]
        assert np.all(np.asarray(out, np.float32)[60:80] == 0) and np.all(np.isneginf(np.asarray(lse)[:, 60:80]))
