"""Forward mode of mask-mod calls on the tangent kernels (issue 39's "mask mods once they run on kernels"): jax.jvp and
jax.linearize of flash_attn with a mask mod run flashjax_tangent_mask_mod (the sm90 tangent on Hopper, the sm80 one
with FLASHJAX_DISABLE_FAMILIES=sm90 and on other GPUs) and match the reference's jvp on fresh random data with random
tangents for q, k, v and sinks: the mods of test_mask_mods.py (documents, causal + sliding window, a per-head mod,
rows with no visible key), both dtypes, GQA, Sq != Sk both ways, ragged lengths, D 64 / 128 / 192 / 256 and an odd
width, the band ANDed, softcap and sinks. Tolerances: test_jvp.py's (sweep.jvp_errors: the tangents get twice the
forward's). FLASHJAX_MASK_SEED replays one run (test_mask_mods.py prints it)."""
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
import sweep
import test_mask_mods as mods
from flashjax import mask_bits

SEED = mods.SEED


def _attention(cfg, mod, backend):
    def f(q, k, v, sinks):
        return flashjax.flash_attn(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                   softcap=cfg.softcap, mask_mod=mod, return_lse=True, backend=backend)
    return f


def _run_jvp(cfg, mod, primals, tangents, backend):
    """(out, lse), (t_out, t_lse) under jit with the mod (its fields) a jit argument; the reference in f32 on the same
    rounded values."""
    if backend == "reference":
        primals = tuple(x if x is None else x.astype(jnp.float32) for x in primals)
        tangents = tuple(x if x is None else x.astype(jnp.float32) for x in tangents)
    n = 4 if primals[3] is not None else 3

    @jax.jit
    def jvp(p, t, mod):
        f = _attention(cfg, mod, backend)
        g = f if n == 4 else (lambda q, k, v: f(q, k, v, None))
        return jax.jvp(g, p, t)

    with warnings.catch_warnings():  # the reference backend warns that it is the reference
        warnings.simplefilter("ignore")
        return jvp(primals[:n], tangents[:n], mod)


def _assert_jvp_matches(cfg, mod_name, stream):
    rng = np.random.default_rng([SEED, stream])
    mod = mods.MODS[mod_name](rng, cfg.batch, cfg.heads_q, max(cfg.seqlen_q, cfg.seqlen_k))
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    kernel = _run_jvp(cfg, mod, primals, tangents, "kernel")
    reference = _run_jvp(cfg, mod, primals, tangents, "reference")
    bad = sweep.jvp_errors(cfg, kernel, reference)
    assert not bad, f"{mod_name} {cfg} (seed {SEED}, stream {stream}): {bad}"
    return mod, kernel


_cfg = mods._cfg  # bf16, B 2, Sq = Sk = 333, Hq 4 / Hk 2, D 128 unless told

# Each mod at shapes that reach every tangent tile configuration: D 64 / 128 (64-key steps) and 192 / 256 (32-key
# steps), an odd width, both dtypes, GQA and MQA, Sq != Sk both ways, lengths that are no multiple of any tile.
JVP_SHAPES = [
    _cfg(),
    _cfg(dtype="float16", head_dim=64, seqlen_q=200, seqlen_k=517, heads_q=6, heads_k=3),
    _cfg(head_dim=80, seqlen_q=517, seqlen_k=190, heads_q=8, heads_k=1),
    _cfg(dtype="float16", head_dim=192, seqlen_q=300, seqlen_k=611, heads_q=4, heads_k=4),
    _cfg(head_dim=256, seqlen_q=129, seqlen_k=1000, batch=3, heads_q=2, heads_k=1),
]
JVP_MODS = ["document", "sliding_window", "per_head", "rows_without_keys", "global_local", "prefix_lm_window"]


@pytest.mark.parametrize("shape", range(len(JVP_SHAPES)))
@pytest.mark.parametrize("mod_name", JVP_MODS)
def test_jvp_of_a_mod_matches_the_reference(mod_name, shape):
    _assert_jvp_matches(JVP_SHAPES[shape], mod_name, 300_000 + 1000 * shape + JVP_MODS.index(mod_name))


# The band ANDed (causal + a sliding-window mod; a window that empties rows), softcap, sinks (their tangent too),
# decode (one query row), several 128-row tiles of keys on each side.
JVP_FEATURES = [
    _cfg(causal=True),
    _cfg(causal=True, window_size=(20, -1), seqlen_q=900, seqlen_k=300, dtype="float16"),
    _cfg(softcap=30.0, sinks=True),
    _cfg(sinks=True, softcap=5.0, causal=True, head_dim=256, heads_q=4, heads_k=2, dtype="float16"),
    _cfg(head_dim=64, seqlen_q=1, seqlen_k=2049, sinks=True),
    _cfg(seqlen_q=1100, seqlen_k=1300, batch=1, heads_q=2, heads_k=1, window_size=(300, 40)),
]


