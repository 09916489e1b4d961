"""Varlen (packed) attention with a mask mod on the kernel path, wired on the CPU (issue 38, design §2.6-2.7).

api evaluates the mod into bits over the N sequences padded to the max_seqlen hints (b the sequence, indices local to
it), the varlen primitives carry them into the tangent and the backward, and off CUDA their reference lowerings
unpack them. Forced onto the kernel path (api.choose monkeypatched, as test_mask_bits_path.py does), every call must
equal the reference's with the mod itself. Also: the grid's hints (required under jit, checked against concrete
offsets), and the CUDA lowering's targets, operands and tile-class workspace (the plan faked; the GPU tests run the
kernels)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api, mask_bits, varlen_kernel
from flashjax.masks import MaskMod

HQ, HK, D = 4, 2, 16
LENGTHS_Q = [5, 0, 37, 1, 20]
LENGTHS_K = [9, 3, 41, 0, 20]  # q and k packed differently; an empty sequence on each side


@dataclasses.dataclass(frozen=True)
class HeadReach(MaskMod):
    """Per (sequence, head): key j visible to row i iff j <= i + reach[b, h] (bits per sequence and per head)."""

    reach: jax.Array

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.reach[b, h]


def _offsets(lengths, pad=0):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), int(np.sum(lengths)) + pad


def _mods(rng):
    n, longest = len(LENGTHS_Q), max(LENGTHS_Q + LENGTHS_K)
    ids = np.sort(rng.integers(0, 3, (n, longest - 4)), axis=1)  # shorter than the longest: past it, no document
    return {
        "document": flashjax.document_mask(jnp.asarray(ids, jnp.int32)),
        "per_head": HeadReach(jnp.asarray(rng.integers(-6, 12, (n, HQ)), jnp.int32)),
        "window": flashjax.sliding_window_mask(7, 2),
    }


def _inputs(rng, tq, tk):
    def normal(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return normal(tq, HQ, D), normal(tk, HK, D), normal(tk, HK, D), normal(HQ, dtype=jnp.float32)


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setattr(api, "choose", lambda call, device_sm=None: ("kernel", "forced", {"head_dim": 64}))


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all() == np.isfinite(w).all()
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=2e-2, atol=2e-2)


def _loss(call):
    def loss(q, k, v, sinks):
        out, lse = call(q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return loss


@pytest.mark.parametrize("name", ["document", "per_head", "window"])
@pytest.mark.parametrize("jit", [False, True])
def test_forced_kernel_path_equals_the_reference_with_the_mod(kernel_path, name, jit):
    rng = np.random.default_rng(len(name) + 10 * jit)
    cu_q, tq = _offsets(LENGTHS_Q, pad=3)  # 3 padding tokens past the last sequence
    cu_k, tk = _offsets(LENGTHS_K)
    mod = _mods(rng)[name]
    q, k, v, sinks = _inputs(rng, tq, tk)
    used_q = np.array([5, 0, 30, 1, 20], np.int32)
    used_k = np.array([7, 3, 41, 0, 11], np.int32)
    # Under jit the hints are required (and larger than the longest sequence here: a padded grid with slack).
    hints = dict(max_seqlen_q=40, max_seqlen_k=45) if jit else {}

    def call(backend):
        def fn(q, k, v, sinks):
            return flashjax.flash_attn_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), seqused_q=used_q,
                                              seqused_k=used_k, causal=True, sinks=sinks, mask_mod=mod,
                                              return_lse=True, backend=backend, **hints)
        return jax.jit(fn) if jit else fn

    if jit:  # (eager calls read the offsets' values: make_jaxpr would trace them)
        text = str(jax.make_jaxpr(call("kernel"))(q, k, v, sinks))
        assert "flashjax_fwd_varlen" in text and "has_mask_bits=True" in text, text
    _assert_close(call("kernel")(q, k, v, sinks), call("reference")(q, k, v, sinks))
    grads = [jax.grad(_loss(call(b)), argnums=(0, 1, 2, 3))(q, k, v, sinks) for b in ("kernel", "reference")]
    _assert_close(*grads)
    assert float(jnp.abs(grads[1][3]).sum()) > 0 and float(jnp.abs(grads[1][0].astype(jnp.float32)).sum()) > 0


def test_the_mod_changes_the_result(kernel_path):
    """The bits reach the kernel path: the same call without the mod differs."""
    rng = np.random.default_rng(3)
    cu_q, tq = _offsets(LENGTHS_Q)
    cu_k, tk = _offsets(LENGTHS_K)
    q, k, v, _ = _inputs(rng, tq, tk)
    mod = _mods(rng)["document"]
    with_mod = flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, mask_mod=mod, backend="kernel")
    without = flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, backend="kernel")
    assert not np.allclose(np.asarray(with_mod, np.float32), np.asarray(without, np.float32), atol=1e-2)


def test_jvp_takes_the_references_tangent_with_the_bits(kernel_path):
    rng = np.random.default_rng(4)
    cu_q, tq = _offsets(LENGTHS_Q)
    cu_k, tk = _offsets(LENGTHS_K)
    q, k, v, sinks = (x.astype(jnp.float32) for x in _inputs(rng, tq, tk))
    mod = _mods(rng)["per_head"]
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v, sinks))

    def call(backend):
        return lambda *a: flashjax.flash_attn_varlen(*a[:3], cu_q, cu_k, sinks=a[3], causal=True, mask_mod=mod,
                                                     backend=backend)

    # backend="kernel" takes f32 only on the reference: call the primitives the kernel path binds, at f32.
    grid = api._varlen_mask_grid(cu_q, cu_k, None, None)
    bits = mask_bits.mask_bits(mod, batch=len(LENGTHS_Q), heads=HQ, seqlen_q=grid[0], seqlen_k=grid[1])
    kernel = lambda q, k, v, s: varlen_kernel.attention(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), None, None, s, softmax_scale=D ** -0.5, softcap=0.0,
        window_left=-1, window_right=0, mask_bits=bits)[0]
    got = jax.jvp(kernel, (q, k, v, sinks), tangents)
    want = jax.jvp(call("reference"), (q, k, v, sinks), tangents)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_no_sequences_run_without_bits(kernel_path):
    """N = 0 (cu_seqlens of one entry): nothing to mask, no bits of batch 0; out 0, lse -inf, as without a mod."""
    rng = np.random.default_rng(7)
    q, k, v, _ = _inputs(rng, 6, 9)
    cu = np.zeros(1, np.int32)
    mod = flashjax.sliding_window_mask(3, 0)
    out, lse = flashjax.flash_attn_varlen(q, k, v, cu, cu, mask_mod=mod, return_lse=True, backend="kernel")
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_the_grid_is_the_hints_or_the_longest_concrete_sequence():
    cu_q, _ = _offsets(LENGTHS_Q)
    cu_k, _ = _offsets(LENGTHS_K)
    assert api._varlen_mask_grid(cu_q, cu_k, None, None) == (37, 41)
    assert api._varlen_mask_grid(cu_q, cu_k, 64, None) == (64, 41)
    assert api._varlen_mask_grid(np.zeros(3, np.int32), np.zeros(3, np.int32), None, None) == (1, 1)  # all empty
    traced = jax.ShapeDtypeStruct((6,), jnp.int32)
    assert api._varlen_mask_grid(traced, traced, 50, 60) == (50, 60)
    reason = api._varlen_mask_grid(traced, traced, 50, None)
    assert isinstance(reason, str) and "max_seqlen_q and max_seqlen_k" in reason and "max_seqlen_k is None" in reason
    with pytest.raises(ValueError, match=r"max_seqlen_q must be at least the longest sequence in cu_seqlens_q \(37"):
        api._varlen_mask_grid(cu_q, cu_k, 36, None)
    with pytest.raises(ValueError, match="max_seqlen_k must be at least the longest sequence in cu_seqlens_k"):
        api._varlen_mask_grid(cu_q, cu_k, 40, 40)


def test_under_jit_without_hints_kernel_raises_and_auto_runs_the_reference(kernel_path):
    rng = np.random.default_rng(5)
    cu_q, tq = _offsets(LENGTHS_Q)
    cu_k, tk = _offsets(LENGTHS_K)
    q, k, v, _ = _inputs(rng, tq, tk)
    mod = _mods(rng)["window"]

    def call(backend, **kw):
        return jax.jit(lambda q, cu_q, cu_k: flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, mask_mod=mod,
                                                                        backend=backend, **kw))

    with pytest.raises(ValueError, match="needs max_seqlen_q and max_seqlen_k under jit"):
        call("kernel", max_seqlen_q=40)(q, cu_q, cu_k)
    with pytest.warns(UserWarning, match="needs max_seqlen_q and max_seqlen_k under jit"):
        got = call("auto")(q, cu_q, cu_k)
    jaxpr = str(jax.make_jaxpr(call("auto"))(q, cu_q, cu_k))
    assert "flashjax_fwd_varlen" not in jaxpr  # the reference ran
    _assert_close(got, call("reference")(q, cu_q, cu_k))
    # A hint smaller than a concrete sequence: the kernels would cut it, so the call says so; the reference takes it.
    with pytest.raises(ValueError, match="max_seqlen_k must be at least"):
        flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, mask_mod=mod, max_seqlen_k=8, backend="kernel")


def test_the_reference_takes_a_short_hint_with_a_mod():
    """Only the kernel path needs the grid: the reference's hints cost time, never results (design §2.7)."""
    rng = np.random.default_rng(8)
    cu_q, tq = _offsets(LENGTHS_Q)
    cu_k, tk = _offsets(LENGTHS_K)
    q, k, v, _ = _inputs(rng, tq, tk)
    mod = _mods(rng)["window"]
    short_hint = flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, mask_mod=mod, max_seqlen_k=8, max_seqlen_q=4,
                                            backend="reference")
    _assert_close(short_hint, flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, mask_mod=mod, backend="reference"))


