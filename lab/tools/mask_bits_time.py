"""How long does the mask-bits kernel take per call, and its first compile, for the masks issue 38 measures?

    python3 lab/tools/mask_bits_time.py [--reps 50] [--json OUT.json]      (on a GPU; PYTHONPATH=python)

Per row: the first lowering + XLA compile of a call with a cold NVRTC cache (and NVRTC's share of it), then the
kernel's time per call as the marginal cost of one more call: an executable of 11 calls (distinct operands, or for a
mod without array fields distinct static values, so XLA cannot merge them) against an executable of 1, best of
--reps each, divided by 10. Dispatch cost cancels; what is left is the kernel and its output's allocation. Each
row's bits are checked against mask_bits_reference first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["FLASHJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashjax-mask-bits-")  # cold: the first compile counts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flashjax import mask_bits as mb  # noqa: E402
from flashjax import masks  # noqa: E402
from flashjax.masks import MaskMod  # noqa: E402


@dataclasses.dataclass(frozen=True)
class HeadWindow(MaskMod):
    """Causal with a per-head window width: the bitmask keeps its head axis."""

    widths: jax.Array  # [H]

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.widths[h])


def _documents(rng, batch, seqlen, count):
    cuts = np.sort(rng.choice(np.arange(1, seqlen), count - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [seqlen]]))
    return np.stack([np.repeat(np.arange(count), rng.permutation(lengths)) for _ in range(batch)]).astype(np.int32)


# name, batch, heads, seqlen, make(rng, i): the i-th of 11 distinct calls
ROWS = [
    ("document16 B4 S4096", 4, 16, 4096, lambda rng, i: masks.document_mask(_documents(rng, 4, 4096, 16))),
    ("document16 B1 S16384", 1, 16, 16384, lambda rng, i: masks.document_mask(_documents(rng, 1, 16384, 16))),
    ("prefix_lm B4 S4096", 4, 16, 4096,
     lambda rng, i: masks.prefix_lm_mask(rng.integers(0, 4096, 4).astype(np.int32))),
    ("sliding_window(256+i, 0) S4096", 4, 16, 4096, lambda rng, i: masks.sliding_window_mask(256 + i, 0)),
    ("head_window H16 B1 S4096", 1, 16, 4096,
     lambda rng, i: HeadWindow(rng.integers(64, 4096, 16).astype(np.int32))),
]


def _best(fn, args, reps):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def measure(name, batch, heads, seqlen, make, reps):
    rng = np.random.default_rng(0)
    mods = [make(rng, i) for i in range(11)]
    sizes = dict(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen)
    nvrtc_before = mb.lowering_stats()["compile_seconds"]
    start = time.perf_counter()
    one = jax.jit(lambda m: mb.mask_bits(m, **sizes)).lower(mods[0]).compile()
    first = time.perf_counter() - start
    nvrtc = mb.lowering_stats()["compile_seconds"] - nvrtc_before
    got = one(mods[0])
    correct = bool(jnp.array_equal(got, mb.mask_bits_reference(mods[0], **sizes)))
    many = jax.jit(lambda *ms: [mb.mask_bits(m, **sizes) for m in ms]).lower(*mods).compile()
    calls_in_many = many.as_text().count("custom_call_target=\"flashjax_mask_bits\"")
    per_call = (_best(many, mods, reps) - _best(one, mods[:1], reps)) / 10
    bm, hm, sq, wk = got.shape
    evaluations = bm * hm * sq * seqlen
    return {"row": name, "shape": [bm, hm, sq, wk], "correct": correct, "first_compile_ms": first * 1e3,
            "nvrtc_ms": nvrtc * 1e3, "us_per_call": per_call * 1e6, "calls_in_11": calls_in_many,
            "g_evals_per_s": evaluations / per_call / 1e9 if per_call > 0 else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}")
    results = []
    for row in ROWS:
        result = measure(*row, reps=args.reps)
        results.append(result)
        print(f"{result['row']:<32} bits {str(result['shape']):<22} {'ok' if result['correct'] else 'WRONG':<5} "
              f"{result['us_per_call']:8.1f} us/call  {result['g_evals_per_s'] or 0:7.0f} G evals/s  "
              f"first compile {result['first_compile_ms']:6.0f} ms (NVRTC {result['nvrtc_ms']:4.0f} ms)"
              + ("" if result["calls_in_11"] == 11 else f"  [XLA kept {result['calls_in_11']} of 11 calls]"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
