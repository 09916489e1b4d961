"""Correctness of a `bench` kernel-set build (FLASHJAX_KERNEL_SET=bench: the sm90 bf16 forward and the sm80 bf16
backward at D 64/128/256, no softcap) against the reference, for kernel variants that only that set was built for
(lab/tools/ab_device.sh's CHECK): the GPU tests' fixed cases in that scope (growing maxima and late spikes with their
key scales), windows of every shape, causal with Sq != Sk and empty sequences, then random sweep configurations. One
"ok"/"FAIL" line per case, the summary last.

    FLASHJAX_LIBRARY=.../variant.so python3 lab/tools/bench_set_check.py [N_RANDOM] [--list]  (repository root, GPU)
"""
import dataclasses
import sys
sys.path.insert(0, "tests/gpu")
import jax.numpy as jnp
import numpy as np
import sweep
import test_kernels as tk
from flashjax import _ffi

C = sweep.Config
BUILT_HEAD_DIMS = (64, 128, 256)


def in_scope(cfg):  # the head dim the library pads to (the dispatcher's own rule) is a built one
    return (cfg.dtype == "bfloat16" and cfg.softcap == 0.0 and cfg.head_dim_v == cfg.head_dim
            and _ffi.padded_head_dim(cfg.head_dim) in BUILT_HEAD_DIMS)


args = [a for a in sys.argv[1:] if not a.startswith("--")]


def retyped(cfg):
    return dataclasses.replace(cfg, dtype="bfloat16", softcap=0.0)


# Most telling first: a call's time limit may cut the list (each case compiles its own kernel and reference calls).
cases = [  # (config, key scale along the keys or None[, query scale along the queries])
    (C(dtype="bfloat16", batch=2, seqlen_q=1000, seqlen_k=3001, heads_q=8, heads_k=2, head_dim=128,
       causal=True, sinks=True), None),
    (C(dtype="bfloat16", batch=2, seqlen_q=3001, seqlen_k=1000, heads_q=8, heads_k=2, head_dim=128, causal=True), None),
    (C(dtype="bfloat16", batch=1, seqlen_q=2500, seqlen_k=2500, heads_q=4, heads_k=1, head_dim=64, causal=True), None),
    (C(dtype="bfloat16", batch=1, seqlen_q=1800, seqlen_k=2100, heads_q=4, heads_k=2, head_dim=256,
       causal=True, sinks=True), None),
    (C(dtype="bfloat16", batch=1, seqlen_q=0, seqlen_k=100, heads_q=2, heads_k=2, head_dim=128, causal=True), None),
    (C(dtype="bfloat16", batch=1, seqlen_q=100, seqlen_k=0, heads_q=2, heads_k=2, head_dim=128), None),
]
# The GPU tests' tile-choice shapes in scope come first: a variant that changes tile sizes is checked there at once.
# Then queries whose rows of one thread have maxima far apart (test_kernels.FAR_APART_ROWS_CASES), then the above.
tile_choices = [(retyped(cfg), None) for cfg in tk.TILE_CHOICE_CASES if in_scope(retyped(cfg))]
far_apart = [(retyped(cfg), None, tk._alternating_queries(factor))
             for cfg in tk.FAR_APART_ROWS_CASES if in_scope(retyped(cfg)) for factor in (10.0, 40.0)]
cases = tile_choices + far_apart + cases
windows = [(100, 0), (0, 300), (257, 129), (1000, -1), (-1, 77), (0, 0), (3000, 3000)]
for i, window in enumerate(windows):
    d = BUILT_HEAD_DIMS[i % len(BUILT_HEAD_DIMS)]
    cases.append((C(dtype="bfloat16", batch=2, seqlen_q=700 + 37 * i, seqlen_k=1300 - 91 * i, heads_q=4, heads_k=2,
                    head_dim=d, window_size=window, sinks=i % 2 == 0), None))
for cfg in tk.GROWING_MAX_CASES:
    if in_scope(retyped(cfg)):
        cases.append((retyped(cfg), lambda n: jnp.linspace(0.5, 12.0, n)))
for cfg in tk.SPIKE_CASES:
    if in_scope(retyped(cfg)):
        cases.append((retyped(cfg), tk._late_spikes))
for cfg in tk.IDLE_ROWS_CASES:
    cases.append((retyped(cfg), None))
rng = np.random.default_rng(12345)
n_random = int(args[0]) if args else 20
while n_random > 0:
    cfg = sweep.random_config(rng)
    if in_scope(cfg):
        cases.append((cfg, None))
        n_random -= 1
cases = [case if len(case) == 3 else (*case, None) for case in cases]  # (config, key scale, query scale)
if "--list" in sys.argv:
    for cfg, key_scale, query_scale in cases:
        print(cfg, "(key scale)" if key_scale else "", "(query scale)" if query_scale else "")
    sys.exit(0)
bad = 0
for i, (cfg, key_scale, query_scale) in enumerate(cases):
    try:
        tk._assert_kernel_matches_reference(cfg, np.random.default_rng(1000 + i), f"case {i}", key_scale,
                                            query_scale)
        print("ok  ", cfg, flush=True)
    except Exception as err:  # noqa: BLE001
        bad += 1
        print("FAIL", cfg, str(err)[:300], flush=True)
print(f"bench-set check: {len(cases) - bad} of {len(cases)} ok")