def test_the_reference_lowering_masks_rows_and_keys_past_the_grid():
    """A sequence longer than the bits' grid (a wrong hint under jit): its rows and keys past the grid see nothing,
    as the kernels cut it (flashjax/mask_grid.h), instead of jnp's clamped index."""
    bits = jnp.full((1, 1, 2, 1), 0xFFFFFFFF, jnp.uint32)  # 2 rows x 32 keys, all set
    mod = varlen_kernel.padded_bits_mask(bits)
    q_idx = jnp.arange(4).reshape(1, 1, 4, 1)
    kv_idx = jnp.array([0, 31, 32, 40]).reshape(1, 1, 1, 4)
    got = np.asarray(mod(jnp.zeros_like(q_idx), jnp.zeros_like(q_idx), q_idx, kv_idx))[0, 0]
    np.testing.assert_array_equal(got, [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def _fake_plan(asked):
    def plan(**call):
        asked.update(call)
        classes = {"name": "mask_tile_classes", "shape": [5, HQ, 1, 1], "dtype": "uint8"}
        rows = 256
        return {"fwd": {"workspace": [classes]},
                "bwd": {"workspace": [{"name": "dq_accum", "shape": [HQ, rows, 64], "dtype": "float32"},
                                      {"name": "dpsum", "shape": [HQ, rows], "dtype": "float32"},
                                      {"name": "lse_log2", "shape": [HQ, rows], "dtype": "float32"}, classes]},
                "tangent": {"family": None}}
    return plan


def test_cuda_lowering_calls_the_varlen_mask_mod_targets(monkeypatch):
    """flashjax_fwd_varlen_mask_mod / flashjax_bwd_varlen_mask_mod: the bits right after the offsets, then only the
    present optional operands, the tile-class workspace last; the plan asked for the bits' padded grid. The jvp
    lowers the reference's tangent (no tangent kernel takes varlen with a mask mod)."""
    monkeypatch.setattr(varlen_kernel._ffi, "register_targets", lambda: None)
    monkeypatch.setattr(varlen_kernel._ffi, "default_device", lambda: (90, 132))
    asked = {}
    monkeypatch.setattr(varlen_kernel._ffi, "plan", _fake_plan(asked))
    rng = np.random.default_rng(6)
    cu_q, tq = _offsets(LENGTHS_Q)
    cu_k, tk = _offsets(LENGTHS_K)
    q, k, v, sinks = (jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 64 - D)]) if x.ndim == 3 else x
                      for x in _inputs(rng, tq, tk))
    bits = jnp.zeros((5, HQ, 40, 2), jnp.uint32)  # max_seqlen_q 40, max_seqlen_k in (32, 64]
    used = jnp.zeros((5,), jnp.int32)

    def fwd(q, k, v, cu_q, cu_k):
        return varlen_kernel.attention(q, k, v, cu_q, cu_k, used, None, sinks, softmax_scale=0.25, softcap=0.0,
                                       window_left=-1, window_right=0, mask_bits=bits)

    def calls_of(fn, *args):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "stablehlo.custom_call @flashjax_" in line]

    calls = calls_of(fwd, q, k, v, cu_q, cu_k)
    assert len(calls) == 1 and "@flashjax_fwd_varlen_mask_mod(" in calls[0], calls
    operands = calls[0].split("(", 1)[1].split(")", 1)[0].split(",")
    assert len(operands) == 5 + 1 + 1 + 1  # q, k, v, the offsets, the bits, seqused_q, sinks
    assert "tensor<5x4x40x2xui32>" in calls[0] and f"tensor<5x{HQ}x1x1xui8>" in calls[0], calls[0]
    assert "has_mask_bits" not in calls[0] and "max_seqlen" not in calls[0]
    assert asked["varlen"] and asked["mask_mod"] and (asked["mask_seqlen_q"], asked["mask_seqlen_k"]) == (40, 64)

    loss = lambda q, k, v, cu_q, cu_k: fwd(q, k, v, cu_q, cu_k)[0].astype(jnp.float32).sum()
    calls = calls_of(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, cu_q, cu_k)
    names = [c.split("@", 1)[1].split("(", 1)[0] for c in calls]
    assert names == ["flashjax_fwd_varlen_mask_mod", "flashjax_bwd_varlen_mask_mod"], names
    operands = calls[1].split("(", 1)[1].split(")", 1)[0].split(",")
    assert len(operands) == 8 + 1 + 1 + 1  # q, k, v, o, lse, dout, the offsets, the bits, seqused_q, sinks
    assert "tensor<5x4x40x2xui32>" in calls[1].split("->")[0] and f"tensor<5x{HQ}x1x1xui8>" in calls[1]

    tangent = lambda q, k, v, cu_q, cu_k, tq: jax.jvp(lambda q: fwd(q, k, v, cu_q, cu_k), (q,), (tq,))[1]
    names = [c.split("@", 1)[1].split("(", 1)[0] for c in calls_of(tangent, q, k, v, cu_q, cu_k, q)]
    assert names == ["flashjax_fwd_varlen_mask_mod"], names  # the tangent: the reference's, lowered inline


