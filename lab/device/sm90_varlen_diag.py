"""Issue 37 lab: where the sm90 varlen forward goes wrong. Runs small hand-picked packings through
flash_attn_varlen (backend="kernel") and the reference, and prints per sequence the out / lse error and which rows
(sequence-local) are off. Run it with the sm90 rows marked varlen in the kernel table (else dispatch sends varlen to
sm80, which this also shows: the explain line), and with FLASHJAX_SM90_PDL=0 / FLASHJAX_SM90_MAX_CTAS=1 to tell a
launch-order race and a tile-to-tile carry-over from a per-tile bug.
  python lab/device/sm90_varlen_diag.py"""
import os

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

CASES = [  # (name, q lengths, k lengths or None = same, causal, head dim)
    ("one-256", [256], None, False, 128),
    ("one-200", [200], None, False, 128),
    ("one-200-causal", [200], None, True, 128),
    ("two-128", [128, 128], None, False, 128),
    ("two-100-300", [100, 300], None, False, 128),
    ("two-100-300-causal", [100, 300], None, True, 128),
    ("q-k-differ", [5, 130, 64], [300, 7, 200], False, 128),
    ("empties", [0, 50, 0, 77], None, True, 128),
    ("decode", [1] * 8, [5, 64, 65, 128, 129, 300, 1, 700], False, 128),
    ("two-100-300-d64", [100, 300], None, False, 64),
    ("q-k-differ-d64", [5, 130, 64], [300, 7, 200], True, 64),
]


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def main():
    rng = np.random.default_rng(0)
    print("env:", {k: v for k, v in os.environ.items() if k.startswith("FLASHJAX")})
    for name, lq, lk, causal, d in CASES:
        lk = lk or lq
        cu_q, cu_k = offsets(lq), offsets(lk)
        tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 5  # padding tokens past the last sequence
        hq, hk = 4, 2
        q = jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((tk, hk, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((tk, hk, d)), jnp.bfloat16)
        args = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
        if name == CASES[0][0]:
            print(flashjax.explain(*args, causal=causal).splitlines()[0])
        got, got_lse = flashjax.flash_attn_varlen(*args, causal=causal, return_lse=True, backend="kernel")
        want, want_lse = flashjax.flash_attn_varlen(*args, causal=causal, return_lse=True, backend="reference")
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max(axis=(1, 2))  # per token
        gl, wl = np.asarray(got_lse), np.asarray(want_lse)
        with np.errstate(invalid="ignore"):
            lerr = np.where(gl == wl, 0.0, np.nan_to_num(np.abs(gl - wl), nan=1e9)).max(axis=0)
        lines = []
        for b in range(len(lq)):
            rows = slice(cu_q[b], cu_q[b + 1])
            e, le = err[rows], lerr[rows]
            bad = np.nonzero((e > 0.03) | ~np.isfinite(e))[0]
            if bad.size:
                lines.append(f"  seq {b} (q {lq[b]}, k {lk[b]}): out err {np.nanmax(e):.3g} nan {np.isnan(e).sum()} "
                             f"lse err {le.max():.3g}; bad rows {bad.size}: {bad[:6].tolist()}..{bad[-3:].tolist()}")
        tail = err[cu_q[-1]:]
        status = "ok" if not lines and np.all(tail == 0) else "BAD"
        print(f"{name}: {status} out err {np.nanmax(err):.3g} lse err {lerr.max():.3g} padding err {tail.max():.3g}")
        for line in lines:
            print(line)


if __name__ == "__main__":
    main()
