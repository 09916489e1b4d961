"""One small call per kernel path that landed untested (issues 37, 38, 39), each against the reference, each in a
subprocess-free loop with its own time print: the sm90 varlen forward (packed GQA decode and plain), the sm90 varlen
backward, the sm90 mask-mod forward, the sm90 tangent. A quick go / no-go before the full GPU suite; prints one line
per path and exits 1 if any is off (relative error by norm over 2e-2) or not finite."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

rng = np.random.default_rng(0)
ok = True


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6))


def report(name, start, errs):
    global ok
    bad = any(not np.isfinite(e) or e > 2e-2 for e in errs)
    ok &= not bad
    print(f"{'BAD ' if bad else 'ok  '}{name}: {', '.join(f'{e:.2e}' for e in errs)} ({time.time() - start:.1f} s)",
          flush=True)


def arr(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def varlen_case(name, lq, lk, hq, hk, d=128, causal=True):
    start = time.time()
    cq = jnp.asarray(np.concatenate([[0], np.cumsum(lq)]), jnp.int32)
    ck = jnp.asarray(np.concatenate([[0], np.cumsum(lk)]), jnp.int32)
    q, k, v = arr(int(sum(lq)), hq, d), arr(int(sum(lk)), hk, d), arr(int(sum(lk)), hk, d)

    def f(backend):
        def loss(q, k, v):
            return jnp.sum(flashjax.flash_attn_varlen(q, k, v, cq, ck, causal=causal, backend=backend)
                           .astype(jnp.float32) ** 2)
        out = flashjax.flash_attn_varlen(q, k, v, cq, ck, causal=causal, backend=backend)
        return (out,) + jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    got, ref = f("kernel"), f("reference")
    report(name, start, [rel(g, r) for g, r in zip(got, ref)])


varlen_case("varlen fwd+bwd, 6 sequences 1..700, GQA 8:2", [1, 63, 700, 129, 0, 300], [5, 64, 700, 200, 7, 300], 8, 2)
varlen_case("varlen decode GQA 32:8 (packed)", [1] * 8, [1000, 5000, 1, 32000, 77, 129, 4096, 2000], 32, 8)
varlen_case("varlen D 256 non-causal", [100, 37, 260], [90, 400, 260], 4, 4, d=256, causal=False)

start = time.time()
B, S, H = 2, 1000, 4
q, k, v = arr(B, S, H, 128), arr(B, S, H, 128), arr(B, S, H, 128)
ids = jnp.asarray(np.sort(rng.integers(0, 5, (B, S)), axis=1), jnp.int32)
mod = flashjax.document_mask(ids)
outs = [flashjax.flash_attn(q, k, v, causal=True, mask_mod=mod, backend=b) for b in ("kernel", "reference")]
report("mask mod forward (document, causal, B 2 S 1000)", start, [rel(*outs)])
start = time.time()
mod = flashjax.prefix_lm_mask(jnp.asarray([300, 0], jnp.int32))
outs = [flashjax.flash_attn(q, k, v, mask_mod=mod, backend=b) for b in ("kernel", "reference")]
report("mask mod forward (prefix-LM)", start, [rel(*outs)])

for d, causal in ((128, True), (64, False), (256, True)):
    start = time.time()
    q, k, v = arr(2, 700, 8, d), arr(2, 900, 2, d), arr(2, 900, 2, d)
    tq, tk, tv = arr(2, 700, 8, d), arr(2, 900, 2, d), arr(2, 900, 2, d)
    res = [jax.jvp(lambda q, k, v: flashjax.flash_attn(q, k, v, causal=causal, backend=b), (q, k, v), (tq, tk, tv))
           for b in ("kernel", "reference")]
    report(f"jvp D {d} {'causal' if causal else 'full'} GQA 8:2, Sq 700 Sk 900", start,
           [rel(res[0][0], res[1][0]), rel(res[0][1], res[1][1])])

print("smoke:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