@pytest.mark.parametrize("feature", range(len(JVP_FEATURES)))
@pytest.mark.parametrize("mod_name", ["document", "sliding_window", "per_head", "rows_without_keys"])
def test_jvp_of_a_mod_with_features_matches_the_reference(mod_name, feature):
    _assert_jvp_matches(JVP_FEATURES[feature], mod_name, 310_000 + 100 * feature + JVP_MODS.index(mod_name))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_without_keys_have_zero_tangents(dtype, sinks):
    """A row the mod leaves without a key: t_out = 0 exactly; t_lse = 0 without sinks, the sink's tangent with them
    (lse is the sink's, whose whole weight it holds), as the reference's jvp gives."""
    cfg = _cfg(dtype=dtype, sinks=sinks, seqlen_q=290, seqlen_k=400)
    stream = 320_000 + 2 * sinks + (dtype == "float16")
    mod, (_, (t_out, t_lse)) = _assert_jvp_matches(cfg, "rows_without_keys", stream)
    rows = np.arange(cfg.seqlen_q) % mod.period == mod.phase
    assert np.all(np.asarray(t_out, np.float32)[:, rows] == 0)
    assert np.all(np.isfinite(np.asarray(t_out, np.float32))) and np.all(np.isfinite(np.asarray(t_lse)))
    if not sinks:
        assert np.all(np.asarray(t_lse)[:, :, rows] == 0)


def test_linearize_of_a_mod_matches_its_jvp():
    cfg = _cfg(seqlen_q=250, seqlen_k=300, sinks=True)
    rng = np.random.default_rng([SEED, 330_000])
    mod = mods.MODS["per_head"](rng, cfg.batch, cfg.heads_q, 300)
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    f = _attention(cfg, mod, "kernel")
    _, t_jvp = jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)
    _, f_lin = jax.linearize(f, *primals)
    for got, want in zip(jax.jit(f_lin)(*tangents), t_jvp):
        assert sweep.rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64)) <= 1e-6


def _tangent_family():
    """The family dispatch gives a bf16 D 128 mask-mod tangent here: sm90 on Hopper with a build whose sm90 tangent
    row takes mask mods and the family not switched off, sm80 otherwise."""
    device = flashjax._ffi.default_device()
    if device is None or device[0] != 90 or "sm90" in os.environ.get("FLASHJAX_DISABLE_FAMILIES", "").split(","):
        return "sm80"
    sm90 = any(row["family"] == "sm90" and row["direction"] == "tangent" and row["dtype"] == "bf16" and
               row["head_dim"] == 128 and row.get("mask_mod") for row in flashjax._ffi.build_info().get("kernels", []))
    return "sm90" if sm90 else "sm80"


def test_the_jvp_lowers_to_the_mask_mod_tangent_and_explain_names_its_family():
    q = jnp.zeros((2, 300, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 300, 2, 128), jnp.bfloat16)
    mod = flashjax.document_mask(jnp.zeros((2, 300), jnp.int32))
    f = lambda q, k, v: flashjax.flash_attn(q, k, v, causal=True, mask_mod=mod, backend="kernel")
    text = jax.jit(lambda p, t: jax.jvp(f, p, t)).lower((q, k, k), (q, k, k)).as_text()
    assert "flashjax_tangent_mask_mod" in text
    explained = flashjax.explain(q, k, k, causal=True, mask_mod=mod)
    family = _tangent_family()
    assert re.search(rf"tangent \(jax\.jvp\): {family} tangent kernel[^;]*mask mod", explained), explained


def test_a_jvp_with_new_field_values_does_not_recompile():
    cfg = _cfg(seqlen_q=256, seqlen_k=256)
    rng = np.random.default_rng([SEED, 340_000])
    primals, tangents = sweep.make_tangent_inputs(cfg, rng)
    primals, tangents = primals[:3], tangents[:3]

    @jax.jit
    def jvp(p, t, ids):
        f = lambda q, k, v: flashjax.flash_attn(q, k, v, mask_mod=flashjax.document_mask(ids), backend="kernel")
        return jax.jvp(f, p, t)[1]

    first = jvp(primals, tangents, mods._doc_ids(rng, 2, 256, 4))
    before = mask_bits.lowering_stats()
    second = jvp(primals, tangents, mods._doc_ids(rng, 2, 256, 6))
    assert mask_bits.lowering_stats() == before, "a new field value must not lower or compile anything"
    assert jvp._cache_size() == 1
    assert not np.array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))
