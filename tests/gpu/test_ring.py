"""ring_attention and the sharding rule on the GPU kernels, against the reference (docs/sharding.md).

Rings of several devices run on virtual CPU devices in tests/cpu/test_ring.py; here the same code runs its blocks on
the kernels. One GPU: a ring of one device (every block call the kernels, the ring's custom_vjp backward), and the
ring's block machinery on key blocks of one call, which a ring of 1 never exercises: each block's backward kernel is
given the merged out and lse, and the blocks' gradients must add up to the call's. With two or more GPUs: batch and
head sharding compiles to per-device kernel calls with no collective, and the ring's schedule is printed (whether
XLA runs the K/V transfers while the kernels compute).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flashjax
import sweep
from flashjax import api, ring, ring_plan

RING_CASES = [
    ("zigzag", sweep.Config(dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=2, head_dim=64,
                            causal=True)),
    ("contiguous", sweep.Config(dtype="bfloat16", batch=1, seqlen_q=257, seqlen_k=513, heads_q=8, heads_k=2,
                                head_dim=64, window_size=(100, 0), sinks=True)),
    ("contiguous", sweep.Config(dtype="float16", batch=2, seqlen_q=333, seqlen_k=200, heads_q=2, heads_k=2,
                                head_dim=128, head_dim_v=64, causal=True, softcap=5.0)),
    ("zigzag", sweep.Config(dtype="bfloat16", batch=1, seqlen_q=400, seqlen_k=600, heads_q=4, heads_k=1, head_dim=96,
                            window_size=(150, 40), sinks=True)),
]


def _ring_of_one(cfg, layout, inputs):
    """out, lse and the gradients as sweep.run gives them, from ring_attention on a 1-device mesh (the kernels)."""
    q, k, v, sinks, d_out, d_lse = inputs
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    seq = P(None, "seq")
    attend = jax.shard_map(
        lambda q, k, v, s: flashjax.ring_attention(q, k, v, sinks=s, axis_name="seq", layout=layout,
                                                   causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap,
                                                   return_lse=True, backend="kernel"),
        mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=(seq, P(None, None, "seq")))

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attend, q, k, v, sinks)
        return out, lse, vjp((d_out.astype(out.dtype), jnp.where(jnp.isfinite(lse), d_lse, 0.0)))

    return fwd_bwd(q, k, v, sinks, d_out, d_lse)


@pytest.mark.parametrize("layout,cfg", RING_CASES, ids=[f"{layout}-{cfg}" for layout, cfg in RING_CASES])
def test_a_ring_of_one_runs_the_kernels_and_matches(layout, cfg):
    inputs = sweep.make_inputs(cfg, np.random.default_rng(RING_CASES.index((layout, cfg))))
    errors = sweep.compare(cfg, _ring_of_one(cfg, layout, inputs), sweep.run(cfg, inputs, "reference"), inputs)
    bad = sweep.check(cfg, errors)
    assert not bad, f"{layout} {cfg}: {bad}; all errors {errors}"


BLOCK_CASES = [
    (sweep.Config(dtype="bfloat16", batch=2, seqlen_q=500, seqlen_k=700, heads_q=4, heads_k=2, head_dim=64,
                  causal=True), (250, 451)),
    (sweep.Config(dtype="bfloat16", batch=1, seqlen_q=640, seqlen_k=640, heads_q=8, heads_k=1, head_dim=128,
                  window_size=(200, 30)), (100, 333, 520)),
    (sweep.Config(dtype="float16", batch=2, seqlen_q=129, seqlen_k=1000, heads_q=2, heads_k=2, head_dim=64,
                  softcap=5.0), (500,)),
]


@pytest.mark.parametrize("cfg,cuts", BLOCK_CASES, ids=[str(cfg) for cfg, _ in BLOCK_CASES])
def test_block_kernels_given_the_merged_rows_add_up_to_the_call(cfg, cuts):
    """The keys cut into blocks as a ring would hand them over: each block's forward kernels merge through lse, and
    each block's backward kernel, given the merged out and lse, gives its share of the call's gradients."""
    q, k, v, _, d_out, d_lse = sweep.make_inputs(cfg, np.random.default_rng(BLOCK_CASES.index((cfg, cuts)) + 50))
    options = api._dense_call(q, k, v, causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap,
                              backend="kernel").options
    edges = (0, *cuts, cfg.seqlen_k)
    cases = [ring_plan.block_calls([(0, 0, cfg.seqlen_q)], [(0, start, stop - start)], cfg.seqlen_k - cfg.seqlen_q,
                                   options.window) for start, stop in zip(edges, edges[1:])]

    @jax.jit
    def blocks(q, k, v, d_out, d_lse):
        parts = [ring._forward_case(case, q, k[:, a:b], v[:, a:b], options=options)
                 for case, a, b in zip(cases, edges, edges[1:])]
        out, lse = parts[0]
        for part in parts[1:]:
            out, lse = ring._merge((out, lse), part)
        out = out.astype(q.dtype)
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
        grads = [ring._backward_case(case, q, k[:, a:b], v[:, a:b], out, lse, d_out, d_lse, options=options)
                 for case, a, b in zip(cases, edges, edges[1:])]
        dq = sum(g[0] for g in grads)
        dk = jnp.concatenate([g[1] for g in grads], axis=1)
        dv = jnp.concatenate([g[2] for g in grads], axis=1)
        return out, lse, (dq, dk, dv)

    inputs = (q, k, v, None, d_out, d_lse)
    errors = sweep.compare(cfg, blocks(q, k, v, d_out, d_lse), sweep.run(cfg, inputs, "reference"))
    bad = sweep.check(cfg, errors)
    assert not bad, f"{cfg} cut at {cuts}: {bad}; all errors {errors}"


def _two_gpus():
    if len(jax.devices()) < 2:
        pytest.skip("needs two or more GPUs")
    return len(jax.devices())


def test_batch_and_head_sharding_compiles_to_per_device_kernels():
    n = _two_gpus()
    mesh = jax.make_mesh((n,), ("heads",), axis_types=(AxisType.Auto,))
    cfg = sweep.Config(dtype="bfloat16", batch=2, seqlen_q=512, seqlen_k=512, heads_q=4 * n, heads_k=2 * n,
                       head_dim=64, causal=True, sinks=True)
    q, k, v, sinks, d_out, d_lse = sweep.make_inputs(cfg, np.random.default_rng(7))

    def fwd_bwd(q, k, v, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(lambda *a: flashjax.flash_attn(*a[:3], sinks=a[3], causal=True, return_lse=True,
                                                                 backend="kernel"), q, k, v, sinks)
        return out, lse, vjp((d_out, d_lse))

    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    args = (put(q, None, None, "heads"), put(k, None, None, "heads"), put(v, None, None, "heads"), put(sinks, "heads"),
            put(d_out, None, None, "heads"), put(d_lse, None, "heads"))
    text = jax.jit(fwd_bwd).lower(*args).compile().as_text()
    assert not re.search(r"(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", text), text
    assert re.search(rf"custom-call\(.*custom_call_target=\"flashjax_fwd", text.replace("\n", " ")), "no kernel call"
    errors = sweep.compare(cfg, jax.jit(fwd_bwd)(*args), sweep.run(cfg, (q, k, v, sinks, d_out, d_lse), "reference"))
    assert not sweep.check(cfg, errors), errors


def test_ring_schedule_on_several_gpus():
    """Prints whether XLA's schedule runs the ring's K/V transfers while the kernels compute: between a
    collective-permute-start and its done, is there a flashjax kernel call?"""
    n = _two_gpus()
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,))
    seq = P(None, "seq")
    attend = jax.jit(jax.shard_map(lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq", causal=True,
                                                                           layout="zigzag", backend="kernel"),
                                   mesh=mesh, in_specs=(seq,) * 3, out_specs=seq))
    x = jax.ShapeDtypeStruct((1, 4096 * n, 8, 128), jnp.bfloat16)
    lines = attend.lower(x, x, x).compile().as_text().splitlines()
    starts = {re.search(r"(%\S+) = ", l).group(1): i for i, l in enumerate(lines) if "collective-permute-start(" in l}
    assert starts, "no asynchronous collective-permute in the schedule"
    overlapped = 0
    for name, i in starts.items():
        done = next(j for j, l in enumerate(lines) if "collective-permute-done(" in l and name in l)
        overlapped += any("flashjax_fwd" in l for l in lines[i:done])
    print(f"ring of {n}: {overlapped} of {len(starts)} K/V transfers run while a flashjax kernel computes")
