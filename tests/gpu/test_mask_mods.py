"""Mask mods on the kernels (issue 38): the sm80 and sm90 forward and backward with a mod's packed bits, against the
reference (docs/design.md §5's tolerances) on fresh random data, for the built-in masks and custom ones, every dtype,
several widths (an odd one included), GQA, Sq != Sk both ways, lengths that are not a multiple of any tile, the band
ANDed, softcap, sinks, rows with no visible key, bits broadcast over batch / heads and per head, heads whose tiles
are all empty; explain names the family. FLASHJAX_MASK_SEED replays one run (the seed is printed)."""
import dataclasses
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import sweep
from flashjax import mask_bits
from flashjax.masks import MaskMod, static

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cpu"))
import mask_mod_examples as examples  # noqa: E402

SEED = int(os.environ.get("FLASHJAX_MASK_SEED", np.random.SeedSequence().entropy % 2**31))


def test_seed_is_reported():
    print(f"FLASHJAX_MASK_SEED={SEED}")


@dataclasses.dataclass(frozen=True)
class RowsWithoutKeys(MaskMod):
    """Causal, except that every row q with q % period == phase sees no key at all (an empty row by the mod alone)."""

    period: int = static()
    phase: int = static()

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx % self.period != self.phase)


@dataclasses.dataclass(frozen=True)
class HeadStripes(MaskMod):
    """Per query head: head h sees the keys whose (kv // 16) % (h + 2) != 0, within a per-(batch, head) reach."""

    reach: jax.Array  # [B, H]

    def __call__(self, b, h, q_idx, kv_idx):
        return ((kv_idx // 16) % (h + 2) != 0) & (kv_idx <= q_idx + self.reach[b, h])


@dataclasses.dataclass(frozen=True)
class SomeHeadsBlind(MaskMod):
    """Query heads below `blind` see no key at all, the others a band of half-width 40 (h + 1) around the diagonal:
    per-head bits whose tiles are empty for some heads only; with GQA a KV head whose whole group is blind gets no
    gradient (the sm90 backward's CTAs there find every list empty)."""

    blind: int = static()

    def __call__(self, b, h, q_idx, kv_idx):
        return (h >= self.blind) & (kv_idx <= q_idx + 40 * (h + 1)) & (kv_idx + 40 * (h + 1) >= q_idx)


def _doc_ids(rng, rows, length, docs):
    """int32 [rows, length]: each row cut into `docs` documents at random points of its own."""
    ids = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(docs - 1, length - 1), replace=False))
        ids[r] = np.searchsorted(cuts, np.arange(length), side="right")
    return jnp.asarray(ids)