@pytest.mark.parametrize("block_m,block_n", [(128, 64), (64, 128), (128, 32)])
def test_classes_of_the_padded_grid_hold_for_every_sequence(block_m, block_n):
    """mask_grid.h's argument, by brute force: the classes the kernels take over the padded grid (rows max_seqlen_q,
    keys the bits' whole words) never say full or empty where a sequence's own rows and keys disagree, so visiting a
    full tile without the bits or skipping an empty one is exact for every sequence length under the hints."""
    from flashjax import mask_tiles

    rng = np.random.default_rng(block_m + block_n)
    n, rows, keys = 4, 300, 290
    words = -(-keys // 32)
    # Bits from 64 x 64 blocks empty, full or random (all three classes at these tile sizes), bits past `keys` 0.
    kind = np.repeat(np.repeat(rng.integers(0, 3, (n, 1, 5, 5)), 64, axis=2), 64, axis=3)[:, :, :rows, :words * 32]
    dense = np.where(kind == 0, False, np.where(kind == 1, True, rng.random(kind.shape) < 0.5))
    dense[..., keys:] = False
    bits = np.zeros((n, 1, rows, words), np.uint32)
    for w in range(words):
        for j in range(32):
            bits[..., w] |= dense[..., 32 * w + j].astype(np.uint32) << np.uint32(j)
    classes = mask_tiles.tile_classes(bits, words * 32, block_m, block_n)  # as launch_mask_bits_tiles(grid)
    assert {mask_tiles.EMPTY, mask_tiles.PARTIAL, mask_tiles.FULL} <= set(np.unique(classes).tolist())
    unpacked = mask_tiles.unpack(bits, words * 32)
    for b in range(n):
        for used_q, used_k in ((rows, keys), (1, 1), (77, 130), (150, 33), (128, 64), (299, 257)):
            for m in range(-(-used_q // block_m)):
                for t in range(-(-used_k // block_n)):
                    part = unpacked[b, 0, m * block_m:min((m + 1) * block_m, used_q),
                                    t * block_n:min((t + 1) * block_n, used_k)]
                    c = classes[b, 0, m, t]
                    assert c != mask_tiles.FULL or part.all(), (b, used_q, used_k, m, t)
                    assert c != mask_tiles.EMPTY or not part.any(), (b, used_q, used_k, m, t)


def test_jvp_of_grad_carries_the_bits():
    """bwd_varlen's JVP (the reference backward's) with the bits as an operand: jvp of grad equals the reference's."""
    rng = np.random.default_rng(9)
    cu_q, tq = _offsets([5, 0, 12])
    cu_k, tk = _offsets([7, 2, 11])
    q, k, v, sinks = (x.astype(jnp.float32) for x in _inputs(rng, tq, tk))
    mod = flashjax.sliding_window_mask(3, 1)
    bits = mask_bits.mask_bits(mod, batch=3, heads=HQ, seqlen_q=12, seqlen_k=11)
    kernel = lambda q, k, v, s: varlen_kernel.attention(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), None, None, s, softmax_scale=0.25, softcap=0.0,
        window_left=-1, window_right=-1, mask_bits=bits)[0]
    ref = lambda q, k, v, s: flashjax.flash_attn_varlen(q, k, v, cu_q, cu_k, sinks=s, softmax_scale=0.25,
                                                        mask_mod=mod, backend="reference")
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v, sinks))
    hvp = lambda f: jax.jvp(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3)), (q, k, v, sinks),
                            tangents)
    for got, want in zip(jax.tree.leaves(hvp(kernel)), jax.tree.leaves(hvp(ref))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
