"""The primitive wiring (JVP -> tangent, tangent transpose -> bwd, batching) checked numerically on CPU.

Off CUDA the primitives lower to the reference, so these tests exercise exactly the rules the kernel path uses
(which primitive appears where, workspace shapes, vmap folding and its per-example fallback) against plain
autodiff of the reference.
"""
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import primitives, reference

B, SQ, SK, HQ, HK, D = 2, 6, 9, 4, 2, 16


def _inputs(seed):
    rng = np.random.default_rng(seed)
    shapes = [(B, SQ, HQ, D), (B, SK, HK, D), (B, SK, HK, D), (HQ,)]
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _params(has_sinks=True, window=(3, 0), softcap=0.0):
    return dict(softmax_scale=0.37, softcap=softcap, window_left=window[0], window_right=window[1],
                has_sinks=has_sinks)


def _loss_prim(params, ct_out, ct_lse):
    def loss(q, k, v, s):
        out, lse = primitives.forward(q, k, v, s, **params)
        return jnp.sum(out * ct_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
    return loss


def _loss_ref(params, ct_out, ct_lse):
    def loss(q, k, v, s):
        out, lse = reference.attention(q, k, v, softmax_scale=params["softmax_scale"], causal=False,
                                       window_size=(params["window_left"], params["window_right"]),
                                       sinks=s if params["has_sinks"] else None, softcap=params["softcap"],
                                       mask_mod=None)
        return jnp.sum(out * ct_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
    return loss


def _cotangents(seed):
    rng = np.random.default_rng(seed + 100)
    return (jnp.asarray(rng.standard_normal((B, SQ, HQ, D)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, HQ, SQ)), jnp.float32))


def _primitive_names(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitive_names(sub)
    return names


@pytest.mark.parametrize("seed,has_sinks,softcap", [(0, True, 0.0), (1, False, 0.0), (2, True, 2.0)])
def test_grad_runs_fwd_and_bwd_and_matches_reference(seed, has_sinks, softcap):
    params = _params(has_sinks, softcap=softcap)
    args = _inputs(seed)
    cts = _cotangents(seed)
    grad_prim = jax.grad(_loss_prim(params, *cts), argnums=(0, 1, 2, 3))
    names = _primitive_names(jax.make_jaxpr(grad_prim)(*args).jaxpr)
    assert {"flashjax_fwd", "flashjax_bwd"} <= names and "flashjax_tangent" not in names
    got = jax.jit(grad_prim)(*args)
    want = jax.grad(_loss_ref(params, *cts), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_backward_given_longer_rows_gives_the_blocks_share():
    # The kernels' contract, which the reference lowering keeps (reference.attention_vjp): given the out and lse of
    # whole rows, the backward of one block of keys gives that block's share of the gradient (ring attention's
    # blocks); the shares add up to the whole call's.
    params = _params(has_sinks=False, window=(-1, -1), softcap=1.5)
    q, k, v, sinks = _inputs(4)
    ct_out, ct_lse = _cotangents(4)

    @jax.jit
    def shares(q, k, v, sinks, ct_out, ct_lse):
        out, lse = primitives.forward(q, k, v, sinks, **params)
        backward = lambda k, v: primitives.backward(q, k, v, out, lse, ct_out, ct_lse, sinks, has_dlse=True, **params)
        return backward(k, v), [backward(k[:, a:b], v[:, a:b]) for a, b in ((0, 4), (4, SK))]

    whole, (first, second) = shares(q, k, v, sinks, ct_out, ct_lse)
    for name, got, want in (("dq", first[0] + second[0], whole[0]),
                            ("dk", jnp.concatenate([first[1], second[1]], axis=1), whole[1]),
                            ("dv", jnp.concatenate([first[2], second[2]], axis=1), whole[2])):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


def test_grad_through_lse_only():
    params = _params()
    args = _inputs(3)
    f_prim = lambda *a: jnp.sum(jnp.where(jnp.isfinite(l := primitives.forward(*a, **params)[1]), l, 0.0))
    got = jax.grad(f_prim, argnums=(0, 1, 3))(*args)
    _, ct_lse = _cotangents(3)
    want = jax.grad(_loss_ref(params, jnp.zeros((B, SQ, HQ, D)), jnp.ones_like(ct_lse)), argnums=(0, 1, 3))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_jvp_runs_tangent_and_matches_reference(monkeypatch, fused):
    # Plain jax.jvp binds the fused pass (flashjax_jvp) unless FLASHJAX_FUSED_JVP=0, then the forward and the tangent.
    monkeypatch.setenv("FLASHJAX_FUSED_JVP", "1" if fused else "0")
    params = _params()
    args = _inputs(4)
    tangents = _inputs(5)
    cts = _cotangents(4)
    jvp_prim = lambda *a: jax.jvp(_loss_prim(params, *cts), args, a)
    names = _primitive_names(jax.make_jaxpr(jvp_prim)(*tangents).jaxpr)
    assert "flashjax_bwd" not in names
    if fused:
        assert "flashjax_jvp" in names and not {"flashjax_fwd", "flashjax_tangent"} & names
    else:
        assert {"flashjax_fwd", "flashjax_tangent"} <= names and "flashjax_jvp" not in names
    _, got = jvp_prim(*tangents)
    _, want = jax.jvp(_loss_ref(params, *cts), args, tangents)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_jvp_of_grad_runs_the_backward_and_matches_reference():
    # Forward over reverse: bwd's JVP rule (the backward's gradients, the reference backward's JVP as their tangent).
    params = _params()
    args, tangents, cts = _inputs(14), _inputs(15), _cotangents(14)
    got = jax.jvp(jax.grad(_loss_prim(params, *cts), argnums=(0, 1, 2, 3)), args, tangents)[1]
    want = jax.jvp(jax.grad(_loss_ref(params, *cts), argnums=(0, 1, 2, 3)), args, tangents)[1]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("has_sinks", [False, True])
def test_cuda_lowering_of_the_tangent(monkeypatch, has_sinks):
    # Where the plan has a tangent kernel (here: planned for an A100), jvp lowers to flashjax_tangent with q, k, v, o,
    # lse, tq, tk, tv [, sinks, tsinks]; where it has none (no GPU to plan for), to the reference's tangent.
    from flashjax import _ffi
    monkeypatch.setattr(primitives._ffi, "register_targets", lambda: None)
    params = _params(has_sinks)
    q, k, v, s = (x.astype(jnp.bfloat16) if x.ndim == 4 else x for x in _inputs(16))
    # A fresh function per lowering: jit would reuse the first lowering for the second device.
    jvp = lambda: lambda *a: jax.jvp(lambda *p: primitives.forward(*p, **params), a, a)[1]
    if not _ffi.available():
        pytest.skip("libflashjax.so not built")
    monkeypatch.setattr(primitives._ffi, "default_device", lambda: None)
    assert "flashjax_tangent" not in _cuda_ffi_operand_counts(jvp(), q, k, v, s)
    monkeypatch.setattr(primitives._ffi, "default_device", lambda: (80, 108))
    plan = primitives.lowering_plan(q, k, **params)
    if plan["tangent"]["family"] is None:
        pytest.skip(f"no tangent kernel for this call in the build: {plan['tangent']['reason']}")
    assert _cuda_ffi_operand_counts(jvp(), q, k, v, s)["flashjax_tangent"] == [8 + 2 * has_sinks]


@pytest.mark.parametrize("has_sinks", [False, True])
def test_cuda_lowering_of_a_mask_mod_tangent(monkeypatch, has_sinks):
    # jvp of a mask-mod call (issue 39) lowers to flashjax_tangent_mask_mod: q, k, v, o, lse, tq, tk, tv, the bits
    # [, sinks, tsinks], with the tile-class workspace the plan sizes for the tangent's tiles as its third result.
    # The plan is a stand-in (no library is needed to lower): a tangent kernel with a 2 x 4 x 3 x 50 byte workspace.
    monkeypatch.setattr(primitives._ffi, "register_targets", lambda: None)
    workspace = [{"name": "mask_tile_classes", "shape": [2, 4, 3, 50], "dtype": "uint8"}]
    fake_plan = {"fwd": {"family": "sm90", "num_splits": 1, "workspace": workspace},
                 "bwd": {"family": "sm80", "workspace": []},
                 "tangent": {"family": "sm90", "workspace": workspace}}
    monkeypatch.setattr(primitives, "lowering_plan", lambda *a, **k: fake_plan)
    params = dict(_params(has_sinks), has_mask_bits=True)
    q, k, v, s = (x.astype(jnp.bfloat16) if x.ndim == 4 else x for x in _inputs(17))
    bits = jnp.full((1, 1, SQ, (SK + 31) // 32), 0x1FF, jnp.uint32)
    # A fresh function per lowering: jit would reuse the first lowering for the second plan.
    jvp = lambda: lambda *a: jax.jvp(lambda *p: primitives.forward(*p, bits, **params), a, a)[1]
    text = jax.jit(jvp()).trace(q, k, v, s).lower(lowering_platforms=("cuda",)).as_text()
    calls = _ffi_operand_counts(text)
    assert calls["flashjax_tangent_mask_mod"] == [9 + 2 * has_sinks] and "flashjax_tangent" not in calls, calls
    call = next(line for line in text.splitlines() if "@flashjax_tangent_mask_mod" in line)
    assert "tensor<2x4x3x50xui8>" in call.split("->", 1)[1], call
    # Without a tangent kernel in the plan: the reference's tangent, no FFI tangent call.
    fake_plan["tangent"] = {"family": None, "workspace": []}
    calls = _cuda_ffi_operand_counts(jvp(), q, k, v, s)
    assert not any(target.startswith("flashjax_tangent") for target in calls), calls


def test_bwd_outputs_are_the_gradients():
    # The backward's workspace exists only inside its CUDA lowering (test_library.py checks it there): the primitive
    # returns the gradients and nothing else, so vmap and autodiff never see workspace shapes.
    q, k, v, s = _inputs(6)
    out, lse = primitives.forward(q, k, v, s, **_params())
    outs = jax.eval_shape(lambda *a: primitives.bwd_p.bind(*a, has_dlse=True, **_params()),
                          q, k, v, out, lse, out, lse, s)
    assert [o.shape for o in outs] == [q.shape, k.shape, v.shape, s.shape]


@pytest.mark.parametrize("in_axes", [(0, None, None, None), (0, 0, 0, None), (1, None, 2, None)])
def test_vmap_forward_folds_into_batch(in_axes):
    params = _params()
    q, k, v, s = _inputs(7)
    n = 3
    stacked = [jnp.stack([x * (1 + 0.1 * i) for i in range(n)], axis=ax) if ax is not None else x
               for x, ax in zip((q, k, v, s), in_axes)]
    got_out, got_lse = jax.vmap(lambda *a: primitives.forward(*a, **params), in_axes=in_axes)(*stacked)
    for i in range(n):
        one = [jnp.take(x, i, axis=ax) if ax is not None else x for x, ax in zip(stacked, in_axes)]
        out, lse = primitives.forward(*one, **params)
        np.testing.assert_allclose(got_out[i], out, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(jnp.isfinite(got_lse[i]), jnp.isfinite(lse))


def test_vmap_of_grad_gives_per_example_sink_gradients():
    params = _params()
    q, k, v, s = _inputs(8)
    cts = _cotangents(8)
    qs = jnp.stack([q, 2 * q, -q])
    got = jax.vmap(jax.grad(_loss_prim(params, *cts), argnums=(0, 3)), in_axes=(0, None, None, None))(qs, k, v, s)
    for i in range(3):
        want = jax.grad(_loss_ref(params, *cts), argnums=(0, 3))(qs[i], k, v, s)
        np.testing.assert_allclose(got[0][i], want[0], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got[1][i], want[1], rtol=2e-5, atol=2e-5)


def test_vmap_over_sinks_runs_per_example():
    params = _params()
    q, k, v, s = _inputs(9)
    sinks = jnp.stack([s, s + 1.0])
    got_out, _ = jax.vmap(lambda s: primitives.forward(q, k, v, s, **params))(sinks)
    for i in range(2):
        np.testing.assert_allclose(got_out[i], primitives.forward(q, k, v, sinks[i], **params)[0], rtol=1e-6)


def _cuda_ffi_operand_counts(fn, *args):
    """{FFI target: operand count of each call} in fn's StableHLO lowered for CUDA (lowering needs no GPU)."""
    return _ffi_operand_counts(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())


def _ffi_operand_counts(text):
    calls = {}
    for line in text.splitlines():
        if "stablehlo.custom_call @flashjax_" in line:
            target = line.split("@", 1)[1].split("(", 1)[0]
            operands = line.split("(", 1)[1].split(")", 1)[0]
            calls.setdefault(target, []).append(len([o for o in operands.split(",") if o.strip()]))
    return calls


@pytest.mark.parametrize("has_sinks", [False, True])
def test_cuda_lowering_leaves_unused_optional_operands_out(monkeypatch, has_sinks):
    # A zero placeholder passed to the FFI call would cost a fill kernel before every call on the GPU.
    monkeypatch.setattr(primitives._ffi, "register_targets", lambda: None)  # registration is for compiling only
    params = _params(has_sinks)
    q, k, v, s = (x.astype(jnp.bfloat16) if x.ndim == 4 else x for x in _inputs(10))
    fwd_only = lambda *a: primitives.forward(*a, **params)[0]
    assert _cuda_ffi_operand_counts(fwd_only, q, k, v, s) == {"flashjax_fwd": [3 + has_sinks]}
    out_only = lambda *a: jnp.sum(primitives.forward(*a, **params)[0].astype(jnp.float32))
    with_lse = lambda *a: jnp.sum(primitives.forward(*a, **params)[1])
    # bwd: q, k, v, o, lse, dout [, dlse when lse has a cotangent] [, sinks]
    assert _cuda_ffi_operand_counts(jax.grad(out_only), q, k, v, s)["flashjax_bwd"] == [6 + has_sinks]
    assert _cuda_ffi_operand_counts(jax.grad(with_lse), q, k, v, s)["flashjax_bwd"] == [7 + has_sinks]


def test_newest_export_artifact_has_todays_ffi_operands(monkeypatch):
    # tests/gpu/data keeps one jax.export artifact per FFI operand layout, and the GPU tests run each on today's
    # library. A lowering that passes different operands needs its own artifact (tests/gpu/export_fixture.py).
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "gpu"))
    monkeypatch.setattr(primitives._ffi, "register_targets", lambda: None)
    import export_fixture
    from jax import export

    def version(path):
        return tuple(int(x) for x in path.name.split("_")[1].split("."))

    newest = max((pathlib.Path(__file__).parents[1] / "gpu" / "data").glob("flashjax_*.jax_export"), key=version)
    stored = export.deserialize(newest.read_bytes()).mlir_module()
    today = export_fixture.export_call(export_fixture.fixture_function(), platforms=("cuda",))(
        *export_fixture.export_fixture_inputs()).mlir_module()
    assert _ffi_operand_counts(today) == _ffi_operand_counts(stored), newest.name