# name -> mod from (rng, batch, heads, longest sequence)
MODS = {
    "causal": lambda rng, b, h, s: flashjax.causal_mask(),
    "document": lambda rng, b, h, s: flashjax.document_mask(_doc_ids(rng, b, s, 5)),
    "document_one_row": lambda rng, b, h, s: flashjax.document_mask(_doc_ids(rng, 1, s, 3)),
    "sliding_window": lambda rng, b, h, s: flashjax.sliding_window_mask(int(rng.integers(1, 150)),
                                                                        int(rng.integers(0, 40))),
    "prefix_lm": lambda rng, b, h, s: flashjax.prefix_lm_mask(jnp.asarray(rng.integers(0, s, b), jnp.int32)),
    "prefix_lm_window": lambda rng, b, h, s: examples.PrefixLMWindow(
        jnp.asarray(rng.integers(0, s, b), jnp.int32), window=int(rng.integers(8, 120))),
    "global_local": lambda rng, b, h, s: examples.GlobalLocal(num_global=int(rng.integers(1, 20)),
                                                              window=int(rng.integers(4, 90))),
    "per_head": lambda rng, b, h, s: HeadStripes(jnp.asarray(rng.integers(-30, 60, (b, h)), jnp.int32)),
    "rows_without_keys": lambda rng, b, h, s: RowsWithoutKeys(period=7, phase=int(rng.integers(0, 7))),
    "some_heads_blind": lambda rng, b, h, s: SomeHeadsBlind(blind=max(1, h // 2)),
}


def _run(cfg, mod, inputs, backend):
    """out, lse and (dq, dk, dv, dsinks) for random cotangents, under jit, the mod's fields as jit arguments."""
    q, k, v, sinks, d_out, d_lse = inputs
    if backend == "reference":
        q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse, mod):
        def attention(q, k, v, sinks):
            return flashjax.flash_attn(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                       softcap=cfg.softcap, mask_mod=mod, return_lse=True,
                                       deterministic=cfg.deterministic, backend=backend)

        (out, lse), vjp = jax.vjp(attention, q, k, v, sinks)
        grads = vjp((d_out.astype(out.dtype), jnp.where(jnp.isfinite(lse), d_lse, 0.0)))
        return out, lse, grads

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwd_bwd(q, k, v, sinks, d_out, d_lse, mod)


def _assert_matches(cfg, mod_name, stream):
    rng = np.random.default_rng([SEED, stream])
    mod = MODS[mod_name](rng, cfg.batch, cfg.heads_q, max(cfg.seqlen_q, cfg.seqlen_k))
    inputs = sweep.make_inputs(cfg, rng)
    kernel = _run(cfg, mod, inputs, "kernel")
    reference = _run(cfg, mod, inputs, "reference")
    errors = sweep.compare(cfg, kernel, reference, inputs)
    bad = sweep.check(cfg, errors)
    assert not bad, f"{mod_name} {cfg} (seed {SEED}, stream {stream}): {bad}; all errors {errors}"
    return mod, kernel, reference


def _cfg(**kw):
    base = dict(dtype="bfloat16", batch=2, seqlen_q=333, seqlen_k=333, heads_q=4, heads_k=2, head_dim=128)
    base.update(kw)
    return sweep.Config(**base)


# Every mod at the main shapes: D 128 and 64 and an odd width, both dtypes, GQA, Sq != Sk both ways.
SHAPES = [
    _cfg(),
    _cfg(dtype="float16", head_dim=64, seqlen_q=200, seqlen_k=517, heads_q=6, heads_k=3),
    _cfg(head_dim=80, seqlen_q=517, seqlen_k=190, heads_q=8, heads_k=1),
    _cfg(dtype="float16", head_dim=40, head_dim_v=72, seqlen_q=129, seqlen_k=1000, batch=3, heads_q=2, heads_k=2),
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("mod_name", sorted(MODS))
def test_mod_matches_reference(mod_name, shape):
    _assert_matches(SHAPES[shape], mod_name, 1000 * shape + sorted(MODS).index(mod_name))


# The band ANDed (causal, windows that empty rows), softcap, sinks, long keys, single rows (decode), more widths.
FEATURES = [
    _cfg(causal=True),
    _cfg(window_size=(60, 5), seqlen_q=700, seqlen_k=900),
    _cfg(causal=True, window_size=(20, -1), seqlen_q=900, seqlen_k=300),
    _cfg(softcap=30.0),
    _cfg(sinks=True, dtype="float16"),
    _cfg(sinks=True, softcap=5.0, causal=True, head_dim=192, heads_q=4, heads_k=4),
    _cfg(head_dim=256, seqlen_q=300, seqlen_k=611, causal=True),
    _cfg(head_dim=96, seqlen_q=1, seqlen_k=2049),
    _cfg(seqlen_q=2100, seqlen_k=2100, batch=1, heads_q=2, heads_k=1),
]


@pytest.mark.parametrize("feature", range(len(FEATURES)))
@pytest.mark.parametrize("mod_name", ["document", "prefix_lm_window", "global_local", "per_head",
                                      "rows_without_keys"])
def test_mod_with_features_matches_reference(mod_name, feature):
    _assert_matches(FEATURES[feature], mod_name, 50_000 + 100 * feature + sorted(MODS).index(mod_name))


# The sm90 backward's per-key-block lists (issue 38): per-head bits under GQA, so that the heads of one CTA's group
# walk different lists (some empty), Sq != Sk both ways, lengths no tile divides, the band ANDed, each width's tiles
# (D 64 / 128: 128-key CTAs; 192 / 256: 64-key CTAs). On Hopper explain must name the sm90 backward (the sm80 one
# where FLASHJAX_DISABLE_FAMILIES=sm90).
LIST_SHAPES = [
    _cfg(head_dim=64, seqlen_q=300, seqlen_k=517, heads_q=8, heads_k=2),
    _cfg(head_dim=128, seqlen_q=517, seqlen_k=190, heads_q=8, heads_k=2, causal=True),
    _cfg(dtype="float16", head_dim=256, seqlen_q=333, seqlen_k=611, heads_q=4, heads_k=2, window_size=(100, 20)),
    _cfg(head_dim=192, seqlen_q=130, seqlen_k=257, heads_q=6, heads_k=3, softcap=5.0, sinks=True),
    _cfg(head_dim=128, seqlen_q=1, seqlen_k=700, heads_q=8, heads_k=2),
]


@pytest.mark.parametrize("shape", range(len(LIST_SHAPES)))
@pytest.mark.parametrize("mod_name", ["per_head", "some_heads_blind", "document"])
def test_per_head_lists_of_the_backward_match_reference(mod_name, shape):
    cfg = LIST_SHAPES[shape]
    mod, (out, lse, grads), (_, _, reference_grads) = _assert_matches(
        cfg, mod_name, 70_000 + 100 * shape + sorted(MODS).index(mod_name))
    dtype = jnp.dtype(cfg.dtype)
    q = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim), dtype)
    k = jax.ShapeDtypeStruct((cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim), dtype)
    text = flashjax.explain(q, k, k, causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap,
                            mask_mod=mod)
    if _sm90_mask_mod("bwd", cfg.head_dim):
        assert "backward: sm90 backward kernel" in text, text
    elif _on_hopper() and "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(","):
        assert "backward: sm80 backward kernel" in text, text
    if mod_name == "some_heads_blind":  # blind heads: no gradient into q; KV heads whose group is all blind: none
        group = cfg.heads_q // cfg.heads_k
        dq, dk, dv = (np.asarray(g, np.float32) for g in grads[:3])
        assert np.all(dq[:, :, :mod.blind] == 0)
        assert np.all(dk[:, :, :mod.blind // group] == 0) and np.all(dv[:, :, :mod.blind // group] == 0)
        # The other KV heads get a gradient where the band leaves their heads some key (with a band shifted by
        # Sq != Sk it may not: then none, as the reference says).
        reference_dk = np.asarray(reference_grads[1], np.float32)
        assert np.any(dk[:, :, mod.blind // group:] != 0) == np.any(reference_dk[:, :, mod.blind // group:] != 0)
        for g in (dq, dk, dv):
            assert np.all(np.isfinite(g))


# deterministic=True (the sm90 backward's dQ writers take turns per query block, ranked by the tile classes their
# lists come from: bwd_dq_order.cuh): matches the reference, and four more runs give the same bits. Documents under a
# causal band (the grid launched from the last key block), a prefix-LM mod with no band (launch order, many
# contributors per block, Sk > Sq), per-head classes with GQA, heads whose every tile is empty, a mod window inside a
# native two-sided one with softcap and sinks, and more key blocks than SMs.
DETERMINISTIC_CASES = [
    ("document", _cfg(seqlen_q=1500, seqlen_k=1500, heads_q=8, heads_k=2, causal=True, deterministic=True)),
    ("prefix_lm", _cfg(dtype="float16", head_dim=64, seqlen_q=1000, seqlen_k=3000, deterministic=True)),
    ("per_head", _cfg(seqlen_q=700, seqlen_k=1200, heads_q=6, heads_k=2, deterministic=True)),
    ("some_heads_blind", _cfg(seqlen_q=900, seqlen_k=900, heads_q=4, heads_k=1, causal=True, deterministic=True)),
    ("sliding_window", _cfg(seqlen_q=1100, seqlen_k=1300, window_size=(300, 100), softcap=5.0, sinks=True,
                            deterministic=True)),
    ("causal", _cfg(head_dim=64, batch=1, seqlen_q=17000, seqlen_k=17000, heads_q=1, heads_k=1, deterministic=True)),
]


@pytest.mark.parametrize("case", range(len(DETERMINISTIC_CASES)))
def test_deterministic_backward_matches_and_repeats_bit_for_bit(case):
    mod_name, cfg = DETERMINISTIC_CASES[case]
    if not (_on_hopper() and _sm90_mask_mod("bwd", cfg.head_dim)):
        pytest.skip("needs an sm90 device and a build whose sm90 backward takes mask mods at this head dim")
    rng = np.random.default_rng([SEED, 95_000 + case])
    mod = MODS[mod_name](rng, cfg.batch, cfg.heads_q, max(cfg.seqlen_q, cfg.seqlen_k))
    inputs = sweep.make_inputs(cfg, rng)
    q, k, v, sinks, *_ = inputs
    text = flashjax.explain(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks, softcap=cfg.softcap,
                            mask_mod=mod, deterministic=True)
    assert "sm90 backward kernel" in text and "fixed order" in text, text
    first = _run(cfg, mod, inputs, "kernel")
    bad = sweep.check(cfg, sweep.compare(cfg, first, _run(cfg, mod, inputs, "reference"), inputs))
    assert not bad, f"{mod_name} {cfg} (seed {SEED}): {bad}"
    sweep.assert_grads_repeat(first, lambda: _run(cfg, mod, inputs, "kernel"), f"{mod_name} {cfg}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rows_without_keys_give_zeros_and_no_nan(dtype):
    cfg = _cfg(dtype=dtype, sinks=False)
    mod, (out, lse, grads), _ = _assert_matches(cfg, "rows_without_keys", 90_000 + (dtype == "float16"))
    rows = np.arange(cfg.seqlen_q) % mod.period == mod.phase
    assert np.all(np.asarray(out, np.float32)[:, rows] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, rows]))
    assert np.all(np.asarray(grads[0], np.float32)[:, rows] == 0)
    for g in grads[:3]:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_bits_layouts_are_the_contracts():
    """The mods above reach each layout the kernels index: broadcast over both, per batch, and per batch and head."""
    shapes = {name: mask_bits.mask_bits_shape(MODS[name](np.random.default_rng(0), 2, 4, 64), batch=2, heads=4,
                                              seqlen_q=64, seqlen_k=64)[:2]
              for name in ("causal", "document", "per_head")}
    assert shapes == {"causal": (1, 1), "document": (2, 1), "per_head": (2, 4)}


def _sm90_mask_mod(direction, head_dim=128):
    """Whether dispatch gives mask-mod calls of this direction to the sm90 family here: an sm90 device, the build's
    bf16 sm90 row of that width marked mask_mod, and the family not switched off (the sm80 mode)."""
    device = flashjax._ffi.default_device()
    if device is None or device[0] != 90 or "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(","):
        return False
    return any(row["family"] == "sm90" and row["direction"] == direction and row["dtype"] == "bf16" and
               row["head_dim"] == head_dim and row.get("mask_mod")
               for row in flashjax._ffi.build_info().get("kernels", []))


def _on_hopper():
    device = flashjax._ffi.default_device()
    return device is not None and device[0] == 90


def test_explain_names_the_mask_mod_families():
    q = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    text = flashjax.explain(q, k, k, causal=True, mask_mod=flashjax.causal_mask())
    family = "sm90" if _sm90_mask_mod("fwd") else "sm80"
    forward = text.split("backward: ", 1)[0]
    assert f": kernel ({family} forward kernel" in forward and "mask mod" in forward, text
    if family == "sm90":  # its own tiles, each walking a block list; unpacked, unsplit
        assert "the mask-mod kernel's" in forward and "GQA packed" not in forward, text
    backward_family = "sm90" if _sm90_mask_mod("bwd") else "sm80"
    assert f"backward: {backward_family} backward kernel" in text, text
    if backward_family == "sm90":  # each key block walks its list of query blocks
        assert "each key block walks its list of query blocks" in text, text
    # On Hopper a build with the sm90 backward's row takes mask mods there (the row must be marked mask_mod), unless
    # the sm80 mode switched that family off.
    has_row = any(row["family"] == "sm90" and row["direction"] == "bwd" and row["dtype"] == "bf16" and
                  row["head_dim"] == 128 for row in flashjax._ffi.build_info().get("kernels", []))
    if _on_hopper() and has_row:
        disabled = "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(",")
        assert backward_family == ("sm80" if disabled else "sm90"), text
    # The tangent's kernel (test_mask_mod_jvp.py checks its family and its results).
    assert re.search(r"tangent \(jax\.jvp\): sm(80|90) tangent kernel", text), text
    # deterministic=True: the sm90 backward orders a mask-mod call's dq adds; the sm80 backward cannot (atomics), so
    # there the call runs on the reference (the kernels run a call only where both passes have one), saying why.
    ordered = flashjax.explain(q, k, k, causal=True, mask_mod=flashjax.causal_mask(), deterministic=True)
    if backward_family == "sm90":
        assert "sm90 backward kernel" in ordered and "fixed order" in ordered, ordered
    else:
        assert "deterministic=True" in ordered and "sm80 backward kernel" not in ordered, ordered


def test_a_mod_the_kernels_cannot_compile_falls_back_or_raises():
    @dataclasses.dataclass(frozen=True)
    class Sine(MaskMod):
        def __call__(self, b, h, q_idx, kv_idx):
            return jnp.sin(q_idx.astype(jnp.float32)) > kv_idx.astype(jnp.float32) * 0

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    from flashjax.mask_trace import MaskModCodegenError
    with pytest.raises(MaskModCodegenError, match="Sine"):
        flashjax.flash_attn(q, q, q, mask_mod=Sine(), backend="kernel")
    with pytest.warns(UserWarning, match="reference"):
        out = flashjax.flash_attn(q, q, q, mask_mod=Sine())
    assert out.shape == q.shape


def test_new_field_values_reuse_the_compiled_call():
    cfg = _cfg(seqlen_q=256, seqlen_k=256)
    rng = np.random.default_rng([SEED, 7])
    q, k, v, *_ = sweep.make_inputs(cfg, rng)
    f = jax.jit(lambda q, k, v, mod: flashjax.flash_attn(q, k, v, mask_mod=mod, backend="kernel"))
    first = f(q, k, v, flashjax.document_mask(_doc_ids(rng, 2, 256, 4)))
    second = f(q, k, v, flashjax.document_mask(_doc_ids(rng, 2, 256, 6)))
    assert f._cache_size() == 1
    assert not np.array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))


def test_vmap_over_documents_matches_each_call():
    cfg = _cfg(seqlen_q=200, seqlen_k=200)
    rng = np.random.default_rng([SEED, 8])
    q, k, v, *_ = sweep.make_inputs(cfg, rng)
    ids = jnp.stack([_doc_ids(rng, 2, 200, 3), _doc_ids(rng, 2, 200, 5)])
    call = lambda ids: flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(ids), backend="kernel")
    mapped = jax.vmap(call)(ids)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(mapped[i], np.float32), np.asarray(call(ids[i]), np.float32))
